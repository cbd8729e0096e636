"""What the test modules share: tiny configs, a run's metrics, the kit's command lines run as a
user runs them, and small real corpora. Plain functions; the fixtures built on them (a trained
tokenizer, the cluster presets, the local Slurm cluster) are in conftest.py.

Test modules import them by name (``from helpers import tiny, records``): pytest puts this
folder on ``sys.path`` as it imports the test modules.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypedDict

import numpy as np
import pytest

from moe_train import config
from moe_train.data import DataError, prepare, prepared

if TYPE_CHECKING:
    import flax.linen as nn

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "moe_train/assets/corpus.txt"


class Quiet(TypedDict):
    log: Callable[[str], None]


QUIET: Quiet = {"log": lambda s: None}  # run(cfg, out, **QUIET): no progress lines

# --------------------------------------------------------------------------- configs

# checkpoints at every second step, written before the step returns; no telemetry thread
SAVING = ("train.checkpoint_every=2", "train.async_checkpoint=false", "train.telemetry_interval_s=0")


def tiny(*overrides: str, steps: int = 2) -> config.Config:
    """The tiny preset for ``steps`` steps on one device, a progress line only every 100 steps."""
    return config.build(
        "tiny", [f"train.steps={steps}", "parallel.devices=1", "train.log_every=100", *overrides]
    )


def tiny_saving(*overrides: str, steps: int = 4) -> config.Config:
    """``tiny`` that saves a checkpoint every 2 steps (``SAVING``): runs to resume and damage."""
    return tiny(*SAVING, *overrides, steps=steps)


# the docs' Mixtral job: 8 h100-dgx nodes, EP 8 (the flags of slurm.submit, moe_train.planner.show, compile)
MIXTRAL_H100 = ("--preset", "h100-dgx", "--model", "mixtral-8x7b", "--nodes", "8", "--ep", "8")


# --------------------------------------------------------------------------- typed access


def search(pattern: str, text: str, flags: int = 0) -> re.Match[str]:
    """``re.search`` that fails the test, naming the pattern, where nothing matches."""
    match = re.search(pattern, text, flags)
    assert match is not None, f"no match for {pattern!r}"
    return match


def pipe(stream: IO[str] | None) -> IO[str]:
    """A child's ``stdout`` or ``stderr``, started with ``subprocess.PIPE`` (so not None)."""
    assert stream is not None, "the child was started without a pipe"
    return stream


def call(module: nn.Module, variables, *args, **kwargs) -> Any:
    """``module.apply(variables, *args, **kwargs)`` without ``mutable``: what the module's
    ``__call__`` returns (flax types ``apply`` as that or the ``(out, state)`` pair of a
    ``mutable=...`` call, and the checker sees both)."""
    return module.apply(variables, *args, **kwargs)


# --------------------------------------------------------------------------- a run's files


def records(out: Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl``, one a step, in order."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    """Each step's loss from a run's ``metrics.jsonl``."""
    return [r["loss"] for r in records(out)]


# --------------------------------------------------------------------------- token files


def token_ids(seed: int = 0, shape: tuple[int, ...] = (2, 17)) -> np.ndarray:
    """Random ids of the tiny preset's 256-token vocabulary: a [B, S] int32 batch."""
    return np.random.default_rng(seed).integers(0, 256, shape).astype(np.int32)


def write_tokens(path: Path, ids: np.ndarray) -> Path:
    """``ids`` as a ``--tokens`` file (``.npy``) at ``path``; ``path``."""
    np.save(path, ids)
    return path


# --------------------------------------------------------------------------- command lines


def toml_key(text: str, key: str, value: str | None) -> str:
    """``text`` (a TOML file) with the first line assigning ``key`` set to ``value`` (None:
    removed), whatever the number's spelling there (``0.8`` or ``0.80``)."""
    line = re.compile(rf"(?m)^{re.escape(key)} = .*\n")
    assert line.search(text), f"no line assigns {key}"
    return line.sub("" if value is None else f"{key} = {value}\n", text, count=1)


def sets(*assignments: str) -> list[str]:
    """``--set`` before each ``section.key=value``."""
    return [word for a in assignments for word in ("--set", a)]


def unbuffered(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with unbuffered Python output, ``env`` on top."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def run_module(
    module: str, *args, timeout: float | None = None, env: dict[str, str] | None = None, **kw
) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root, as a user runs it: its exit code,
    stdout and stderr (text). ``env`` adds to this process's environment."""
    kw.setdefault("cwd", ROOT)
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=unbuffered(env),
        **kw,
    )


def start_module(module: str, *args, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """``python -m module args`` started from the repository root, its output piped (text)."""
    kw.setdefault("cwd", ROOT)
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        [sys.executable, "-m", module, *map(str, args)], env=unbuffered(env), text=True, **kw
    )


def train_cli(out: Path, *args, timeout: float | None = 300, **kw) -> subprocess.CompletedProcess:
    """``python -m moe_train --preset tiny --out OUT args``, run to its end."""
    return run_module("moe_train", "--preset", "tiny", "--out", out, *args, timeout=timeout, **kw)


def start_train_cli(out: Path, *args, **kw) -> subprocess.Popen:
    """``python -m moe_train --preset tiny --out OUT args``, started."""
    return start_module("moe_train", "--preset", "tiny", "--out", out, *args, **kw)


def score_cli(weights: Path, tokens: Path, *args) -> subprocess.CompletedProcess:
    """``python -m moe_train.score WEIGHTS --tokens TOKENS args``, run to its end."""
    return run_module("moe_train.score", weights, "--tokens", tokens, *args)


def data_cli(*args) -> subprocess.CompletedProcess:
    """``python -m moe_train.data args``, run to its end."""
    return run_module("moe_train.data", *args, timeout=120)


def one_error_line(stderr: str) -> str:
    """The one line a refusal prints (``error: ...``); fails on any other output."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def refused(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one error line of a command that exited with ``code``."""
    assert proc.returncode == code, proc.stderr
    return one_error_line(proc.stderr)


# --------------------------------------------------------------------------- damaging files


def make_read_only(path: Path) -> bool:
    """Make ``path`` unwritable even for root (chattr +i); False where that is impossible."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return True
    return (
        shutil.which("chattr") is not None
        and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    )


def make_writable(path: Path) -> None:
    """Undo ``make_read_only``."""
    subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    path.chmod(0o755)


def flip_byte(path: Path, at: int = 10, keep_mtime: bool = False) -> None:
    """Change one byte of ``path`` in place (same size). Its mtime moves 1 s later, as a later
    write's would whatever the file system's clock granularity, or stays (``keep_mtime``)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    later = 0 if keep_mtime else 1_000_000_000
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + later))


# --------------------------------------------------------------------------- corpora


def paragraphs(n: int) -> list[str]:
    """The first ``n`` blank-line separated documents of the shipped corpus."""
    text = CORPUS.read_text(encoding="utf-8")
    return [p.strip("\n") for p in re.split(r"\n(?:[ \t]*\n)+", text) if p.strip()][:n]


DOCS = paragraphs(60)


def write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def train_bpe(path: Path, specials: list[str], vocab: int = 500) -> Path:
    """A byte-level BPE (lossless) trained on the shipped corpus, saved as ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(CORPUS)], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def prepare_run(tok: Path | str, inputs, out: Path, log=None, **kw) -> prepare.Summary:
    """``moe_train.data.prepare`` of ``inputs`` into ``out``: one worker, no validation split
    unless ``kw`` says otherwise; its lines to ``log`` (default: none). Its summary."""
    kw.setdefault("workers", 1)
    kw.setdefault("val_fraction", 0.0)
    opts = prepare.Options(tokenizer=str(tok), inputs=tuple(str(i) for i in inputs), out=out, **kw)
    return prepare.run(opts, log=log or (lambda line: None), stream=io.StringIO())


def prepare_error(tok: Path, inputs, out: Path, **kw) -> str:
    """The one-line ``DataError`` that ``prepare_run`` stops with."""
    with pytest.raises(DataError) as info:
        prepare_run(tok, inputs, out, **kw)
    message = str(info.value)
    assert "\n" not in message
    return message


def decode(tok_path: Path, ids) -> str:
    """``ids`` as text, by a ``tokenizer.json`` or a SentencePiece ``.model``."""
    if tok_path.suffix == ".model":
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(tok_path)).decode(list(ids))
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_path)).decode(list(ids), skip_special_tokens=False)


def decoded_docs(tok: Path, out: Path, name: str = "train") -> list[str]:
    """The documents of a prepared split, decoded, without their EOS."""
    s = prepared.open_split(out, name)
    return [decode(tok, s.document(d)[:-1]) for d in range(len(s))]


def files_of(out: Path) -> dict[str, bytes]:
    """Every file below ``out``, by its path relative to ``out``: its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def shard_bytes(out: Path) -> dict[str, bytes]:
    """``files_of`` the shards of a prepared corpus."""
    return {k: v for k, v in files_of(out).items() if k.startswith(("train/", "val/"))}
