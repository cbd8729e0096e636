"""Does a plan fit? Usable memory, the verdict, and the cheapest change that would make it fit.

Usable memory per GPU is the preset's ``gpu_memory_gib`` times the preset's
``XLA_PYTHON_CLIENT_MEM_FRACTION`` (what XLA may allocate; the rest holds the CUDA context,
NCCL and cuBLAS workspaces), or 0.90 of it when the preset sets no fraction, or the memory
less ``reserve_gib`` when one is given.

When a plan does not fit, single changes are tried with the same estimate, cheapest first:
more expert parallelism (same GPUs, more all-to-all traffic), remat ``moe`` then ``matmuls``
then ``full`` (more recompute), more ``train.micro_batches`` (gradient accumulation: the same
step in smaller pieces, more steps of smaller GEMMs), a smaller ``train.batch_size`` (changes
the recipe), more nodes (more GPUs). ``precision.compute=fp8`` is not suggested: its XLA quantize-dequantize
computes in bf16, so the estimate counts it as bf16 plus its scaling state and the experts'
quantized input copy, never less memory (Transformer Engine's fp8 activation copies are not
modelled). If no single change fits, ``train.remat=full`` combined with a smaller batch,
then with more nodes.

Where XLA:GPU has compiled the job (``Compiled``: the submit preflight's cache, which ``make
compile`` of the same job fills too, ``moe_train.planner.preflight``), its peak at the planned bucket
decides instead, and the estimate stands beside it in the verdict's line; the estimate's
error on the job (compiled peak less estimate) is carried to the other buckets, the worst
case and the changes tried, which are judged by the estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_train.config import REMAT_POLICIES, Config
from moe_train.parallel import jobplan
from moe_train.planner.memory import job
from moe_train.planner.memory.estimate import ALL_ITEMS, Estimate, bucket_label, estimate
from topology.presets import Cluster

GIB = 2**30
DEFAULT_FRACTION = 0.90
REMAT_ORDER = ("moe", "matmuls", "full")  # least recompute first
Total = Callable[[Config], int | None]  # a config's estimated total on the job; None: refused
assert set(REMAT_ORDER) < set(REMAT_POLICIES)


@dataclass(frozen=True)
class Budget:
    """What one GPU offers."""

    device_bytes: int  # the GPU's memory (cluster preset gpu_memory_gib)
    usable_bytes: int  # what the step may use after the reserve
    reserve: str  # how the reserve was chosen, in words


@dataclass(frozen=True)
class Compiled:
    """XLA:GPU's compiled peak of the job (``python -m moe_train.planner.compile``)."""

    peak_bytes: int  # XLA:GPU's per-GPU peak (arguments + temp + outputs - aliased)
    bucket: str  # the capacity bucket compiled ("4", "worst"): the one the estimate judges by
    source: str  # where it was found, in words ("the submit preflight's compile, cached")


@dataclass(frozen=True)
class Alternative:
    """One change and its estimate."""

    change: str  # "parallel.ep=16", "train.remat=full", "train.batch_size=256", "nodes=16", ...
    total_bytes: int  # estimated per-GPU total with the change
    fits: bool  # total_bytes <= usable
    available: bool = True  # False for a what-if the kit cannot run (none are offered now)


@dataclass(frozen=True)
class Verdict:
    """Fits or not, and what to do about it."""

    fits: bool  # needed <= usable (needed: the compiled peak where one exists, else the total)
    total_bytes: int  # estimated per-GPU peak
    usable_bytes: int  # budget after the reserve
    device_bytes: int  # the GPU's memory
    spare_bytes: int  # usable - needed (negative when it does not fit)
    largest: str  # the largest item of ALL_ITEMS
    largest_bytes: int  # its bytes
    change: str | None  # the cheapest available change that fits; None if it fits or none does
    alternatives: tuple[Alternative, ...]  # everything tried, in order of cost
    worst_case_bytes: int  # the total with worst-case MoE buffers (no capacity bucket)
    bucket_fits: str | None  # the largest capacity bucket ("1.5", "worst") whose total fits
    message: str  # one line for humans
    compiled: Compiled | None = None  # XLA:GPU's peak that decided it; None: the estimate did

    @property
    def needed_bytes(self) -> int:
        """What the verdict judged: the compiled peak where one exists, else the estimate."""
        return self.compiled.peak_bytes if self.compiled else self.total_bytes


def budget(cluster: Cluster, reserve_gib: float | None = None) -> Budget:
    """Usable bytes per GPU of ``cluster`` (see the module docstring)."""
    device = int(cluster.gpu_memory_gib * GIB)
    if reserve_gib is not None:
        return Budget(device, device - int(reserve_gib * GIB), f"{reserve_gib:g} GiB reserve")
    text = cluster.env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    fraction = float(text) if text else DEFAULT_FRACTION
    why = ("XLA_PYTHON_CLIENT_MEM_FRACTION" if text else "default") + f" {fraction:g}"
    return Budget(device, int(device * fraction), why)


def _total(cfg: Config, cluster: Cluster, nodes: int, devices: int | None) -> int | None:
    """The estimated total, or None where the trainer would refuse this job."""
    try:
        return estimate(cfg, job.setup_for(cfg, cluster, nodes, devices=devices)).per_device["total"]
    except job.PlanError:
        return None


def _first_fit(label, candidates, usable: int) -> Alternative | None:
    """The first (change, total) that fits, else the smallest one tried."""
    best = None
    for change, total in candidates:
        if total is None:
            continue
        alt = Alternative(label(change), total, total <= usable)
        if alt.fits:
            return alt
        if best is None or total < best.total_bytes:
            best = alt
    return best


def _first_setting(key: str, values, cfg: Config, total: Total, usable: int) -> Alternative | None:
    """``_first_fit`` over ``key=v`` for each ``v`` of ``values``: ``cfg`` with ``key`` set to
    ``v`` (``job.with_setting``), ``total`` that config's estimated total."""
    pairs = ((v, total(job.with_setting(cfg, key, v))) for v in values)
    return _first_fit(lambda v: f"{key}={v}", pairs, usable)


def alternatives(
    cfg: Config, cluster: Cluster, nodes: int, devices: int | None, usable: int, current: int
) -> list[Alternative]:
    """Single changes that lower ``current``, cheapest first (module docstring); with remat
    ``full`` combined when no single available change fits."""
    n = devices or nodes * cluster.gpus_per_node
    total: Total = lambda c: _total(c, cluster, nodes, devices)  # noqa: E731
    E = cfg.moe.num_experts
    eps = [e for e in range(cfg.parallel.ep + 1, min(n, E) + 1) if jobplan.ep_fault(n, e, E) is None]
    out = [_first_setting("parallel.ep", eps, cfg, total, usable)]
    out += [
        _first_setting("train.remat", [r], cfg, total, usable) for r in REMAT_ORDER if r != cfg.train.remat
    ]
    out += [
        _micro_alt(cfg, n, total, usable),
        _batch_alt(cfg, n, total, usable),
        _nodes_alt(cfg, cluster, nodes, devices, usable),
    ]
    out = [a for a in out if a is not None and a.total_bytes < current]
    if not any(a.fits and a.available for a in out) and cfg.train.remat != "full":
        full = job.with_setting(cfg, "train.remat", "full")
        for alt in (
            _batch_alt(full, n, total, usable),
            _nodes_alt(full, cluster, nodes, devices, usable),
        ):
            if alt is not None and alt.total_bytes < current:
                out.append(Alternative("train.remat=full + " + alt.change, alt.total_bytes, alt.fits))
    return out


def _micro_alt(cfg: Config, n: int, total: Total, usable: int) -> Alternative | None:
    """The fewest ``train.micro_batches`` (dividing the sequences per device) that fit."""
    per = cfg.train.batch_size // n
    counts = [k for k in range(cfg.train.micro_batches + 1, per + 1) if per % k == 0]
    return _first_setting("train.micro_batches", counts, cfg, total, usable)


def _batch_alt(cfg: Config, n: int, total: Total, usable: int) -> Alternative | None:
    """The largest smaller ``train.batch_size`` (a multiple of the devices) that fits."""
    sizes = [n * k for k in range(cfg.train.batch_size // n - 1, 0, -1)]
    return _first_setting("train.batch_size", sizes, cfg, total, usable)


def _nodes_alt(
    cfg: Config, cluster: Cluster, nodes: int, devices: int | None, usable: int
) -> Alternative | None:
    """The fewest more nodes (the batch still dividing over the GPUs) that fit."""
    if devices is not None and devices < cluster.gpus_per_node:
        nodes = 1  # a partial node grows to whole nodes
    top = max(cfg.train.batch_size // cluster.gpus_per_node, nodes)
    counts = range(nodes + (devices is None), top + 1)
    return _first_fit(lambda k: f"nodes={k}", ((k, _total(cfg, cluster, k, None)) for k in counts), usable)


def judge(
    cfg: Config,
    est: Estimate,
    bud: Budget,
    cluster: Cluster,
    nodes: int,
    devices: int | None,
    search: bool = True,
    compiled: Compiled | None = None,
) -> Verdict:
    """The verdict for ``est`` against ``bud``, decided by ``compiled`` where given (at the
    estimate's bucket; another bucket's compile is not the job's peak and is ignored);
    alternatives only when it does not fit."""
    per = est.per_device
    total = per["total"]
    compiled = compiled if compiled is not None and compiled.bucket == est.bucket else None
    need = compiled.peak_bytes if compiled else total
    usable = bud.usable_bytes - (need - total)  # what the estimate may reach: its error carried
    largest = max(ALL_ITEMS, key=lambda k: per[k])
    worst = need - per["moe_buffers"] + est.moe_buffers_by_bucket["worst"]
    fits = need <= bud.usable_bytes
    base = total - per["moe_buffers"]
    bucket_fits = next(
        (b for b, v in reversed(list(est.moe_buffers_by_bucket.items())) if base + v <= usable), None
    )
    alts = tuple(alternatives(cfg, cluster, nodes, devices, usable, total)) if search and not fits else ()
    change = next((a.change for a in alts if a.fits and a.available), None)
    return Verdict(
        fits=fits,
        total_bytes=total,
        usable_bytes=bud.usable_bytes,
        device_bytes=bud.device_bytes,
        spare_bytes=bud.usable_bytes - need,
        largest=largest,
        largest_bytes=per[largest],
        change=change,
        alternatives=alts,
        worst_case_bytes=worst,
        bucket_fits=bucket_fits,
        message=_message(fits, total, bud.usable_bytes, largest, per[largest], change, worst, est, compiled),
        compiled=compiled,
    )


def _g(b: int) -> str:
    return f"{b / GIB:.1f} GiB"


def _message(fits, total, usable, largest, largest_bytes, change, worst, est, compiled=None) -> str:
    need, peak = total, ""
    if compiled:
        label = bucket_label(compiled.bucket)
        need, peak = (
            compiled.peak_bytes,
            f"XLA:GPU's compiled peak at the {label} bucket, {compiled.source}; "
            f"the planner's estimate {_g(total)}",
        )
    if fits:
        text = f"fits with {_g(usable - need)} to spare ({_g(need)} of {_g(usable)} usable per GPU"
        text += f": {peak})" if peak else ")"
        if worst > usable and est.bucket != "worst":
            text += (
                f"; worst-case MoE buffers would need {_g(worst)}: a step overflowing the "
                f"{est.bucket}x bucket would run out of memory"
            )
        return text
    text = f"does not fit: needs {_g(need)} per GPU, {_g(usable)} usable"
    text += f" ({peak})" if peak else ""
    text += f"; largest item: {largest} ({_g(largest_bytes)})"
    return text + (f"; cheapest change that fits: {change}" if change else "; no single change tried fits")
