"""Reading a run directory that may still be written, or was left by a crash.

``load_run(run_dir)`` reads ``metrics.jsonl``, ``telemetry/rank<N>.jsonl``, ``config.json``
and ``layout.json``. Lines that are not whole JSON objects (a line cut by a crash or still
being written, a blank line) and metrics records whose step or a field the readers compute
with has the wrong type (``METRIC_FIELDS``) are skipped and counted per file; missing or
unreadable files are listed in ``problems``. Nothing here raises for bad content.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")
# What a run directory holds (any one of them): a directory with none is not a run's --out.
RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "telemetry",
    "summary.json",
    "layout.json",
    "kernels.json",
    "checkpoints",
)


def _number(value: Any) -> bool:
    """A JSON number (NaN and inf included: a diverged step records them; an integer within
    int64, as NumPy takes it) or null."""
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2**63) <= value < 2**63
    return value is None or isinstance(value, float)


def _loads(value: Any) -> bool:
    """``tokens_per_expert``: null, or equally long lists of numbers, one per MoE layer."""
    return value is None or (
        isinstance(value, list)
        and all(
            isinstance(row, list)
            and len(row) == len(value[0])
            and all(_number(x) and x is not None for x in row)
            for row in value
        )
    )


# metrics.jsonl fields the summary and the report compute with, and the check each value must
# pass; a record failing one (a foreign or hand-edited line) is skipped and counted as a cut
# line is, so no reader meets a string where it adds numbers.
METRIC_FIELDS: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(
        (
            "loss",
            "total_loss",
            "mtp_loss",
            "aux_loss",
            "seq_aux_loss",
            "z_loss",
            "grad_norm",
            "lr",
            "step_time_s",
            "tokens_per_s",
            "tflops_per_device",
            "mfu",
            "max_over_mean_load",
            "eval_loss",
            "eval_ppl",
            "eval_tokens",
            "eval_s",
            "dropped_tokens",
            "compilations",
            "selftest_s",
        ),
        _number,
    ),
    "tokens_per_expert": _loads,
    "compiled": lambda v: v is None or isinstance(v, bool),
}
# The same for telemetry lines: their time, the step marks of a sample and the process count
# of a start line (the summary lists the ranks below it that wrote nothing).
MAX_PROCESSES = 1 << 20
TELEMETRY_FIELDS: dict[str, Callable[[Any], bool]] = {
    "time": _number,
    "steps": lambda v: v is None or isinstance(v, list),
    "process_count": lambda v: (
        v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_PROCESSES)
    ),
}


# config.json values the summary and the report compute with, and their types; a config.json
# where one has another type (or a section is not a table) is listed in ``problems`` and not used.
CONFIG_FIELDS: dict[str, type] = {
    "train.steps": int,
    "train.batch_size": int,
    "train.seq_len": int,
    "parallel.cluster": str,
    "precision.compute": str,
}


def _valid(record: dict[str, Any], fields: dict[str, Callable[[Any], bool]]) -> bool:
    return all(ok(record[key]) for key, ok in fields.items() if key in record)


@dataclass(frozen=True)
class RunData:
    """Everything a summary or report reads from one run directory."""

    run_dir: Path  # the directory read
    metrics: list[dict[str, Any]]  # metrics.jsonl records by step (a later line of a step wins)
    telemetry: dict[int, list[dict[str, Any]]]  # rank -> telemetry lines in file order
    config: dict[str, Any] | None  # config.json, None when missing or unreadable
    layout: dict[str, Any] | None  # layout.json (mesh, EP groups, domains), None when missing
    skipped: dict[str, int]  # file (relative to run_dir) -> lines skipped as not JSON objects
    problems: tuple[str, ...]  # one line per missing or unreadable file


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(JSON objects of the file's lines, number of lines that were not one); OSError if unreadable."""
    records, skipped = [], 0
    with path.open("rb") as f:
        data = f.read()
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError:  # a cut line, bad UTF-8, garbage
            skipped += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            skipped += 1
    return records, skipped


def read_json(path: Path, problems: list[str]) -> dict[str, Any] | None:
    """A JSON object file, or None with a line in ``problems``."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        problems.append(f"{path.name}: missing")
        return None
    except (OSError, ValueError) as err:
        problems.append(f"{path.name}: unreadable ({type(err).__name__}: {err})")
        return None
    if not isinstance(value, dict):
        problems.append(f"{path.name}: not a JSON object")
        return None
    return value


def _metrics(run_dir: Path, skipped: dict[str, int], problems: list[str]) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    try:
        records, bad = read_jsonl(path)
    except FileNotFoundError:
        problems.append("metrics.jsonl: missing (no step finished yet?)")
        return []
    except OSError as err:
        problems.append(f"metrics.jsonl: unreadable ({err})")
        return []
    by_step: dict[int, dict] = {}
    for rec in records:
        step = rec.get("step")
        if isinstance(step, int) and _number(step) and _valid(rec, METRIC_FIELDS):
            by_step[step] = rec
        else:
            bad += 1
    if bad:
        skipped["metrics.jsonl"] = bad
    return [by_step[s] for s in sorted(by_step)]


def _config(run_dir: Path, problems: list[str]) -> dict[str, Any] | None:
    """config.json, or None (with a line in ``problems``) when a ``CONFIG_FIELDS`` value has
    another type."""
    config = read_json(run_dir / "config.json", problems)
    if config is None:
        return None
    for key, kind in CONFIG_FIELDS.items():
        section, field = key.split(".")
        table = config.get(section, {})
        if not isinstance(table, dict):
            problems.append(f"config.json: [{section}] is {table!r}, not a table; not used")
            return None
        value = table.get(field, kind())  # missing: the readers' default
        if not isinstance(value, kind) or isinstance(value, bool):
            problems.append(f"config.json: {key} is {value!r}, not {kind.__name__}; not used")
            return None
    return config


def _telemetry(run_dir: Path, skipped: dict[str, int], problems: list[str]) -> dict[int, list]:
    out: dict[int, list] = {}
    directory = run_dir / "telemetry"
    if not directory.is_dir():
        problems.append("telemetry/: missing (telemetry off, or no process started it)")
        return out
    for path in sorted(directory.iterdir()):
        match = RANK_FILE.match(path.name)
        if not match:
            continue
        try:
            records, bad = read_jsonl(path)
        except OSError as err:
            problems.append(f"telemetry/{path.name}: unreadable ({err})")
            continue
        kept = [r for r in records if isinstance(r.get("kind"), str) and _valid(r, TELEMETRY_FIELDS)]
        bad += len(records) - len(kept)
        out[int(match.group(1))] = kept
        if bad:
            skipped[f"telemetry/{path.name}"] = bad
    return dict(sorted(out.items()))


def load_run(run_dir: Path | str) -> RunData:
    """Read ``run_dir`` as it is now (running, finished or crashed)."""
    run_dir = Path(run_dir)
    skipped: dict[str, int] = {}
    problems: list[str] = []
    metrics = _metrics(run_dir, skipped, problems)
    telemetry = _telemetry(run_dir, skipped, problems)
    config = _config(run_dir, problems)
    layout_problems: list[str] = []
    layout = read_json(run_dir / "layout.json", layout_problems)
    problems += [p for p in layout_problems if not p.endswith("missing")]
    return RunData(
        run_dir=run_dir,
        metrics=metrics,
        telemetry=telemetry,
        config=config,
        layout=layout,
        skipped=skipped,
        problems=tuple(problems),
    )


def samples(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``sample`` lines of one rank's telemetry."""
    return [r for r in records if r.get("kind") == "sample" and isinstance(r.get("time"), (int, float))]


def starts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``start`` lines of one rank's telemetry (one per run or resume)."""
    return [r for r in records if r.get("kind") == "start"]


def run_dir_main(
    prog: str,
    description: str | None,
    argv: list[str] | None,
    work: Callable[[Path], list[str] | None],
    help: str | None = None,
) -> int:
    """``python -m <prog> RUN_DIR``: print ``work(RUN_DIR)``'s lines and exit 0; exit 1 when it
    returns None, 2 (after a line on stderr, before anything is written) when RUN_DIR is not a
    directory or holds none of a run's files (``RUN_FILES``)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("run_dir", type=Path, help=help)
    run_dir = p.parse_args(argv).run_dir
    if not run_dir.is_dir():
        print(f"error: {run_dir} is not a directory", file=sys.stderr)
        return 2
    if not any((run_dir / name).exists() for name in RUN_FILES):
        print(
            f"error: {run_dir} is not a run directory: it holds none of "
            f"{', '.join(RUN_FILES)}; give a training run's --out",
            file=sys.stderr,
        )
        return 2
    lines = work(run_dir)
    if lines is None:
        return 1
    for line in lines:
        print(line)
    return 0
