"""The run directory before anything slow: ``--fresh`` and the incompatible-checkpoint check.

``start_fresh(out_dir)`` (``python -m moe_train --fresh``, what ``make smoke`` runs) empties a
run directory this kit wrote, so the run starts at step 0: only a directory whose entries
are all files the trainer (or ``moe_train.report``) writes and that holds ``run.lock`` (every
trainer start writes it first) is emptied, under its lock, so a trainer running there is
never touched. Anything else (a directory with other files, a file) is refused with one
line, exit 2: the kit deletes nothing it did not create. A missing or empty directory is
left as it is.

``refuse_incompatible(cfg, out_dir, resume_step)`` reads the config saved with the
checkpoint the run would resume from (its ``meta`` item, plain JSON, no Orbax) and raises
the same ``ConfigError`` as the resume itself (``checkpoint.check_compatible``), before the
kernel self-test and before anything compiles. A checkpoint whose meta does not read is left
to ``moe_train.train.resume``, which skips damaged ones. ``remove_if_new`` takes back the
directories a start created (``first_missing``: ``--out`` and any missing parent) when it
ended before writing anything in them (exit 2, a stop during start-up).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moe_train.config import Config, ConfigError
from moe_train.train import runlock

# Every top-level entry a run directory of this kit may hold
RUN_FILES = frozenset(
    {
        runlock.LOCK_NAME,
        "config.json",
        "kernels.json",
        "layout.json",
        "metrics.jsonl",
        "summary.json",
        "checkpoints",
        "checkpoints-rejected",
        "telemetry",
        "tensorboard",
        "wandb",
        "logs",
        "report.html",
        "report",
    }
)


def not_a_run(out_dir: Path) -> str | None:
    """Why ``out_dir`` is not a run directory of this kit that ``--fresh`` may empty (None:
    it is one, or it is missing or empty)."""
    if not out_dir.exists():
        return None
    if not out_dir.is_dir():
        return f"{out_dir} is not a directory"
    names = {p.name for p in out_dir.iterdir()}
    if not names:
        return None
    other = sorted(names - RUN_FILES)
    if other:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        return f"{out_dir} holds files a training run does not write ({shown})"
    if runlock.LOCK_NAME not in names:
        return f"{out_dir} has no {runlock.LOCK_NAME}: not a run directory of this kit"
    return None


def start_fresh(out_dir: Path) -> bool:
    """Empty ``out_dir`` when it is a run directory of this kit (True when something was
    removed); ConfigError (exit 2) when it is anything else or a trainer holds it."""
    out_dir = Path(out_dir)
    why = not_a_run(out_dir)
    if why is not None:
        raise ConfigError(
            f"--fresh: {why}; nothing was removed. Choose another --out (make "
            f"smoke OUT=new/dir), or remove it yourself if it is yours to delete"
        )
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return False
    lock = runlock.acquire(out_dir)  # RunDirLocked (exit 2) while a trainer runs there
    try:
        for entry in out_dir.iterdir():
            if entry.name == runlock.LOCK_NAME:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    finally:
        lock.release()
    return True


def first_missing(out_dir: Path) -> Path | None:
    """The highest directory of ``out_dir``'s path (absolute) that does not exist, which
    locking ``out_dir`` creates; None when ``out_dir`` exists."""
    path, top = Path(out_dir).absolute(), None
    while not path.exists() and path.parent != path:
        path, top = path.parent, path
    return top


def remove_if_new(created: Path | None) -> None:
    """At the end of a start: ``created`` (``first_missing`` before the start) goes again when
    it holds nothing but the run lock (exit 2, a stop during start-up, any error before the
    first step wrote the run's files). Process 0 only: the others create nothing."""
    import jax

    if created is None or jax.process_index() != 0 or not created.is_dir():
        return
    leftovers = [p for p in created.rglob("*") if p.is_file() and p.name != runlock.LOCK_NAME]
    if not leftovers:
        shutil.rmtree(created, ignore_errors=True)


def _resumable_steps(ckpt_dir: Path) -> list[int]:
    """The finished checkpoints' steps, newest first (Orbax's temporary ones left out)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted((int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and p.is_dir()), reverse=True)


def _saved_config(step_dir: Path) -> dict | None:
    try:
        return json.loads((step_dir / "meta" / "metadata").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def refuse_incompatible(cfg: Config, out_dir: Path, resume_step: int | None = None) -> None:
    """ConfigError when the checkpoint this start would resume from has another structure."""
    from moe_train.checkpoints.checkpoint import check_compatible  # orbax: the CLI starts without it

    ckpt_dir = Path(out_dir).absolute() / "checkpoints"
    steps = _resumable_steps(ckpt_dir)
    if resume_step is not None:
        steps = [s for s in steps if s == resume_step]
    for step in steps:
        saved = _saved_config(ckpt_dir / str(step))
        if saved is not None:  # the newest readable one is the one resume.choose checks
            check_compatible(saved, cfg, ckpt_dir)
            return
