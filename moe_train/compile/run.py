"""One compile of a job: devices, kernels, every bucket's step, the report and its files.

Imports jax: ``plugin.enable`` must have run (``python -m moe_train.compile`` does it first).
Progress (one line per bucket compiled) goes to stderr; the result to the caller.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

from moe_train.compile import kernels, lower, report
from moe_train.compile.job import Job
from moe_train.compile.report import render

__all__ = ["compile_job", "render"]


def compile_job(job: Job, out_dir: Path, bucket: str = "", dump: bool = False) -> tuple[dict, Path]:
    """Compile every bucket of ``job`` (or only ``bucket``: "planned" is the memory planner's);
    (the result dict, the directory written). ``dump``: XLA dumps each bucket under
    ``out_dir/xla/`` and the result says what fills its peak (``peak``)."""
    devices = lower.simulated_devices(job)
    cfg = lower.mesh_config(job, job.cfg)
    cfg, chosen = kernels.choose(cfg, job.target, devices)
    compiled, records = [], []
    only = job.plan.estimate.bucket if bucket == "planned" else bucket
    for c in lower.compile_buckets(job, cfg, devices, only, out_dir / "xla" if dump else None):
        compiled.append(c)
        records.append(report.bucket_record(job, c))
        print(
            f"compiled bucket {c.bucket}: peak {report.size(c.memory.peak)} per GPU, "
            f"trace {c.trace_s:.1f} s, XLA:GPU {c.compile_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    result = report.result(job, chosen, records, jax.__version__)
    return result, report.write(out_dir, result, compiled)
