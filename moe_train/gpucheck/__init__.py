"""GPU acceptance check (``make gpu-check``, ``python -m moe_train.gpucheck``).

One bounded command for a GPU node that says what works there and how fast. It needs only
what the kit itself needs (jax, flax, optax, orbax, numpy); submitit, matplotlib,
transformer-engine, hypothesis and pytest may be absent, and what needs them is skipped with
the reason. Sections run in order, each under its own time budget (``Section.budget_s``: rows
that would start after it are marked SKIP), and the results are written after every section
to ``<out>/<UTC>/results.json`` and ``results.md``, so a run cut short still reports what it
did. Each section and each of its rows is PASS, FAIL or SKIP with a reason and numbers. Each
section says when it starts, ``still running section S: N s`` every ``HEARTBEAT_S`` seconds
while it runs (``heartbeat``; each trainer run it starts gets a line too), and its verdict.

  1 env           GPU, SM count, compute capability, memory, driver, jax/jaxlib/XLA, cuDNN, TE
  2 gemm_numerics every grouped-GEMM backend vs the fp32 per-expert reference, fwd and grads
  3 gemm_speed    each backend against a dense bf16 GEMM chain of the same useful FLOPs
  4 attention     every attention implementation vs the xla reference, time and memory
  5 fp8           fp8 dense projections per fp8 backend: numerics, fp8 GEMMs in the optimized
                  HLO, and a short training run's loss against bf16
  6 training      30 steps of tiny (and a few of small on a GPU) per runnable backend
  7 ep            expert parallelism over the devices present
  8 overlap       the EP layer with moe.overlap_chunks 1/2/4 and fp8 dispatch: equal results,
                  time, and a profiler trace (``<out>/overlap_trace/``)
  9 gpu_tests     the test suite's GPU-marked tests
 10 compute       a compute calibration for ``make plan`` from the measured numbers
                  (``<out>/compute.toml``: the dense GEMM's share of the bf16 peak, the grouped
                  GEMM's from the gemm_speed ratio; ``moe_train.planner.compute``)

On a machine without a GPU the same command runs the sections that can run there at toy
sizes (a few minutes, under budgets ``CPU_BUDGET_SCALE`` times the GPU ones: 2-core machines
differ in speed; the test suite runs it), marks the rest SKIP and exits 0.
The exit code is 1 when any section FAILs.

May import anything of the kit (it runs the benchmarks' kernels, the self-test and the test
suite); nothing of the kit imports it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_train.train.progress import Waiting

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclasses.dataclass(frozen=True)
class Context:
    """What every section knows: where it runs, until when, and where files go."""

    platform: str  # jax.default_backend()
    device_count: int
    out_dir: Path  # this run's directory (runs/gpucheck/<UTC>)
    deadline: float  # time.perf_counter() after which no new row starts
    device_kind: str = ""  # jax.devices()[0].device_kind
    earlier: tuple[dict[str, Any], ...] = ()  # the results of the sections run before this one

    @property
    def on_gpu(self) -> bool:
        return self.platform == "gpu"

    @property
    def child_blocked(self) -> str:
        """Why a trainer run in a child process cannot use this device now ('' when it can):
        a TPU admits one process at a time, and this one holds it."""
        if self.platform != "tpu":
            return ""
        return (
            "a TPU admits one process at a time and this check holds it: run "
            "`python -m moe_train --preset tiny` on its own"
        )

    def left(self) -> float:
        return self.deadline - time.perf_counter()


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    title: str
    budget_s: float  # on a GPU; a CPU run uses toy sizes under CPU_BUDGET_SCALE x this
    run: Callable[[Context], dict[str, Any]]


# A CPU run checks toy sizes on machines of any speed: a 2-core VM took 204 s where the GPU
# budgets allowed 180 s and cut its fp8 and EP trainer runs short (a FAIL on a healthy machine).
CPU_BUDGET_SCALE = 3.0


def budget_scale(platform: str) -> float:
    """What the sections' GPU budgets are multiplied by on ``platform``."""
    return 1.0 if platform == "gpu" else CPU_BUDGET_SCALE


def skip(reason: str, **numbers) -> dict[str, Any]:
    return {"status": SKIP, "reason": reason, **numbers}


def over_budget(**fields) -> dict[str, Any]:
    return {**fields, "status": SKIP, "reason": "over the section's time budget"}


def verdict(rows: list[dict[str, Any]], **numbers) -> dict[str, Any]:
    """A section from its rows: FAIL if any row failed, SKIP if all skipped, else PASS."""
    statuses = [r["status"] for r in rows]
    if FAIL in statuses:
        status, reason = FAIL, "; ".join(r.get("reason", "") for r in rows if r["status"] == FAIL)
    elif statuses and all(s == SKIP for s in statuses):
        status, reason = SKIP, "; ".join(sorted({r.get("reason", "") for r in rows}))
    else:
        status, reason = PASS, ""
    return {"status": status, "reason": reason, "rows": rows, **numbers}


def run_section(sec: Section, ctx_of: Callable[[float], Context]) -> dict[str, Any]:
    """Run one section under its budget; an exception is a FAIL with its traceback tail."""
    t0 = time.perf_counter()
    try:
        out = sec.run(ctx_of(sec.budget_s))
    except Exception as err:  # noqa: BLE001 (report, go on with the next section)
        tail = traceback.format_exc().strip().splitlines()[-6:]
        out = {"status": FAIL, "reason": f"{type(err).__name__}: {err}"[:500], "traceback": tail}
    out["seconds"] = time.perf_counter() - t0
    out["budget_s"] = sec.budget_s
    return {"name": sec.name, "title": sec.title, **out}


HEARTBEAT_S = 10.0  # no silence longer than this while a section runs


def say(line: str) -> None:
    """A progress line of the check on stdout, at once."""
    print(f"[gpu-check] {line.strip()}", flush=True)


def heartbeat(what: str, log: Callable[[str], None] = say):
    """``with heartbeat("running section ep"):`` ``still <what>: N s`` every ``HEARTBEAT_S``
    seconds while the block runs (nothing for a block quicker than that): the trainer's
    ``Waiting`` (``moe_train.train.progress``) with the elapsed time in its first line too."""
    # the first line a little early: the section's own line came just before the block
    beat = Waiting(log, what, after_s=0.9 * HEARTBEAT_S, every_s=HEARTBEAT_S, done=False)
    beat.describe = lambda: f"still {what}: {time.perf_counter() - beat.t0:.0f} s"
    return beat


def write(out_dir: Path, results: dict[str, Any], markdown: str) -> None:
    """results.json and results.md, each replaced atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("results.json", json.dumps(results, indent=1, default=str) + "\n"),
        ("results.md", markdown),
    ):
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)


def failed(results: dict[str, Any]) -> bool:
    return any(s["status"] == FAIL for s in results["sections"])
