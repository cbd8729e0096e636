"""Which checkpoint a run resumes from: the newest one that reads and verifies.

``choose`` tries the run's checkpoints newest first (``checkpoint.try_step``: the meta item
reads, the config is compatible, the step has a manifest, the state reads and matches it).
Checkpoints newer than the one it resumes from could not be used: each is reported in one
line and moved to ``<out>/checkpoints-rejected/<step>-<UTC>/`` with a ``REASON`` file, never
deleted, so it cannot be resumed from or be counted by pruning again. A checkpoint without a
manifest is one of them: its arrays cannot be verified. If checkpoints exist and none can be
used, nothing is moved and the run exits 2 with the list: starting from scratch over them
would be silent data loss.

``--resume-step N`` resumes from step N only; checkpoints newer than N are moved aside as
"newer than --resume-step" (the run continues from N and will write those steps again). It
is the one way to resume from a checkpoint without a manifest (the caller names the one it
trusts; a warning says it is unverified); one with a manifest is verified as always.

The result (``Resumed``) names the checkpoint's directory, as found, and the checkpoints
rejected on the way, for the log and the divergence message (``moe_train.train.guard``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_train.checkpoints.checkpoint import Checkpointer, try_step
from moe_train.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A checkpoint this start could not use: its step, why, and where it was moved."""

    step: int
    reason: str
    moved_to: Path


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The restored state, the checkpoint directory it came from, and what was rejected."""

    state: Any
    directory: Path
    rejected: tuple[Rejected, ...] = ()
    unverified: bool = False


def _unusable(ckpt: Checkpointer, failures: list[tuple[int, str]]) -> ConfigError:
    listed = "; ".join(f"step {s}: {why}" for s, why in failures)
    return ConfigError(
        f"no checkpoint in {ckpt.directory} can be restored ({listed}); move "
        f"them away (or use another --out) to start from scratch, or "
        f"--resume-step N for one you trust"
    )


def _explicit(
    ckpt: Checkpointer, step: int, template: Any, cfg: Config, log: Callable[[str], None]
) -> Resumed:
    steps = ckpt.all_steps()
    if step not in steps:
        raise ConfigError(
            f"--resume-step {step}: no such checkpoint in {ckpt.directory}; "
            f"saved steps: {', '.join(map(str, steps)) or 'none'}"
        )
    state, why = try_step(ckpt, step, template, cfg, log, trust_unverified=True)
    if state is None:
        assert why is not None, "try_step says why"
        raise _unusable(ckpt, [(step, why)])
    unverified = ckpt.read_manifest(step, trust_unverified=True) is None
    if unverified:
        log(f"WARNING: checkpoint {step} has no manifest: resumed unverified, as --resume-step {step} asks")
    for newer in [s for s in steps if s > step]:
        where = ckpt.move_aside(newer, f"newer than --resume-step {step}")
        log(f"checkpoint {newer} is newer than --resume-step {step}: moved to {where}")
    return Resumed(state, ckpt.directory / str(step), unverified=unverified)


def choose(
    ckpt: Checkpointer, template: Any, cfg: Config, resume_step: int | None, log: Callable[[str], None]
) -> Resumed | None:
    """What to continue from, or None when the run has no checkpoint."""
    if resume_step is not None:
        return _explicit(ckpt, resume_step, template, cfg, log)
    failures: list[tuple[int, str]] = []
    for step in reversed(ckpt.all_steps()):
        state, why = try_step(ckpt, step, template, cfg, log)
        if state is None:
            assert why is not None, "try_step says why"
            failures.append((step, why))
            continue
        rejected = []
        for bad, reason in failures:
            where = ckpt.move_aside(bad, reason)
            rejected.append(Rejected(bad, reason, where))
            log(
                f"WARNING: checkpoint {bad} cannot be used ({reason}); moved to {where}; "
                f"resuming from step {step}"
            )
        return Resumed(state, ckpt.directory / str(step), tuple(rejected))
    if failures:
        raise _unusable(ckpt, failures)
    return None
