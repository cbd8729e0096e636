"""Startup self-test: the trainer checks each kernel it is about to use before training.

Before the first step the trainer runs every candidate for the grouped GEMM backend
(``moe.backend``), the attention implementation (``model.attention``) and, under
``precision.compute=fp8``, the fp8 backend (``precision.fp8_backend``) once on a small problem
with the run's shapes (reduced) on this process's first device, forward and backward, against
an fp32 reference on the same device (``moe_train.selftest.checks``).

- ``auto`` takes the fastest candidate that passes. Candidates are listed fastest first as
  measured on each platform (``make bench`` / ``make bench-accel``); on a GPU the grouped-GEMM
  candidates that pass are also timed on the problem and one is preferred to an earlier-listed
  one only when it is more than ``SPEED_MARGIN`` faster. A resumed run keeps the kernel its run
  directory recorded (``kernels.json``) while that one still passes, so a resume computes what
  the interrupted run computed. A candidate that fails is logged with its numbers or error and
  the next one is used.
- An explicit choice that fails stops the run with exit 2 and the numbers, unless
  ``train.skip_selftest=true`` (then nothing is checked and ``auto`` takes the first candidate
  that can run here).
- In a multi-process job every process checks its own device and a candidate counts as passed
  only where it passed on every process, so all processes pick the same kernels.

``run`` returns the config the step is built from (every ``auto`` replaced by the chosen
kernel), the log line that names every kernel and why, and the JSON record kept in
``<out>/kernels.json``.

May import: ``moe_train.config``, ``moe_train.model`` and ``moe_train.moe`` (the routings it
tests with come from ``moe_train.moe.routings``). Never the benchmarks: the trainer runs it
before its first step.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from moe_train.base.platform import Platform
from moe_train.config import Config, ConfigError, attention_dims
from moe_train.selftest import candidates as C
from moe_train.selftest.checks import Result

SPEED_MARGIN = 0.10  # a later candidate must be this much faster to replace an earlier one
TIME_REPS = 5  # timed calls per grouped-GEMM candidate on a GPU
KERNELS_FILE = "kernels.json"


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """A kernel's config key and the value configured for it."""

    key: str  # moe.backend | model.attention | precision.fp8_backend
    requested: str  # the configured value ("auto" or a kernel's name)


@dataclasses.dataclass(frozen=True)
class Choice(KernelKey):
    """The kernel chosen for one config key."""

    chosen: str  # the concrete kernel the run uses
    why: str  # in words, for the first log line
    results: tuple[Result, ...]  # the checks that ran (empty when skipped)

    def record(self) -> dict:
        return {
            "key": self.key,
            "requested": self.requested,
            "chosen": self.chosen,
            "why": self.why,
            "checks": [dataclasses.asdict(r) for r in self.results],
        }


def _agree(results: list[Result]) -> list[Result]:
    """Across processes: passed only where it passed everywhere; the slowest time."""
    if jax.process_count() == 1 or not results:
        return results
    from jax.experimental import multihost_utils

    local = np.array([[float(r.ok), r.time_s if r.time_s is not None else -1.0] for r in results])
    every = np.asarray(multihost_utils.process_allgather(local))  # [P, n, 2]
    out = []
    for i, r in enumerate(results):
        ok = bool(every[:, i, 0].min() > 0)
        t = float(every[:, i, 1].max()) if r.time_s is not None else None
        note = r.error or ("" if ok == r.ok else "failed on another process")
        out.append(dataclasses.replace(r, ok=ok, time_s=t, error=note))
    return out


def _pick(passed: list[Result], by_speed: bool, recorded: str | None) -> tuple[Result, str]:
    """The winner among passing candidates (listed fastest first) and why."""
    names = [r.name for r in passed]
    if recorded in names:
        return passed[names.index(recorded)], "kept from the run being resumed"
    best = passed[0]
    if by_speed:
        for r in passed[1:]:
            if (
                r.time_s is not None
                and best.time_s is not None
                and r.time_s < best.time_s * (1 - SPEED_MARGIN)
            ):
                best = r
        if len(passed) > 1:
            return best, "fastest that passed"
    return best, "first that passed"


def choose(
    key: str,
    requested: str,
    cands: list[str],
    check: Callable[[str, int], Result],
    *,
    skip: bool,
    by_speed: bool = False,
    recorded: str | None = None,
    lead: str = "",
) -> Choice:
    """Check ``cands`` (for ``auto``) or ``requested`` and return the choice.

    ``check(name, time_reps)`` runs one candidate; ``lead`` says why the first candidate
    leads (for the log). Raises ConfigError when an explicit choice fails, or when no
    candidate of ``auto`` passes."""
    if requested != "auto":
        if skip:
            return Choice(key, requested, requested, "explicit; self-test skipped", ())
        (res,) = _agree([check(requested, 0)])
        if not res.ok:
            raise ConfigError(
                f"{key}={requested} failed its self-test on {_device()}: "
                f"{res.line()}; use {key}=auto (it tries {', '.join(cands)}) "
                f"or set train.skip_selftest=true to use it unchecked"
            )
        return Choice(key, requested, requested, f"explicit; self-test {res.line()}", (res,))
    if not cands:
        raise ConfigError(f"{key}=auto: no candidate can run on {_device()}")
    if skip:
        return Choice(key, requested, cands[0], f"auto: first of {', '.join(cands)}; self-test skipped", ())
    reps = TIME_REPS if by_speed else 0
    results: list[Result] = []
    for name in cands:
        results += _agree([check(name, reps)])
        if results[-1].ok and not by_speed and (recorded in (None, name) or recorded not in cands):
            break
    passed = [r for r in results if r.ok]
    if not passed:
        raise ConfigError(
            f"{key}=auto: every candidate failed its self-test on {_device()}: "
            + "; ".join(r.line() for r in results)
        )
    best, how = _pick(passed, by_speed, recorded)
    notes = [r.line() for r in results if not r.ok]
    lead = lead.removeprefix("auto: ")
    why = f"auto: {lead + '; ' if lead else ''}{how}: {best.line()}" + (
        f"; skipped {'; '.join(notes)}" if notes else ""
    )
    return Choice(key, requested, best.name, why, tuple(results))


def _device() -> str:
    return str(jax.local_devices()[0].device_kind)


def _recorded(out_dir: Path | None, cfg: Config) -> dict[str, str]:
    """Kernels a previous run in ``out_dir`` chose for the same configured values."""
    path = out_dir / KERNELS_FILE if out_dir else None
    if path is None or not path.is_file():
        return {}
    try:
        kept = json.loads(path.read_text())["choices"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    now: dict[Any, Any] = C.configured(cfg)  # looked up with whatever key the file holds
    return {
        c["key"]: c["chosen"]
        for c in kept
        if isinstance(c, dict) and now.get(c.get("key")) == c.get("requested")
    }


def run(cfg: Config, out_dir: Path | None = None) -> tuple[Config, str, dict]:
    """Check and choose every kernel of ``cfg`` on this machine.

    Returns (the config with concrete kernels, one log line, the JSON record)."""
    t0 = time.perf_counter()
    platform = Platform.here()
    skip = cfg.train.skip_selftest
    recorded = _recorded(out_dir, cfg)
    with jax.default_device(jax.local_devices()[0]):
        choices = [
            choose(
                key, value, cands, check, skip=skip, by_speed=by_speed, recorded=recorded.get(key), lead=lead
            )
            for key, value, cands, check, by_speed, lead in C.plans(cfg, platform)
        ]
    seconds = time.perf_counter() - t0
    exec_cfg = C.apply(cfg, {c.key: c.chosen for c in choices})
    what = "; ".join(f"{c.key}={c.chosen} ({c.why})" for c in choices)
    line = (
        f"kernels on {_device()}: {what} [self-test {seconds:.2f} s]"
        if not skip
        else f"kernels on {_device()}: {what} [train.skip_selftest=true]"
    )
    record = {
        "device": _device(),
        "platform": platform.name,
        "skip_selftest": skip,
        "selftest_s": seconds,
        "head_dim": attention_dims(cfg.model)[0],
        "choices": [c.record() for c in choices],
    }
    return exec_cfg, line, record


def write(out_dir: Path, record: dict) -> None:
    """Keep the record in ``<out>/kernels.json`` (process 0 only)."""
    if jax.process_index() == 0:
        (Path(out_dir) / KERNELS_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n")
