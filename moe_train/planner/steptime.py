"""Predicted step time, tokens/s, model TFLOP/s and MFU of a training job, per GPU.

Inputs: the resolved model config (``moe_train.config``, after ``--set``), the cluster preset,
the job's size and EP layout, one planned all-to-all (``moe_train.planner.cost.Breakdown``) and a
compute calibration (``moe_train.planner.compute``). Every input and every term is in ``StepTime`` and
``as_json``. Letters: T tokens per GPU per step, n micro-batches, c = ``moe.overlap_chunks``, P EP
size, Q data-parallel (FSDP) size, N GPUs, b bytes per element of the matmul inputs.

Model FLOPs per token are ``moe_train.model.flops`` (forward x 3), split into attention
projections, attention scores, the routed experts' grouped GEMMs, the output heads and the
rest (dense MLPs, shared experts, routers, MTP projections). ``train.remat`` adds the
recomputed forward work (``RECOMPUTE``) to the hardware FLOPs, not to the model FLOPs.

    compute  = sum over kinds of T * flops / (peak * efficiency)
               (fp8: GEMMs at the fp8 peak x fp8_gemm_efficiency; attention scores stay bf16)
    a2a      = MoE layers x a2as per layer x (n x c x latency + T's bytes / bandwidth)
               (``moe.dispatch_dtype=fp8``: the forward dispatch, and its recomputation,
               moves (H + 4) / 2H of the bf16 bytes)
    exposed  = a2a - min(a2a, G) x h(c)     G: the grouped and shared-expert GEMMs
               (h: ``moe_train.planner.compute.a2a_hidden``, the share XLA:GPU's schedule hides with c
               chunks in the job's weight-gather mode, flat or hierarchical, measured by
               ``make compile``: chunk i's exchange under chunk i-1's GEMMs, and the
               backward's weight-gradient GEMMs under its exchanges)
    fsdp     = n x (gathers x weights' b bytes + one reduce-scatter) x (S-1)/S / link
               (non-expert weights over all N GPUs, expert weights over Q; the link is the
               network when the group spans NVLink domains); ``parallel.weight_gather=step``
               gathers over Q once per step and moves only gradients across groups per
               micro-batch (``fsdp_step_parts``); gradients are reduced in the compute
               dtype in both modes, as XLA:GPU compiles them (the weight-gradient matmuls'
               bf16 partial sums are reduce-scattered where they are made, make compile)
    exposed  = fsdp - o + max(0, o - compute)
               (o: each part times the share XLA:GPU's schedule hides of it, measured by
               ``make compile``: ``fsdp_hidden_micro_batch``; in step mode one share
               per part of ``fsdp_step_parts`` and chunk count:
               ``moe_train.planner.compute.fsdp_step_share``)
    optimizer= params per GPU x (28 B AdamW + 12 B per extra micro-batch) / (HBM x eff)
    step     = compute + exposed a2a + exposed fsdp + optimizer

Throughput is T / step; model TFLOP/s is model FLOPs x T / step; MFU divides that by the
dense peak of ``precision.compute`` (the trainer's definition: fp8 runs against the fp8
peak). Routing is assumed balanced (the cost model's uniform routing). fp32 compute has no
single peak (TF32 or FP32): no prediction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe_train.config import WEIGHT_GATHERS, Config, moe_layer_count
from moe_train.model import flops
from moe_train.planner import compute as compute_calibration
from moe_train.planner import cost
from moe_train.planner.compute import Compute
from moe_train.planner.memory.job import replaced
from topology.presets import Cluster

ADAMW_BYTES = 28  # fp32 param, grad, m, v read; param, m, v written
ACCUMULATE_BYTES = 12  # per extra micro-batch: read the sum and the new gradient, write the sum
# train.remat -> (recompute factor per kind, all-to-alls per MoE layer, weight all-gathers per
# micro-batch); 4/3 = one more forward on top of forward + backward. Gathers: the forward's
# and one in the backward, where the recomputation's gathered weight also serves the
# gradient's matmuls (XLA:GPU's schedule of the full-depth Mixtral jobs, make compile,
# remat full and matmuls, either weight-gather mode: 2 per layer per micro-batch, not 3).
# All-to-alls: dispatch, combine and their transposes; a recomputing policy repeats the
# dispatch only (the experts weigh their rows, so the combine's backward needs none of its
# results: tests/test_remat.py counts them in the lowered step).
RECOMPUTE = {
    "none": ({}, 4, 2),
    "full": ({"attn_proj": 4 / 3, "scores": 4 / 3, "experts": 4 / 3, "other": 4 / 3}, 5, 2),
    "matmuls": ({"scores": 4 / 3, "experts": 4 / 3}, 5, 2),
    "moe": ({"attn_proj": 4 / 3, "scores": 4 / 3}, 4, 2),
}


@dataclasses.dataclass(frozen=True)
class Job:
    """The job the prediction is for."""

    gpus: int  # N
    ep: int  # P
    dp: int  # Q = N / P
    tokens_per_gpu: int  # T per step
    a2a: cost.Breakdown  # one planned dispatch (or combine) over T tokens
    hierarchical: bool = False  # the exchange is hierarchical (EP groups span NVLink domains)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One step on one GPU, in seconds, with what it is made of."""

    flops_per_token: dict[str, float]  # model FLOPs (forward + backward) per kind
    compute_s: dict[str, float]  # per kind, recomputation included
    a2a_s: float  # all-to-all time, none hidden
    a2a_exposed_s: float  # what the chunked overlap does not hide
    fsdp_s: float  # FSDP all-gathers and reduce-scatters, none hidden
    fsdp_exposed_s: float
    optimizer_s: float
    step_s: float
    tokens_per_s: float  # per GPU
    model_tflops: float  # per GPU
    peak_tflops: float  # the dense peak MFU is taken against
    mfu: float
    inputs: dict[str, Any]  # everything the numbers came from
    by_chunks: dict[int, float]  # predicted step seconds for each moe.overlap_chunks that fits
    best_chunks: int  # the fewest chunks within 1% of the shortest of them
    by_gather: dict[str, float]  # predicted step seconds for each parallel.weight_gather

    @property
    def comm_exposed_s(self) -> float:
        return self.a2a_exposed_s + self.fsdp_exposed_s

    @property
    def comm_share(self) -> float:
        """Exposed communication over the step."""
        return self.comm_exposed_s / self.step_s


def flops_by_kind(cfg: Config) -> dict[str, float]:
    """Model FLOPs per token, forward + backward, by kind (they sum to
    ``flops.train_flops_per_token``)."""
    m, e = cfg.model, cfg.moe
    forward = flops.forward_flops_per_token(cfg)
    moe_layers = m.num_layers - m.first_dense_layers
    expert_blocks = moe_layers + (m.mtp_depth if moe_layers else 0)
    kinds = {
        "experts": 2.0 * e.top_k * 3 * m.hidden * e.expert_ffn * expert_blocks,
        "scores": flops.attention_flops_per_token(cfg),
        "heads": 2.0 * m.hidden * m.vocab_size * (1 + m.mtp_depth),
        "attn_proj": 2.0 * flops.attention_params(m)[0] * (m.num_layers + m.mtp_depth),
    }
    kinds["other"] = forward - sum(kinds.values())
    assert kinds["other"] > -1e-6 * forward, kinds  # the named kinds are parts of the forward
    return {k: 3.0 * max(v, 0.0) for k, v in kinds.items()}


def _compute_s(cfg: Config, cluster: Cluster, eff: Compute, T: int) -> dict[str, float]:
    recompute = RECOMPUTE[cfg.train.remat][0]
    gemm = _gemm_rate(cfg, cluster, eff, eff.gemm_efficiency)
    grouped = _gemm_rate(cfg, cluster, eff, eff.grouped_gemm_efficiency)
    rate = {
        "experts": grouped,
        "scores": cluster.peak_bf16_flops * eff.attention_efficiency,
        "heads": gemm,
        "attn_proj": gemm,
        "other": gemm,
    }
    return {k: T * f * recompute.get(k, 1.0) / rate[k] for k, f in flops_by_kind(cfg).items()}


def _gemm_rate(cfg: Config, cluster: Cluster, eff: Compute, bf16_efficiency: float) -> float:
    """FLOP/s of a GEMM: with fp8 compute, the fp8 peak at ``fp8_gemm_efficiency``; else the
    bf16 peak at ``bf16_efficiency``."""
    if cfg.precision.compute == "fp8":
        return cluster.peak_fp8_flops * eff.fp8_gemm_efficiency
    return cluster.peak_bf16_flops * bf16_efficiency


def _shared_expert_s(cfg: Config, compute: dict[str, float]) -> float:
    """The shared experts' part of ``other``: it overlaps the dispatch too."""
    m, e = cfg.model, cfg.moe
    per_token = 3 * 2.0 * 3 * m.hidden * e.num_shared_experts * (e.shared_ffn or e.expert_ffn)
    per_token *= m.num_layers - m.first_dense_layers
    other = flops_by_kind(cfg)["other"]
    return compute["other"] * per_token / other if other else 0.0


def _a2a(cfg: Config, job: Job, compute: dict[str, float], eff: Compute) -> tuple[float, float]:
    """(all-to-all seconds, exposed seconds) per step."""
    layers = moe_layer_count(cfg.model)
    if job.ep <= 1 or not layers:
        return 0.0, 0.0
    per_layer = RECOMPUTE[cfg.train.remat][1]
    n, c = cfg.train.micro_batches, cfg.moe.overlap_chunks
    transfer = job.a2a.total_s - job.a2a.latency_s  # of bf16 rows
    fp8 = fp8_dispatches(cfg)
    rows = per_layer - fp8 + fp8 * fp8_row_ratio(cfg.model.hidden)
    total = layers * (per_layer * n * c * job.a2a.latency_s + rows * transfer)
    hide = compute["experts"] + _shared_expert_s(cfg, compute)
    return total, total - min(total, hide) * _a2a_share(cfg, eff, job)


def _a2a_share(cfg: Config, eff: Compute, job: Job) -> float:
    """The share of the exchange the schedule hides for this job (``moe_train.planner.compute``)."""
    step = cfg.parallel.weight_gather == "step"
    return compute_calibration.a2a_hidden(eff, cfg.moe.overlap_chunks, step, job.hierarchical)


def fp8_dispatches(cfg: Config) -> int:
    """How many of a MoE layer's all-to-alls send fp8 rows: the forward dispatch, and its
    recomputation under remat; combines and gradients stay bf16."""
    if cfg.moe.dispatch_dtype != "fp8":
        return 0
    return 2 if RECOMPUTE[cfg.train.remat][1] > 4 else 1


def fp8_row_ratio(hidden: int) -> float:
    """Bytes of an fp8 row (one byte per element + a 4-byte scale) over a bf16 row's."""
    return (hidden + 4) / (2 * hidden)


def link_bytes_per_s(cluster: Cluster, span: int) -> float:
    """Achieved bytes/s per GPU of a collective over ``span`` consecutive GPUs."""
    if span > cluster.domain_size:
        return cluster.eta_network * cluster.nic_gbps_per_gpu * cost.GB
    return cluster.eta_nvlink * cluster.nvlink_gbps_per_gpu * cost.GB


def weights(cfg: Config) -> tuple[float, float]:
    """(non-expert, routed-expert) parameters, MTP included."""
    c = flops.param_counts(cfg)
    experts = c["routed_experts"] + c["mtp_routed_experts"]
    return c["total_with_mtp"] - experts, experts


STEP_PARTS = ("gather_data", "gather_group", "reduce_scatter_group", "reduce_scatter_data", "all_reduce")


def _fsdp(cfg: Config, cluster: Cluster, eff: Compute, job: Job) -> tuple[float, float]:
    """(FSDP seconds, the seconds of it the schedule can hide): each part at its measured
    share (``moe_train.planner.compute``)."""
    if cfg.parallel.weight_gather == "step":
        parts = fsdp_step_parts(cfg, cluster, job)
        chunks = cfg.moe.overlap_chunks
        hideable = sum(t * compute_calibration.fsdp_step_share(eff, k, chunks) for k, t in parts.items())
        return sum(parts.values()), hideable
    t = _fsdp_s(cfg, cluster, job)
    return t, t * eff.fsdp_hidden_micro_batch


def _fsdp_s(cfg: Config, cluster: Cluster, job: Job) -> float:
    """``parallel.weight_gather=micro_batch``: every use's gathers and one reduce-scatter per
    micro-batch."""
    dense, experts = weights(cfg)
    b = 4 if cfg.precision.compute == "fp32" else 2
    moves = RECOMPUTE[cfg.train.remat][2] + 1  # the all-gathers, then one reduce-scatter
    s = cfg.train.micro_batches * moves * b
    link = link_bytes_per_s(cluster, job.gpus)
    t = dense * (job.gpus - 1) / job.gpus / link if job.gpus > 1 else 0.0
    if job.dp > 1:
        t += experts / job.ep * (job.dp - 1) / job.dp / link
    return s * t


def fsdp_step_parts(cfg: Config, cluster: Cluster, job: Job) -> dict[str, float]:
    """``parallel.weight_gather=step`` (``moe_train.train.gather``), seconds of each of its
    collectives (``STEP_PARTS``): once per step the EP group's shard of every weight comes
    over ``data`` (b bytes: ``gather_data``); per micro-batch the non-expert weights are
    gathered inside the EP group per use (``gather_group``) and their gradient is
    reduce-scattered there (``reduce_scatter_group``), then all-reduced over ``data`` on the
    group's shard (``all_reduce``); the expert weights' gradient is reduce-scattered over
    ``data`` (``reduce_scatter_data``). Gradients move b bytes: XLA:GPU reduces the matmuls'
    compute-dtype outputs (the full-depth Mixtral step-mode HLO: bf16 reduce-scatters and
    all-reduces of every weight gradient but the fp32 router's)."""
    dense, experts = weights(cfg)
    b = 4 if cfg.precision.compute == "fp32" else 2
    P, Q, n = job.ep, job.dp, cfg.train.micro_batches
    group, across = link_bytes_per_s(cluster, P), link_bytes_per_s(cluster, job.gpus)
    cross = (Q - 1) / Q
    inside = dense * (P - 1) / P / group
    return {
        "gather_data": b * (dense + experts) / P * cross / across,
        "gather_group": n * RECOMPUTE[cfg.train.remat][2] * b * inside,
        "reduce_scatter_group": n * b * inside,
        "reduce_scatter_data": n * b * experts / P * cross / across,
        "all_reduce": n * b * 2 * dense / P * cross / across,
    }


def _optimizer_s(cfg: Config, cluster: Cluster, eff: Compute, job: Job) -> float:
    dense, experts = weights(cfg)
    per_gpu = dense / job.gpus + experts / job.gpus
    traffic = ADAMW_BYTES + ACCUMULATE_BYTES * (cfg.train.micro_batches - 1)
    return per_gpu * traffic / (cluster.hbm_bytes_per_s * eff.hbm_efficiency)


CHUNK_CHOICES = (1, 2, 4, 8)


def predict(cfg: Config, cluster: Cluster, eff: Compute, job: Job) -> StepTime | None:
    """The step of ``cfg`` as ``job`` on ``cluster``, with the step for each ``moe.overlap_chunks``
    that divides a micro-batch's tokens; None for fp32 compute (no peak)."""
    if cfg.precision.compute == "fp32":
        return None
    rows = job.tokens_per_gpu // cfg.train.micro_batches
    by = {
        c: _step_s(replaced(cfg, "moe", overlap_chunks=c), cluster, eff, job)
        for c in CHUNK_CHOICES
        if rows % c == 0
    }
    best = min(c for c, s in by.items() if s <= 1.01 * min(by.values())) if by else 1
    gathers = {
        g: _step_s(replaced(cfg, "parallel", weight_gather=g), cluster, eff, job) for g in WEIGHT_GATHERS
    }
    return dataclasses.replace(_predict(cfg, cluster, eff, job, by, best), by_gather=gathers)


def _step_s(cfg: Config, cluster: Cluster, eff: Compute, job: Job) -> float:
    """The predicted step seconds of ``cfg`` alone (without the alternatives ``predict`` times)."""
    return _predict(cfg, cluster, eff, job, {}, 0).step_s


def _predict(
    cfg: Config, cluster: Cluster, eff: Compute, job: Job, by_chunks: dict[int, float], best_chunks: int
) -> StepTime:
    compute = _compute_s(cfg, cluster, eff, job.tokens_per_gpu)
    busy = sum(compute.values())
    a2a, a2a_exposed = _a2a(cfg, job, compute, eff)
    fsdp, fsdp_hideable = _fsdp(cfg, cluster, eff, job)
    fsdp_exposed = fsdp - fsdp_hideable + max(0.0, fsdp_hideable - busy)
    optimizer = _optimizer_s(cfg, cluster, eff, job)
    step = busy + a2a_exposed + fsdp_exposed + optimizer
    model_flops = flops.train_flops_per_token(cfg) * job.tokens_per_gpu
    peak = cluster.peak_fp8_flops if cfg.precision.compute == "fp8" else cluster.peak_bf16_flops
    inputs = {
        "gpus": job.gpus,
        "ep": job.ep,
        "dp": job.dp,
        "tokens_per_gpu": job.tokens_per_gpu,
        "micro_batches": cfg.train.micro_batches,
        "overlap_chunks": cfg.moe.overlap_chunks,
        "dispatch_dtype": cfg.moe.dispatch_dtype,
        "fp8_dispatches": fp8_dispatches(cfg),
        "remat": cfg.train.remat,
        "compute": cfg.precision.compute,
        "weight_gather": cfg.parallel.weight_gather,
        "moe_layers": moe_layer_count(cfg.model),
        "a2a_per_moe_layer": RECOMPUTE[cfg.train.remat][1],
        "a2a_hidden": _a2a_share(cfg, eff, job),
        "hierarchical": job.hierarchical,
        "fsdp_hidden": fsdp_hideable / fsdp if fsdp else 0.0,
        "fsdp_parts": fsdp_step_parts(cfg, cluster, job) if cfg.parallel.weight_gather == "step" else {},
        "fsdp_part_shares": {
            k: compute_calibration.fsdp_step_share(eff, k, cfg.moe.overlap_chunks) for k in STEP_PARTS
        },
        "a2a_latency_s": job.a2a.latency_s,
        "a2a_transfer_s": job.a2a.total_s - job.a2a.latency_s,
        **dict(zip(("params_non_expert", "params_expert"), weights(cfg))),
        "peak_bf16_tflops": cluster.peak_bf16_flops / 1e12,
        "peak_fp8_tflops": cluster.peak_fp8_flops / 1e12,
        "hbm_tbps": cluster.hbm_bytes_per_s / 1e12,
        "compute_file": eff.path,
        "overlap_model": eff.model,  # whose measured overlap shares apply ("": the defaults)
        "efficiency": {k: getattr(eff, k) for k in compute_calibration.FIELDS},
        "efficiency_source": dict(eff.source),
    }
    return StepTime(
        flops_per_token=flops_by_kind(cfg),
        compute_s=compute,
        a2a_s=a2a,
        a2a_exposed_s=a2a_exposed,
        fsdp_s=fsdp,
        fsdp_exposed_s=fsdp_exposed,
        optimizer_s=optimizer,
        step_s=step,
        tokens_per_s=job.tokens_per_gpu / step,
        model_tflops=model_flops / step / 1e12,
        peak_tflops=peak / 1e12,
        mfu=model_flops / step / peak,
        inputs=inputs,
        by_chunks=by_chunks,
        best_chunks=best_chunks,
        by_gather={},
    )


def as_json(st: StepTime) -> dict[str, Any]:
    """The prediction as plain JSON values (seconds per step per GPU)."""
    out = dataclasses.asdict(st)
    out["comm_exposed_s"], out["comm_share"] = st.comm_exposed_s, st.comm_share
    return out
