"""Simulated GPUs, the trainer's mesh on them, and each capacity bucket's step compiled by
XLA:GPU.

Devices: ``jax.experimental.topologies.get_topology_desc(name, "cuda", target_config=...,
topology="1x<nodes>x<gpus per node>")`` (compile-only devices; ``plugin.enable`` ran first).
The mesh is the trainer's (``topology.device_mesh.build``) on the NVLink domains the
launcher's allocation gets (``topology.placement``: ``parallel.domain_size`` devices each).
The step is the trainer's (``moe_train.train.step.make_train_step``) for every EP plan the
stepper can run (``moe_train.parallel.sharding.ep_plans``: one per capacity bucket), with the
micro-batches the loop uses (``config.for_devices``). Everything before ``lower()`` is
abstract (``jax.ShapeDtypeStruct`` arguments with their shardings, ``step.abstract_state``)
and traced for the target GPU's platform (``facts.platform_of``; JAX's private machine reads
answered by ``facts.jax_reads``).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from moe_train.config import Config, ConfigError, for_devices
from moe_train.data import packing
from moe_train.parallel import sharding
from moe_train.parallel.jobplan import EPPlan
from moe_train.planner.compile import facts, peak
from moe_train.planner.compile.job import Job
from moe_train.planner.memory.estimate import bucket_key
from moe_train.planner.memory.job import replaced
from moe_train.train.step import CompiledMemory, StepCounter, abstract_state, make_train_step
from topology import device_mesh, placement


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One capacity bucket's step, compiled."""

    plan: EPPlan | None  # its EP plan (None on one device)
    memory: CompiledMemory  # XLA's per-GPU memory analysis
    trace_s: float  # trace and lower (StableHLO), seconds
    compile_s: float  # XLA:GPU's compile, seconds
    hlo: str  # the optimized, scheduled HLO (compiled.as_text())
    note: str = ""  # how the compile deviated from the preset's settings ("" where it did not)
    peak: dict | None = None  # what fills the peak (peak.Peak.record), where it was dumped

    @property
    def bucket(self) -> str:
        """Its bucket: "1", "1.25", ..., "worst" (the memory planner's keys)."""
        return bucket_name(self.plan)


# XLA:GPU without a GPU does not autotune: its default Triton GEMM tiling can fail on small
# matmuls (seen: MLA's query projection of deepseek-v3-tiny, a bf16 [64, 32] dot, jax 0.10.2),
# where a GPU's autotuner would drop that tiling and pick another
TILE_FAILURE = "Couldn't find output tile sizes"
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def simulated_devices(job: Job) -> list[Any]:
    """``job.devices`` compile-only devices of the target GPU, ``gpus_per_node`` per host."""
    from jax.experimental import topologies

    topo = f"1x{job.nodes}x{job.cluster.gpus_per_node}"
    return list(
        topologies.get_topology_desc(
            job.target.name, "cuda", target_config=job.target.text, topology=topo
        ).devices
    )


def mesh_config(job: Job, cfg: Config) -> Config:
    """``cfg`` on the job's devices: the loop's micro-batches, and ``parallel.domain_size``
    from the domains the launcher's allocation gets."""
    cfg = for_devices(cfg, job.devices)
    alloc = placement.allocation(
        job.cluster,
        job.nodes,
        cfg.parallel.ep,
        num_experts=cfg.moe.num_experts,
        allow_straddle=cfg.parallel.allow_straddle,
    )
    sizes = {len(d) for d in placement.synth_domains(job.cluster, alloc)}
    if len(sizes) != 1:
        raise ConfigError(
            f"the {job.nodes} nodes fill NVLink domains unevenly "
            f"({sorted(sizes)} GPUs); compile a node count that fills whole domains"
        )
    return replaced(cfg, "parallel", domain_size=sizes.pop())


def batch_arg(cfg: Config, mesh) -> Any:
    """The step's batch, abstract: int32 [B, S+1] (with segment ids when packed)."""
    spec = jax.ShapeDtypeStruct(
        (cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh)
    )
    packed = cfg.data.source == "prepared" and cfg.data.packing
    return packing.make(spec, spec if packed else None)


def compile_one(
    cfg: Config, mesh, plan: EPPlan | None, target, devices, dump_dir: Path | None = None
) -> Compiled:
    """One bucket's step; with ``dump_dir``, XLA dumps it there and the Compiled carries what
    fills its peak (``peak.read``; the dump is pruned to the files that explain it)."""
    t0 = time.perf_counter()
    platform = facts.platform_of(target)
    with facts.jax_reads(target, devices):
        state = abstract_state(cfg, mesh, platform)
        state_sharding = jax.tree.map(lambda a: a.sharding, state)
        step = make_train_step(cfg, mesh, StepCounter(), state_sharding, plan, platform)
        hold = plan is not None and plan.capacity_factor is not None
        args = (state, batch_arg(cfg, mesh)) + (
            (jax.ShapeDtypeStruct((), jnp.bool_, sharding=sharding.replicated(mesh)),) if hold else ()
        )
        with step.sharding.activate():
            lowered = step.jitted.trace(*args).lower()
    t1 = time.perf_counter()
    compiled, note = xla_compile(lowered, peak.dump_options(dump_dir) if dump_dir else None)
    t2 = time.perf_counter()
    live = peak.read(dump_dir) if dump_dir else None
    if dump_dir:
        peak.prune(dump_dir)
    memory = CompiledMemory.of(compiled)
    assert memory is not None, "XLA:GPU's executable has a memory analysis"
    return Compiled(
        plan=plan,
        memory=memory,
        trace_s=t1 - t0,
        compile_s=t2 - t1,
        hlo=compiled.as_text(),
        note=note,
        peak=live.record() if live else None,
    )


def xla_compile(lowered, options: dict | None = None) -> tuple[Any, str]:
    """XLA:GPU's compile of ``lowered`` (``options``: XLA debug options, e.g. a dump); where
    the deviceless Triton GEMM tiling fails (``TILE_FAILURE``), compiled again with Triton
    GEMM fusions off (cuBLAS for every matmul), said in the note."""
    try:
        return lowered.compile(options or None), ""
    except jax.errors.JaxRuntimeError as err:
        if TILE_FAILURE not in str(err):
            raise
        found = re.search(r"%[\w.]+ = \w+\[[\d,]*\]", str(err))
        matmul = found.group(0) if found else "a matmul"
        return lowered.compile({**(options or {}), **NO_TRITON_GEMM}), (
            f"compiled with xla_gpu_enable_triton_gemm=false: deviceless XLA:GPU found no "
            f"Triton tiling for {matmul} (a GPU's autotuner picks another)"
        )


def bucket_name(plan: EPPlan | None) -> str:
    """The memory planner's key of ``plan``'s capacity bucket ("1", "1.25", ..., "worst")."""
    return bucket_key(None if plan is None else plan.capacity_factor)


def bucket_plans(
    job: Job, cfg: Config, devices: Sequence[Any], only: str = ""
) -> tuple[Any, list[EPPlan | None], dict[str, str]]:
    """(the mesh, the EP plans to compile, {bucket not compiled: the compiled bucket it
    equals}) for ``cfg`` (kernels concrete) on ``devices``: every capacity bucket, or only
    bucket ``only`` (ConfigError naming the buckets when it is none of them). A bucket whose
    receive buffers are an earlier bucket's (the planner's ``moe_buffers_by_bucket`` equal:
    a bucket whose slots are capped at the worst case) is that bucket's step: a step never
    overflows the earlier one onto it, so it is not compiled again."""
    mesh = device_mesh.build(cfg, devices).mesh
    plans = sharding.ep_plans(cfg, mesh)
    names = [bucket_name(p) for p in plans]
    if only and only not in names:
        raise ConfigError(
            f"--bucket {only!r} is not a capacity bucket of this job; valid: {', '.join(names)}, planned"
        )
    if only:
        return mesh, [p for p, n in zip(plans, names) if n == only], {}
    size = job.plan.estimate.moe_buffers_by_bucket
    todo: list[EPPlan | None] = []
    same: dict[str, str] = {}
    for plan, name in zip(plans, names):
        twin = next((bucket_name(p) for p in todo if size.get(bucket_name(p)) == size.get(name)), None)
        if twin is None or name not in size:
            todo.append(plan)
        else:
            same[name] = twin
    return mesh, todo, same
