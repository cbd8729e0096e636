"""The planner's search: the fastest job that fits, over the choices the kit has.

For a model, cluster preset and node count, ``search`` predicts the step of every job the keys
the user left open allow (``moe_train.planner.steptime``) and ranks those whose memory plan fits
(``moe_train.planner.memory``) by predicted step time; the batch is fixed, so the same order is
tokens/s/GPU. The keys and the values tried:

- ``parallel.ep``: the EP sizes dividing the experts and the GPUs whose groups the placement
  keeps inside NVLink domains or spans whole ones (``topology.placement.valid_eps_for_nodes``);
- ``parallel.weight_gather``: ``micro_batch``, ``step``;
- micro-batches: every count dividing the sequences per GPU, named as the model preset names
  them (``train.micro_batch_size`` sequences each, or ``train.micro_batches``);
- ``train.remat``: ``none``, ``full``, ``matmuls``, ``moe`` (opt-in, ``OPT_IN``);
- ``moe.overlap_chunks``: 1, 2, 4, 8 where they divide a micro-batch's rows; for each job the
  step model's own choice, the fewest within 1% of the shortest (``StepTime.best_chunks``);
- ``moe.dispatch_dtype``: ``activation``, ``fp8`` (opt-in, ``OPT_IN``);
- ``moe.capacity_buckets``: the preset's; only where no job fits with them, the list cut at
  the largest factor (at least ``BUCKET_FLOOR``) whose buffers fit: a step overflowing that
  bucket then runs out of memory (the memory verdict says so), a risk the step model, which
  assumes balanced routing, cannot weigh against time, so it is the last resort.

A key the user set (``--set``; ``--ep`` or ``parallel.dp`` for EP) keeps its value. Steps are
predicted first (a fraction of a millisecond each), then memory plans (milliseconds each,
cached by EP, weight gathering, micro-batches and remat, the only searched keys they depend
on) are made fastest-first until ``top`` jobs fit: no job slower than the ``top``-th that
fits is judged, nor a count of micro-batches where the most there can be does not fit (the
plan shrinks with more micro-batches from two on, ``_fit``). Ties go to the job with fewer
changes; a job with the same step and memory as the one ranked above it is left out (a
setting that changes nothing there, e.g. fp8 dispatch without EP). Nothing is searched where
nothing is predicted (fp32 compute, a nominal CPU preset). Where a job with opt-in settings
(``OPT_IN``, smaller buckets) would be over 1% faster than the best, ``Found.opt_in`` names it
for the user to ``--set``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_train import config
from moe_train.config import REMAT_POLICIES, WEIGHT_GATHERS
from moe_train.config.schema import DISPATCH_DTYPES
from moe_train.planner import compute as compute_calibration
from moe_train.planner import ep_plan as topo_plan
from moe_train.planner import memory, steptime
from topology import presets
from topology.placement import valid_eps_for_nodes

if TYPE_CHECKING:
    from moe_train.planner.request import Request

EP_KEY, GATHER_KEY, REMAT_KEY = "parallel.ep", "parallel.weight_gather", "train.remat"
MICRO_BATCHES_KEY, MICRO_SIZE_KEY = "train.micro_batches", "train.micro_batch_size"
CHUNKS_KEY, DISPATCH_KEY, BUCKETS_KEY = ("moe.overlap_chunks", "moe.dispatch_dtype", "moe.capacity_buckets")
# Searched only when the user asks (--set): train.remat other than the preset's is checked
# against XLA:GPU on one job only (mixtral-8x7b --layers 4, 8 h100 nodes, 4-sequence
# micro-batches, remat=none: XLA:GPU 58.2 GiB, the planner 73.2, docs/compile.md; matmuls and
# moe not at all), and fp8 dispatch changes numerics (e4m3 tokens on the wire).
# The search names the fastest such job where it would be over 1% faster (Found.opt_in); where
# nothing fits at the preset's remat, a job with another remat is the last resort.
OPT_IN = (REMAT_KEY, DISPATCH_KEY)
# A job the search makes must leave this share of the usable memory free: the planner is
# within about 15% of XLA:GPU's compiled peak on the Mixtral, Qwen3 and DeepSeek-V3 jobs it
# was checked on (docs/compile.md); the preset's own job is judged as it is.
HEADROOM = 0.10
BUCKET_FLOOR = 2.0  # a cut bucket list keeps buffers for at least twice the balanced load
CUT_GAIN = 0.99  # Found.opt_in: an opt-in job is named where its step is this much shorter


@dataclass(frozen=True)
class Settings:
    """One job's values of the searched keys."""

    ep: int  # parallel.ep
    gather: str  # parallel.weight_gather
    micro_batches: int  # micro-batches per step
    remat: str  # train.remat
    chunks: int  # moe.overlap_chunks
    dispatch: str  # moe.dispatch_dtype
    buckets: tuple[float, ...]  # moe.capacity_buckets


@dataclass(frozen=True)
class Candidate:
    """A job that fits, with its prediction and memory."""

    settings: Settings  # its values of the searched keys
    cfg: config.Config  # the base config with them (micro-batches resolved for the GPUs)
    changes: tuple[str, ...]  # the settings that differ from the base job, as --set items
    step: steptime.StepTime  # its predicted step per GPU
    total_bytes: int  # memory plan per GPU, at its largest capacity bucket
    usable_bytes: int  # what one GPU offers (the memory plan's budget)


@dataclass(frozen=True)
class Found:
    """What the search found."""

    base: Settings  # the job as the model preset and the user's --set items make it
    base_step_s: float  # the base job's predicted step
    base_fits: bool  # whether the base job's memory plan fits
    ranked: tuple[Candidate, ...]  # the fastest jobs that fit, at most ``top``, fastest first
    opt_in: Candidate | None  # the fastest job with opt-in settings (OPT_IN, cut buckets),
    # where over 1% faster than ranked[0]: named for the user to --set, not taken
    timed: int  # jobs whose step was predicted
    judged: int  # memory plans made
    fixed: tuple[str, ...]  # searched keys the user set, kept as given


@dataclass(frozen=True)
class _Context:
    """What every job of one search shares."""

    cluster: presets.Cluster  # the cluster preset
    nodes: int  # nodes in the job
    base: config.Config  # the base config, micro-batches resolved for the GPUs
    micro_item: str  # MICRO_SIZE_KEY or MICRO_BATCHES_KEY: how the model preset names them
    per_gpu: int  # sequences per GPU per step
    micro_open: bool  # whether the micro-batches are searched (the user set neither key)


def user_keys(req: Request) -> frozenset[str]:
    """The keys of the user's --set items, with parallel.ep where --ep (or parallel.dp) fixes
    it."""
    keys = {item.partition("=")[0].strip() for item in req.sets}
    if (req.ep is not None and not req.ep_fitted) or "parallel.dp" in keys:
        keys.add(EP_KEY)
    return frozenset(keys)


def micro_key(cfg: config.Config, fixed: frozenset[str]) -> str:
    """The key that names this job's micro-batches: the user's, else the model preset's."""
    if MICRO_BATCHES_KEY in fixed or (MICRO_SIZE_KEY not in fixed and not cfg.train.micro_batch_size):
        return MICRO_BATCHES_KEY
    return MICRO_SIZE_KEY


def _settings(cfg: config.Config) -> Settings:
    p, t, m = cfg.parallel, cfg.train, cfg.moe
    return Settings(
        p.ep,
        p.weight_gather,
        t.micro_batches,
        t.remat,
        m.overlap_chunks,
        m.dispatch_dtype,
        m.capacity_buckets,
    )


def _apply(cfg: config.Config, s: Settings) -> config.Config:
    """``cfg`` (micro-batches resolved) with the settings ``s``."""
    r = dataclasses.replace
    return r(
        cfg,
        parallel=r(cfg.parallel, ep=s.ep, dp=0, weight_gather=s.gather),
        train=r(cfg.train, micro_batches=s.micro_batches, micro_batch_size=0, remat=s.remat),
        moe=r(cfg.moe, overlap_chunks=s.chunks, dispatch_dtype=s.dispatch, capacity_buckets=s.buckets),
    )


def _values(key: str, fixed: frozenset[str], now, every) -> tuple:
    """The values searched for ``key``: ``now`` alone where the user set it."""
    return (now,) if key in fixed else tuple(dict.fromkeys((now, *every)))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def space(ctx: _Context, fixed: frozenset[str]) -> list[Settings]:
    """Every job the open keys allow, overlap chunks and buckets as the base job has them."""
    b = _settings(ctx.base)
    eps = valid_eps_for_nodes(ctx.cluster, ctx.nodes, ctx.base.moe.num_experts)
    axes = (
        _values(EP_KEY, fixed, b.ep, eps),
        _values(GATHER_KEY, fixed, b.gather, WEIGHT_GATHERS),
        tuple(_divisors(ctx.per_gpu)) if ctx.micro_open else (b.micro_batches,),
        _values(REMAT_KEY, fixed, b.remat, REMAT_POLICIES),
        _values(DISPATCH_KEY, fixed, b.dispatch, DISPATCH_DTYPES),
    )
    return [Settings(ep, g, n, r, b.chunks, d, b.buckets) for ep, g, n, r, d in itertools.product(*axes)]


def _changes(s: Settings, base: Settings, ctx: _Context) -> tuple[str, ...]:
    """The settings of ``s`` that differ from ``base``, as --set items."""
    micro = (
        f"{MICRO_SIZE_KEY}={ctx.per_gpu // s.micro_batches}"
        if ctx.micro_item == MICRO_SIZE_KEY
        else f"{MICRO_BATCHES_KEY}={s.micro_batches}"
    )
    items = (
        (s.ep != base.ep, f"{EP_KEY}={s.ep}"),
        (s.gather != base.gather, f"{GATHER_KEY}={s.gather}"),
        (s.micro_batches != base.micro_batches, micro),
        (s.remat != base.remat, f"{REMAT_KEY}={s.remat}"),
        (s.chunks != base.chunks, f"{CHUNKS_KEY}={s.chunks}"),
        (s.dispatch != base.dispatch, f"{DISPATCH_KEY}={s.dispatch}"),
        (s.buckets != base.buckets, f"{BUCKETS_KEY}={buckets_text(s.buckets)}"),
    )
    return tuple(item for differs, item in items if differs)


def buckets_text(buckets: tuple[float, ...]) -> str:
    return ",".join(f"{f:g}" for f in buckets)


def _timed(
    ctx: _Context, jobs: list[Settings], step_jobs: dict, chunks_open: bool, eff
) -> list[tuple[float, Settings]] | None:
    """(predicted step, settings with their overlap chunks) of every job whose EP the
    topology planner places; None where nothing is predicted (fp32 compute)."""
    out = []
    for s in jobs:
        if step_jobs[s.ep] is None:
            continue
        st = steptime.predict(_apply(ctx.base, s), ctx.cluster, eff, step_jobs[s.ep])
        if st is None:
            return None
        if chunks_open and st.best_chunks in st.by_chunks:
            s = dataclasses.replace(s, chunks=st.best_chunks)
            out.append((st.by_chunks[st.best_chunks], s))
        else:
            out.append((st.step_s, s))
    return out


def _step_job(req: Request, ep: int) -> steptime.Job | None:
    """The step model's job for EP ``ep`` (placement and all-to-all), or None where the
    topology planner refuses that EP size."""
    try:
        plan = topo_plan.request_plan(req, ep)
    except (presets.TopologyError, config.ConfigError, ValueError):
        return None
    return topo_plan.step_job(plan)


def _memory(cfg: config.Config, ctx: _Context) -> tuple[int, int, dict[str, int]] | None:
    """(total bytes per GPU at the largest bucket, usable bytes, the total at each finite
    bucket) of the job's memory plan; None where the planner refuses the job."""
    try:
        p = memory.plan(cfg, ctx.cluster, ctx.nodes, search=False)
    except memory.PlanError:
        return None
    per = p.estimate.per_device
    rest = per["total"] - per["moe_buffers"]
    return (
        per["total"],
        p.budget.usable_bytes,
        {f: rest + b for f, b in p.estimate.moe_buffers_by_bucket.items() if f != "worst"},
    )


def _fit(s: Settings, ctx: _Context, memo: dict, cut: bool) -> tuple[int, int, tuple[float, ...]] | None:
    """(total bytes per GPU, usable bytes, capacity buckets) of the job at the largest bucket
    that fits: the preset's list, or (``cut``) that list cut at the largest factor of at least
    BUCKET_FLOOR whose total fits; None where nothing fits. Memory plans are cached in
    ``memo`` by the keys they depend on. From two micro-batches on, the plan only shrinks with
    more of them (activations and MoE buffers of fewer tokens; the rest stays), so where the
    most there can be (one sequence each) does not fit, no count between does either."""
    most = ctx.per_gpu
    if (
        ctx.micro_open
        and 1 < s.micro_batches < most
        and _fit(dataclasses.replace(s, micro_batches=most), ctx, memo, cut) is None
    ):
        return None
    key = (s.ep, s.gather, s.micro_batches, s.remat)
    if key not in memo:
        memo[key] = _memory(_apply(ctx.base, s), ctx)
    if memo[key] is None:
        return None
    total, usable, by_bucket = memo[key]
    b = _settings(ctx.base)
    limit = usable if key == (b.ep, b.gather, b.micro_batches, b.remat) else usable * (1 - HEADROOM)
    if total <= limit:
        return total, usable, s.buckets
    for f in sorted(s.buckets, reverse=True)[1:] if cut else ():
        at = by_bucket.get(f"{f:g}")
        if f < BUCKET_FLOOR or at is None:
            break
        if at <= limit:
            return at, usable, tuple(b for b in s.buckets if b <= f)
    return None


def _rank(
    timed: list[tuple[float, Settings]],
    *,
    ctx: _Context,
    base: Settings,
    top: int,
    step_jobs: dict,
    eff,
    memo: dict,
    cut: bool,
) -> list[Candidate]:
    """The ``top`` fastest jobs that fit, memory plans made fastest-first; a job with the
    step and memory of the one ranked above it is left out."""
    order = sorted(timed, key=lambda t: (t[0], len(_changes(t[1], base, ctx))))
    out = []
    for step_s, s in order:
        fit = _fit(s, ctx, memo, cut)
        if fit is None or (out and (out[-1].step.step_s, out[-1].total_bytes) == (step_s, fit[0])):
            continue
        s = dataclasses.replace(s, buckets=fit[2])
        cfg = _apply(ctx.base, s)
        step = steptime.predict(cfg, ctx.cluster, eff, step_jobs[s.ep])
        assert step is not None, "a timed job has a prediction"
        out.append(
            Candidate(
                s,
                cfg,
                _changes(s, base, ctx),
                step,
                fit[0],
                fit[1],
            )
        )
        if len(out) == top:
            break
    return out


def search(req: Request, cluster: presets.Cluster, cfg: config.Config, top: int = 1) -> Found | None:
    """The ``top`` fastest jobs that fit for ``req`` (its --set items, EP and batch as
    ``cfg``, the launcher's validated config, has them); None where nothing is predicted.
    TopologyError for a compute calibration that does not load."""
    fixed = user_keys(req)
    gpus = req.nodes * cluster.gpus_per_node
    ctx = _Context(
        cluster=cluster,
        nodes=req.nodes,
        base=config.for_devices(cfg, gpus),
        micro_item=micro_key(cfg, fixed),
        per_gpu=cfg.train.batch_size // gpus,
        micro_open=not fixed & {MICRO_BATCHES_KEY, MICRO_SIZE_KEY},
    )
    eff = compute_calibration.load(req.compute or None, model=req.model)
    jobs = space(ctx, fixed)
    step_jobs = {ep: _step_job(req, ep) for ep in dict.fromkeys(s.ep for s in jobs)}
    base = _settings(ctx.base)
    base_job = step_jobs.get(base.ep)
    if base_job is None:
        return None
    timed = _timed(ctx, jobs, step_jobs, CHUNKS_KEY not in fixed, eff)
    if not timed:
        return None
    memo: dict = {}
    rank = functools.partial(_rank, ctx=ctx, base=base, step_jobs=step_jobs, eff=eff, memo=memo)
    plain = [t for t in timed if (t[1].remat, t[1].dispatch) == (base.remat, base.dispatch)]
    same_dispatch = [t for t in timed if t[1].dispatch == base.dispatch]
    can_cut = BUCKETS_KEY not in fixed
    ranked = (
        rank(plain, top=top, cut=False)
        or rank(plain, top=top, cut=can_cut)
        or rank(same_dispatch, top=top, cut=can_cut)
    )  # the last resorts, in order
    best = rank(timed, top=1, cut=can_cut)
    faster = best and ranked and best[0].step.step_s < CUT_GAIN * ranked[0].step.step_s
    base_step = steptime.predict(ctx.base, cluster, eff, base_job)
    assert base_step is not None, "timed jobs came from predictions"
    searched = (
        EP_KEY,
        GATHER_KEY,
        MICRO_BATCHES_KEY,
        MICRO_SIZE_KEY,
        REMAT_KEY,
        CHUNKS_KEY,
        DISPATCH_KEY,
        BUCKETS_KEY,
    )
    return Found(
        base=base,
        base_step_s=base_step.step_s,
        base_fits=_fit(base, ctx, memo, cut=False) is not None,
        ranked=tuple(ranked),
        opt_in=best[0] if faster else None,
        timed=len(timed),
        judged=len(memo),
        fixed=tuple(k for k in searched if k in fixed),
    )
