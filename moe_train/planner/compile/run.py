"""One compile of a job: devices, kernels, every bucket's step, the report and its files.

Imports jax: ``plugin.enable`` must have run (``python -m moe_train.planner.compile`` does it first).
Progress goes to stderr: a line as each bucket's compile starts, ``still compiling ...`` every
10 s while XLA:GPU works (``moe_train.train.progress.Waiting``), a line with its peak when it
is done; XLA's own rematerialization and CUB-sort warnings are taken off stderr and said as
notes in the report (``xla_log``). The result goes to the caller.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax

from moe_train.config import Config
from moe_train.parallel.jobplan import EPPlan
from moe_train.planner.compile import kernels, lower, report, xla_log
from moe_train.planner.compile.job import Job
from moe_train.planner.compile.report import render
from moe_train.train.progress import Waiting

__all__ = ["compile_job", "render"]


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def compile_job(job: Job, out_dir: Path, bucket: str = "", dump: bool = False) -> tuple[dict, Path]:
    """Compile every distinct bucket of ``job`` (or only ``bucket``: "planned" is the memory
    planner's); (the result dict, the directory written). ``dump``: XLA dumps each bucket
    under ``out_dir/xla/`` and the result says what fills its peak (``peak``)."""
    devices = lower.simulated_devices(job)
    cfg = lower.mesh_config(job, job.cfg)
    cfg, chosen = kernels.choose(cfg, job.target, devices)
    only = job.plan.estimate.bucket if bucket == "planned" else bucket
    mesh, plans, same = lower.bucket_plans(job, cfg, devices, only)
    compiled, records, sorts = [], [], 0
    for i, plan in enumerate(plans, 1):
        name = lower.bucket_name(plan)
        dump_dir = out_dir / "xla" / f"xla-{name}" if dump else None
        c, seen = _compile_bucket(job, cfg, mesh, plan, devices, f"{i} of {len(plans)}", dump_dir)
        compiled.append(c)
        records.append(report.bucket_record(job, c))
        sorts = max(sorts, seen.sorts)
    notes = [n for n in (xla_log.sort_note(xla_log.Warnings(sorts=sorts)),) if n]
    result = report.result(job, chosen, records, jax.__version__, same=same, notes=notes)
    return result, report.write(out_dir, result, compiled)


def _compile_bucket(
    job: Job, cfg: Config, mesh, plan: EPPlan | None, devices, which: str, dump_dir: Path | None
) -> tuple[lower.Compiled, xla_log.Warnings]:
    """One bucket's step, said as it starts, every 10 s while it compiles, and when done;
    XLA's rematerialization warning becomes a note of the bucket."""
    name = lower.bucket_name(plan)
    with Waiting(say, f"compiling bucket {name} ({which}) with XLA:GPU", after_s=0, done=False):
        with xla_log.captured() as seen:
            c = lower.compile_one(cfg, mesh, plan, job.target, devices, dump_dir)
    remat = xla_log.remat_note(seen, c.memory.peak, job.plan.budget.usable_bytes)
    say(
        f"compiled bucket {name}: peak {report.size(c.memory.peak)} per GPU, "
        f"trace {c.trace_s:.1f} s, XLA:GPU {c.compile_s:.1f} s"
    )
    return dataclasses.replace(c, note="; ".join(n for n in (c.note, remat) if n)), seen
