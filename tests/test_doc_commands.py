"""Every shell command in README.md and docs/*.md names a real make target with variables the
Makefile knows, or a real entry point whose own argparse parser accepts the arguments, and
real presets; the cheap ones run (``make help``, the README's ``make plan`` jobs).

Commands are the lines of ```sh/```bash/```shell/```console and unlabelled code blocks (in a
``console`` block only the lines that start with ``$ ``) and lines starting with ``$ `` outside
code blocks; a trailing backslash joins the next line. Output and listings go in ```text
blocks. A command whose comment contains ``placeholder`` stands for the user's own paths: its
target, module, flags and named presets are checked, its paths are not (keep these few).

Figures the docs quote from the planners are checked against what their command prints now,
so they cannot go stale: a ``make plan`` command's comment (``# fits: 147.7 of 167.4 GiB``:
every decimal figure in it), and each ``<!-- figures: A B ... | COMMAND -->`` line, which marks
the paragraph or table right after it (the figures must be quoted there and printed by
COMMAND, a ``make plan`` or ``python -m`` command; ``python -m moe_train.planner.compile ...
--plan-only`` prints the planner's column of ``make compile``). Not re-run, on purpose: what
XLA:GPU compiled (minutes per bucket; each such figure says its date) and timings.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_BLOCKS = {"", "sh", "bash", "shell", "console"}
MODEL_PRESETS = ROOT / "moe_train" / "config" / "presets"
CLUSTER_PRESETS = ROOT / "topology" / "presets"
# programs that are not the kit's: named, not checked (pip, the TensorBoard viewer, ...)
EXTERNAL = {"pip", "tensorboard", "wandb", "srun", "source", "git", "docker", "enroot", "cat"}
# environment variables a command may set in front of make (documented, not Makefile's)
DOC_ENV = {
    "MOE_TRAIN_COMPILE",
    "MOE_TRAIN_SITE",
    "WANDB_MODE",
    "WANDB_API_KEY",
    "XLA_FLAGS",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
}
KIT_PACKAGES = {"moe_train", "slurm", "topology", "containers"}
MAX_PLACEHOLDERS = 8
MAX_README_LINES = 250

# make target -> (module it runs, make variable -> flag, fixed arguments): the Makefile's recipes
MAKE_TARGETS = {
    "smoke": ("moe_train", {"OUT": "--out", "STEPS": "--steps"}, ["--preset", "tiny", "--fresh"]),
    "train": ("moe_train", {"MODEL": "--preset", "OUT": "--out", "STEPS": "--steps"}, []),
    "plan": (
        "moe_train.planner",
        {
            "PRESET": "--preset",
            "MODEL": "--model",
            "NODES": "--nodes",
            "EP": "--ep",
            "STEPS": "--steps",
            "COMPUTE": "--compute",
            "TOP": "--top",
        },
        [],
    ),
    "compile": (
        "moe_train.planner.compile",
        {"PRESET": "--preset", "MODEL": "--model", "NODES": "--nodes", "EP": "--ep", "STEPS": "--steps"},
        [],
    ),
    "submit": (
        "slurm.submit",
        {
            "PRESET": "--preset",
            "MODEL": "--model",
            "NODES": "--nodes",
            "EP": "--ep",
            "STEPS": "--steps",
            "OUT": "--out",
            "IMAGE": "--image",
            "COMPUTE": "--compute",
        },
        [],
    ),
}
MAKE_SWITCHES = {"submit": {"DRY_RUN": "--dry-run", "WAIT": "--wait"}, "compile": {"PEAK": "--peak"}}
# variables a recipe passes only when given (make submit: --out only for an OUT you set)
ONLY_WHEN_GIVEN = {"submit": {"OUT"}}


class Command:
    """One documented command: its words (comment removed), its comment, where it is."""

    def __init__(self, text: str, comment: str, where: str):
        self.text, self.comment, self.where = text, comment, where
        words = shlex.split(text)
        env = []
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            env.append(words.pop(0).split("=", 1)[0])
        self.env, self.words = env, words
        self.placeholder = "placeholder" in comment

    @property
    def module(self) -> tuple[str, list[str]] | None:
        """(module, its arguments) of a ``python -m`` command, else None."""
        w = self.words
        if self.python_m and w[2].split(".")[0] in KIT_PACKAGES:
            return w[2], w[3:]
        return None

    @property
    def python_m(self) -> bool:
        w = self.words
        return len(w) >= 3 and Path(w[0]).name in ("python", "python3") and w[1] == "-m"

    def __repr__(self) -> str:
        return f"{self.where}: {' '.join(self.text.split())}"


def _split_comment(line: str) -> tuple[str, str]:
    """The command and its trailing ``# comment`` (a ``#`` outside quotes after a space)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def _commands_of(path: Path) -> list[Command]:
    out, lang, pending, pending_comment, start = [], None, "", "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^```\s*(\S*)", line)
        if fence:
            lang = fence.group(1) if lang is None else None
            continue
        if lang is not None and lang not in COMMAND_BLOCKS:
            continue
        if lang is None or lang == "console":
            if not line.startswith("$ ") and not pending:
                continue
            line = line[2:] if line.startswith("$ ") else line
        if not line.strip() or (line.lstrip().startswith("#") and not pending):
            continue
        text, comment = _split_comment(line)
        start = start if pending else n
        if text.endswith("\\"):
            pending, pending_comment = pending + text[:-1] + " ", pending_comment + comment
            continue
        out.append(
            Command(
                pending + text, (pending_comment + " " + comment).strip(), f"{path.relative_to(ROOT)}:{start}"
            )
        )
        pending, pending_comment = "", ""
    return out


def all_commands() -> list[Command]:
    return [c for doc in DOCS for c in _commands_of(doc)]


COMMANDS = all_commands()
MAKE = [c for c in COMMANDS if c.words[:1] == ["make"]]
MODULES = [c for c in COMMANDS if c.module]


# ---- the Makefile ----------------------------------------------------------------------------


@lru_cache
def makefile() -> tuple[set[str], set[str], dict[str, str]]:
    """(targets, variables, defaults) of the Makefile."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9_-]*):(?!=)", text, re.M))
    defaults = dict(re.findall(r"^([A-Z_]+)[ \t]*\?=[ \t]*(.*)$", text, re.M))
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:]?=", text, re.M))
    variables |= set(re.findall(r"\$\(([A-Z_]+)\)", text))
    for line in re.findall(r"^export ([A-Z_ ]+)$", text, re.M):
        variables |= set(line.split())
    return targets, variables, defaults


def make_parts(c: Command) -> tuple[list[str], dict[str, str]]:
    """The targets and VAR=value assignments of a make command."""
    targets = [w for w in c.words[1:] if "=" not in w]
    assigns = dict(w.split("=", 1) for w in c.words[1:] if "=" in w)
    return targets, assigns


def make_as_module(c: Command) -> tuple[str, list[str]] | None:
    """The module a make command runs and its arguments, as the Makefile's recipe builds them."""
    targets, assigns = make_parts(c)
    if len(targets) != 1 or targets[0] not in MAKE_TARGETS:
        return None
    module, flags, fixed = MAKE_TARGETS[targets[0]]
    defaults = makefile()[2]
    skip = ONLY_WHEN_GIVEN.get(targets[0], set())
    values = {k: v for k, v in defaults.items() if k in flags and k not in skip and v and "$" not in v}
    values.update(assigns)
    if targets[0] in ("smoke", "train") and not values.get("OUT"):  # the recipes' default run dir
        values["OUT"] = "runs/smoke" if targets[0] == "smoke" else f"runs/{values.get('MODEL')}"
    args = list(fixed)
    for var, flag in flags.items():
        if values.get(var):
            args += [flag, values[var]]
    args += [a for s in values.get("SET", "").split() for a in ("--set", s)]
    args += [flag for var, flag in MAKE_SWITCHES.get(targets[0], {}).items() if assigns.get(var)]
    return module, args


# ---- the entry points' own parsers, read in one child process --------------------------------

_DUMP = r"""
import argparse, contextlib, io, json, runpy, sys

class Captured(Exception):
    pass

def capture(module):
    seen = []
    original = argparse.ArgumentParser.parse_known_args
    def grab(self, args=None, namespace=None):
        seen.append(self)
        raise Captured()
    argparse.ArgumentParser.parse_known_args = grab
    sys.argv = [module, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except Captured:
        pass
    finally:
        argparse.ArgumentParser.parse_known_args = original
    return seen[0] if seen else None

def check(parser, argv):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        return err.getvalue().strip() or f"exit {e.code}"
    return ""

def options(parser):
    opts, subs = [], {}
    for a in parser._actions:
        opts += a.option_strings
        if isinstance(a, argparse._SubParsersAction):
            subs = {name: options(p)[0] for name, p in a.choices.items()}
    return opts, subs

jobs = json.loads(sys.stdin.read())
out = {}
for module in sorted({m for m, _, _ in jobs}):
    try:
        parser = capture(module)
        helptext = parser.format_help() if parser else ""
        opts, subs = options(parser) if parser else ([], {})
        out[module] = {"help": bool(helptext), "options": opts, "subcommands": subs,
                       "errors": {}}
    except BaseException as e:
        out[module] = {"help": False, "options": [], "subcommands": {}, "errors": {},
                       "failed": f"{type(e).__name__}: {e}"}
        continue
    for m, argv, parse in jobs:
        if m == module and parse:
            out[module]["errors"][json.dumps(argv)] = check(parser, argv)
print(json.dumps(out))
"""


def _module_jobs() -> list[tuple[str, list[str], bool]]:
    """(module, arguments, parse them fully?) of every python -m and make command."""
    jobs = []
    for c in COMMANDS:
        job = c.module or (make_as_module(c) if c.words[:1] == ["make"] else None)
        if job:
            jobs.append((job[0], job[1], not c.placeholder))
    return jobs


@lru_cache
def parsers() -> dict:
    """Per module: its options, subcommands, and the parse error (or "") of each job."""
    proc = subprocess.run(
        [sys.executable, "-c", _DUMP],
        input=json.dumps(_module_jobs()),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def _preset_ok(value: str, kind: Path, placeholder: bool) -> bool:
    if value.endswith(".toml"):
        return placeholder or (ROOT / value).is_file()
    return (kind / f"{value}.toml").is_file()


# flags that name presets, per module: (flag, directory)
PRESET_FLAGS = {
    "moe_train": [("--preset", MODEL_PRESETS)],
    "moe_train.planner": [("--preset", CLUSTER_PRESETS), ("--model", MODEL_PRESETS)],
    "slurm.submit": [("--preset", CLUSTER_PRESETS), ("--model", MODEL_PRESETS)],
    "moe_train.planner.compile": [("--preset", CLUSTER_PRESETS), ("--model", MODEL_PRESETS)],
    "moe_train.planner.memory": [("--cluster", CLUSTER_PRESETS), ("--model", MODEL_PRESETS)],
    "topology": [("--preset", CLUSTER_PRESETS), ("--model", MODEL_PRESETS)],
    "containers.preflight": [("--preset", CLUSTER_PRESETS)],
}


def _ids(commands: list[Command]) -> list[str]:
    return [repr(c) for c in commands]


# ---- the tests -------------------------------------------------------------------------------


def test_the_docs_have_commands():
    assert len(MAKE) >= 10 and len(MODULES) >= 5


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES


def test_placeholders_stay_few():
    assert len([c for c in COMMANDS if c.placeholder]) <= MAX_PLACEHOLDERS


@pytest.mark.parametrize("c", COMMANDS, ids=_ids(COMMANDS))
def test_each_command_is_a_make_target_an_entry_point_or_a_named_tool(c):
    program = c.words[0]
    tool = c.words[2] if c.python_m else Path(program).name
    known = program == "make" or c.module is not None or tool in EXTERNAL or (ROOT / program).is_file()
    assert known, f"{c!r}: {program} is not make, python -m, a repository script or EXTERNAL"


@pytest.mark.parametrize("c", MAKE, ids=_ids(MAKE))
def test_each_make_target_exists(c):
    targets = make_parts(c)[0]
    assert targets and set(targets) <= makefile()[0], c


@pytest.mark.parametrize("c", MAKE, ids=_ids(MAKE))
def test_each_make_variable_is_one_the_makefile_knows(c):
    variables = makefile()[1]
    unknown = [v for v in [*make_parts(c)[1], *c.env] if v not in variables and v not in DOC_ENV]
    assert unknown == [], c


@pytest.mark.parametrize("c", MAKE, ids=_ids(MAKE))
def test_each_make_preset_exists(c):
    assigns = make_parts(c)[1]
    for var, kind in (("MODEL", MODEL_PRESETS), ("PRESET", CLUSTER_PRESETS)):
        assert var not in assigns or _preset_ok(assigns[var], kind, c.placeholder), c


JOBS = [c for c in COMMANDS if c.module or (c.words[0] == "make" and make_as_module(c))]


def job(c: Command) -> tuple[str, list[str]]:
    """(module, its arguments) of a command of ``JOBS``: ``python -m`` or a make target."""
    run = c.module or make_as_module(c)
    assert run is not None, f"{c!r} runs no entry point"
    return run


@pytest.mark.parametrize("c", JOBS, ids=_ids(JOBS))
def test_each_entry_point_exists_and_prints_its_help(c):
    module = job(c)[0]
    info = parsers()[module]
    assert "failed" not in info and info["help"], info.get("failed", module)


@pytest.mark.parametrize("c", JOBS, ids=_ids(JOBS))
def test_each_flag_is_one_the_entry_point_takes(c):
    module, args = job(c)
    info = parsers()[module]
    options = set(info["options"])
    if info["subcommands"]:
        sub = next(a for a in args if not a.startswith("-"))
        assert sub in info["subcommands"], f"{c!r}: no subcommand {sub}"
        options |= set(info["subcommands"][sub])
    assert set(_flags(args)) <= options, f"{c!r}: {set(_flags(args)) - options}"


PARSED = [c for c in JOBS if not c.placeholder]


@pytest.mark.parametrize("c", PARSED, ids=_ids(PARSED))
def test_each_command_parses_with_the_entry_points_own_parser(c):
    module, args = job(c)
    assert parsers()[module]["errors"][json.dumps(args)] == "", c


@pytest.mark.parametrize("c", JOBS, ids=_ids(JOBS))
def test_each_preset_a_flag_names_exists(c):
    module, args = job(c)
    for flag, kind in PRESET_FLAGS.get(module, []):
        for i, a in enumerate(args[:-1]):
            if a == flag:
                assert _preset_ok(args[i + 1], kind, c.placeholder), f"{c!r}: {flag} {args[i + 1]}"


MODEL_FLAG = {"moe_train": "--preset"}  # the others name the model preset --model


def _model_and_sets(args: list[str], module: str) -> tuple[str | None, list[str]]:
    flag = MODEL_FLAG.get(module, "--model")
    pairs = list(zip(args, args[1:]))
    model = next((v for f, v in pairs if f == flag), None)
    return model, [v for f, v in pairs if f == "--set"]


CONFIGURED = [c for c in PARSED if _model_and_sets(job(c)[1], job(c)[0])[0]]


@pytest.mark.parametrize("c", CONFIGURED, ids=_ids(CONFIGURED))
def test_each_set_item_is_a_valid_key_and_value_of_the_model(c):
    from moe_train import config

    module, args = job(c)
    model, sets = _model_and_sets(args, module)
    assert model is not None  # CONFIGURED: the command names a model
    config.build(model, sets)  # ConfigError names the key


def test_make_help_lists_every_target_the_docs_use():
    out = subprocess.run(
        ["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    listed = set(re.findall(r"^\s+make (\S+)", out.stdout, re.M))
    used = {t for c in MAKE for t in make_parts(c)[0]}
    assert out.returncode == 0 and used <= listed, used - listed


README_PLANS = [c for c in MAKE if c.where.startswith("README.md") and make_parts(c)[0] == ["plan"]]


@pytest.mark.parametrize("c", README_PLANS, ids=_ids(README_PLANS))
def test_each_readme_plan_runs_and_gives_its_verdict_first(c):
    """make plan, as its recipe runs it (python -m moe_train.planner): exit 0, the memory line first
    (exit 2 where the comment says so)."""
    module, args = job(c)
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    expected = 2 if "exit 2" in c.comment else 0
    assert proc.returncode == expected, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0].startswith("memory: "), proc.stdout[:500]


# ---- links between the pages -----------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return s.replace(" ", "-")


def _links() -> list[tuple[Path, str]]:
    out = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:", target):
                out.append((doc, target))
    return out


LINKS = _links()


@pytest.mark.parametrize("doc, target", LINKS, ids=[f"{d.relative_to(ROOT)}->{t}" for d, t in LINKS])
def test_each_relative_link_reaches_a_file_and_heading(doc, target):
    path, _, anchor = target.partition("#")
    dest = (doc.parent / path).resolve() if path else doc
    assert dest.exists(), f"{doc.relative_to(ROOT)}: {target}"
    if anchor and dest.suffix == ".md":
        headings = re.findall(r"^#+ (.*)$", dest.read_text(), re.M)
        assert anchor in {_slug(h) for h in headings}, f"{doc.relative_to(ROOT)}: {target}"


# ---- figures quoted in the docs --------------------------------------------------------------

FIGURE_MARK = re.compile(r"^<!-- figures: (?P<figures>[^|]+?) \| (?P<command>.+?) -->$")
FIGURE = r"(?<![\d.,]){}(?![\d])"  # a figure as a whole number, not part of a longer one


class Marked:
    """A ``<!-- figures: ... | COMMAND -->`` line: its figures, its command, the block it marks."""

    def __init__(self, doc: Path, n: int, lines: list[str]):
        match = FIGURE_MARK.match(lines[n])
        assert match is not None
        self.figures = match.group("figures").split()
        self.where = f"{doc.relative_to(ROOT)}:{n + 1}"
        self.command = Command(match.group("command"), "", self.where)
        after = n + 1
        while after < len(lines) and FIGURE_MARK.match(lines[after]):
            after += 1
        end = next((i for i in range(after, len(lines)) if not lines[i].strip()), len(lines))
        self.block = "\n".join(lines[after:end])

    def __repr__(self) -> str:
        return f"{self.where}: {' '.join(self.figures)}"


def _marked() -> list[Marked]:
    out = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        out += [Marked(doc, n, lines) for n, line in enumerate(lines) if line.startswith("<!-- figures:")]
    return out


MARKED = _marked()
PLAN_FIGURES = [
    (c, re.findall(r"\d[\d,]*\.\d+", c.comment))
    for c in MAKE
    if make_parts(c)[0] == ["plan"] and not c.placeholder and re.search(r"\d\.\d", c.comment)
]


@lru_cache
def printed(module: str, args: tuple[str, ...]) -> str:
    """stdout and stderr of ``python -m module args`` (exit 0, or 2: a plan that does not fit)."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode in (0, 2), proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def missing_from(figures: list[str], text: str) -> list[str]:
    return [f for f in figures if not re.search(FIGURE.format(re.escape(f)), text)]


def test_the_docs_mark_their_planner_figures():
    assert len(MARKED) >= 20 and len(PLAN_FIGURES) >= 2


@pytest.mark.parametrize("m", MARKED, ids=repr)
def test_each_marked_figure_is_quoted_where_it_is_marked(m):
    assert missing_from(m.figures, m.block) == [], m.block[:300]


@pytest.mark.parametrize("m", MARKED, ids=repr)
def test_each_marked_figure_is_what_its_command_prints_now(m):
    module, args = job(m.command)
    assert missing_from(m.figures, printed(module, tuple(args))) == [], m.command


@pytest.mark.parametrize("c, figures", PLAN_FIGURES, ids=[repr(c) for c, _ in PLAN_FIGURES])
def test_each_figure_of_a_plan_comment_is_what_make_plan_prints_now(c, figures):
    module, args = job(c)
    assert missing_from(figures, printed(module, tuple(args))) == [], c


def test_a_figure_is_matched_whole():
    assert missing_from(["57.6", "3,753", "16.5%"], "57.65 of 72; 3,753 t/s; 16.5% exposed") == ["57.6"]
