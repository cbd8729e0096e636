"""Will it fit? Per-GPU memory of a training step, estimated before anything is submitted.

``plan(cfg, cluster, nodes)`` -> ``Plan`` (estimate, budget, verdict); ``check_fits(cfg,
cluster, nodes)`` -> ``Verdict`` (for the launcher); ``python -m moe_train.planner.memory`` prints it.

Notation (per GPU): N GPUs, P = ``parallel.ep``, dp = N / P (FSDP), T = batch_size *
seq_len / N / micro_batches tokens (one micro-batch's: only one is live at a time;
``train.micro_batch_size`` sequences give micro_batches = batch_size / N / micro_batch_size),
S = seq_len, H hidden, q = heads * head_dim, kv = kv_heads * head_dim,
nh heads, E experts, L = E / P local experts, K top-k, F expert_ffn, V vocab, a = bytes of
activations and weight copies by ``precision.compute`` (4 fp32, 2 bf16, 2 fp8: its XLA
quantize-dequantize keeps bf16 values), pb = bytes of ``model.param_dtype``.

State (exact: matches XLA's argument sizes, tests/test_memory.py)
    params     = (routed_experts / (P * dp) + other_matrices / N + norms) * pb
                 (``sharding.LOGICAL_RULES``: expert -> EP axes and the expert weights'
                 embed -> data; every other weight's embed -> all N devices (FSDP))
    grads      = params                      (same dtype and sharding, after reduce-scatter;
                                              2 * params with train.micro_batches > 1: the
                                              running sum and one micro-batch's gradients)
    optimizer  = 2 * params                  (AdamW mu and nu; the fp32 params are the master)
    other      = expert-bias state + the batch's int32 rows + counters
                 + fp8 scaling state (fp8 only): 4 * (1 + amax_history) bytes per quantized
                 tensor, 3 per dense projection (input, kernel, output gradient), 5 per MoE
                 layer (input, wi_0, wi_1, wo, output gradient)

Activations (token-proportional residuals kept for the backward pass), bytes per token:
    attention sub-layer  H*(a+8) + (3q+2kv)*a + scores             a' = a if a < 4 else 0
        residual and fp32 norm intermediates; q, k, v, context; scores: nh*S*(12 + a') per
        token where the attention keeps [S, S] scores (model.attention=xla: masked logits,
        exp and probs in fp32 plus the compute-dtype probs for the PV matmul), nh*4 (one
        fp32 logsumexp per head) for chunked, cuDNN and TE, which recompute their blocks;
        plus S*a for cuDNN on packed documents (data.source=prepared, data.packing): its
        segment mask becomes a [B, 1, S, S] additive bias in the compute dtype, kept for the
        backward pass. ``auto`` is resolved as the trainer would on the cluster
        (job.attention_kind, job.attention_memory).
    MoE sub-layer        H*(a+8) + K*H*(a+4) + 12E + 4*shared_width*a (+ H*a under fp8:
                         the experts' quantized copy of the input; the router keeps the original)
        residual, fp32 norm/router inputs, the per-assignment expert outputs gathered for the
        fp32 combine, router scores, shared-expert SwiGLU
    dense sub-layer      H*(a+8) + 4*dense_ffn*a
    chunked backward     GPU presets, the kit's chunked attention (its dq, dk and dv are XLA
                         buffers; cuDNN and TE keep theirs in the fused kernel), per layer
                         whose backward is in flight: 4q + a*(q + kvh*(Dqk + Dv)) (dq in fp32
                         and cast, dk, dv; MLA: kvh = nh); one layer's, two once the scanned
                         loop runs twice or more (XLA:GPU double-buffers the loop:
                         ``estimate.attention_backward_bytes``)
    head (once)          H*(a+8) + 4               final norm, the logsumexp; plus, once per
                         step (not per token), one cross-entropy tile's logits C*W*(8 + a'):
                         C = train.loss_chunk tokens per device, W <= 2048 vocab
                         columns (moe_train.model.loss.vocab_tile): flat in V past 2048
  kept per layer by ``train.remat`` (moe_train.model.remat):
    none     every sub-layer's residuals
    full     the block input H*a; plus one whole block (the one being recomputed)
    matmuls  block input + q, k, v and o-projection outputs + router logits (4E) + dense and
             shared SwiGLU matmul outputs; plus one whole block
    moe      block input + the MoE (or dense) sub-layer's residuals; plus one whole block
  activations = T * (layers * kept + recomputed block + head + chunked backward) + C*W*(8 + a')

MoE buffers (rows R of one MoE layer on one GPU; bucket factor f of moe.capacity_buckets,
slots C = min(worst, 8*ceil(f * balanced / 8)) as moe_train.parallel.jobplan.bucket_slots):
    local (P = 1)  R = T*K
    allgather      R = P*T*K, plus the gathered tokens P*T*H*a
    a2a            R = P*C, C for balanced T*K/P, worst T*min(K, L); plus received tokens and
                   returned outputs 2*R*H*a
    hierarchical   stage 1 G*C1 rows over the slow links, stage 2 R = D*C2 inside the domain
    tiled backend  R rounded up to tiles: (ceil(R/m) + L) * m
  per layer: R * (F*c + 2*H*a) + exchange rows * H*a, with c = 8 (tiled: its VJP keeps
  x @ [wi_0|wi_1] in fp32) or 3a (sorted rows: a0, a1 and h in the compute dtype, what
  ``gemm.swiglu_product``'s VJP and the wo GEMM keep, recomputed or stacked by a scan);
  kept for every MoE layer (+1 in flight) under none/moe, for two layers under full/matmuls
  (one on GPU presets: XLA:GPU fuses the gradients' elementwise steps into their GEMMs);
  plus one layer's send buffers (tiled on GPU: and the gradient of its [R, 2F] activations in
  the compute dtype, kept from the backward's row walk to its weight walk). The total uses the
  largest finite bucket; the smallest and the worst case (no bucket) are reported beside it.

Precision copies (weights as used: all-gathered over FSDP and cast to the compute dtype;
none when dp = 1 and a = pb, except under fp8, whose weights are quantized copies): per layer
attention 2H(q+kv)*a, MoE L*3HF*a + fp32 router
H*E*4 (dp > 1) + shared 3H*width*a, dense 3H*dense_ffn*a. Kept for every layer under none,
the MoE/dense ones under moe (attention re-gathered), two layers under full/matmuls; plus the
lm_head copy H*V*a and one layer's unsharded fp32 weight gradients before reduce-scatter.

Step weights (``parallel.weight_gather=step``, ``moe_train.planner.memory.step_gather``): the
compute-dtype copy of every weight gathered over ``data`` once per step and held for it
(routed / P * a + other / P * a where the EP group splits the width, else other * a), with
the router in fp32; grads then add one micro-batch's gradient of that copy. Precision copies
count only what each use still gathers inside the EP group. 0 in ``micro_batch`` mode.

GPU presets (``Setup.platform`` "gpu": the estimate models XLA:GPU, checked against
``python -m moe_train.planner.compile``, which compiles the job for the preset's GPU): besides the
3a rows above, in the block being recomputed and the output head each norm keeps 2*H*a
(its input and output in the compute dtype) in place of H*(a+8), and the combine's gathered
expert outputs K*H*a in place of K*H*(a+4): XLA:GPU fuses the fp32 casts into their
consumers (mixtral-8x7b at 4 layers, 32,768 tokens a micro-batch: 80 kB per token of the
recomputed block and head live at the peak, where the unfused terms count 201 and these 94).
What a scan stacks (every layer under remat none/moe) is what autodiff saved, fp32
included: the unfused terms (the expert rows' 3a: their VJP keeps no fp32 [R, F]). Step
mode's gradient is reduced layer by layer inside the backward loop
(grads: the reduced shards, copy / dp, in place of the fp32 micro-batch gradient, plus one
layer's share in flight), and the whole-vocabulary buffers at the end of the backward pass
are counted in the precision copies: the embedding's gathered copy and the gradients of
the head and the embedding, V*H*a each (untied). Gradient accumulation of weights gathered
per micro-batch over FSDP (``micro_batch`` mode, dp > 1, micro_batches > 1, scanned layers)
adds the routed experts' gradient bytes and a third of them to grads: XLA:GPU's backward loop
holds a zero-initialised stacked gradient beside the one it writes, and one projection's
master transposed (``estimate.accumulation_bytes``; mixtral-8x7b's preset job was 1.19x low
at full depth without it). Under full/matmuls remat each MTP block's
expert weight-gradient operands, R * (2H + 3F) * a, are held through the main layers'
backward (XLA:GPU's scheduler defers those GEMMs, which only the optimizer needs, while
memory allows: ``rows.deferred_mtp_bytes``).

Validation (tests/test_memory.py; tiny preset, 3 layers, 16 x 128 tokens, XLA:CPU):
the state equals XLA's compiled argument size to within 52 bytes (step counters) on 1 device,
on 8 devices with EP 8 and with EP 2 x FSDP 4. For remat none the total is 1.08x..1.17x
XLA's compiled peak (tested within 0.95x..1.3x: the estimate errs high). Under remat the
estimate models a memory-aware schedule. With the Python loop of blocks
(``model.scan_layers=false``) XLA:CPU hoisted part of the recomputation: its peak under full
remat was 1.25x the estimate on 1 device (0.83x since zero buffers are made from data,
``permute.zeros_after``) and 2.2x with EP 8 (where full remat compiles to more
temp than none: 30.0 vs 21.7 MiB); under moe it is 0.76x..0.87x. Scanned layers keep the
recomputation in the backward loop (XLA's peak under full remat 0.81x the estimate). The
same band holds for chunked attention at 512 tokens and a 32,768-token vocab in loss chunks
of 512 tokens (2,048 tokens a step). With that vocab at the preset's 512 tokens the estimate
is 0.82x: XLA:CPU's peak is then in the AdamW update, which copies the old [V, H] embedding
and head and the head's mu and nu (not modelled; the loss's own tile is 2 MiB there). Under
scan with weights used as stored (one device, compute dtype = param
dtype) three layers' weights are counted as copies: the scanned body's slices in the forward
and backward passes and the layer gradient written into the stack.

May import: ``moe_train.config``, ``moe_train.model`` (FLOPs, attention and remat choices),
``moe_train.moe``, ``moe_train.parallel`` and ``topology`` (presets, placement). Never the
training loop: ``make plan`` and the launcher run it without starting a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_train.config import Config
from moe_train.planner.memory.estimate import ALL_ITEMS, ITEMS, Estimate, Setup, bucket_label, estimate
from moe_train.planner.memory.job import PlanError, setup_for, with_setting
from moe_train.planner.memory.verdict import GIB, Alternative, Budget, Compiled, Verdict, budget, judge
from topology.presets import Cluster, load

__all__ = [
    "ALL_ITEMS",
    "ITEMS",
    "GIB",
    "Alternative",
    "Budget",
    "Compiled",
    "Estimate",
    "Plan",
    "PlanError",
    "Setup",
    "Verdict",
    "bucket_label",
    "check_fits",
    "plan",
]


@dataclass(frozen=True)
class Plan:
    """A model on a job: the estimate, what the GPU offers, and the verdict."""

    cluster: Cluster  # the cluster preset
    nodes: int  # nodes in the job
    estimate: Estimate  # per-GPU bytes
    budget: Budget  # usable bytes per GPU
    verdict: Verdict  # fits or not, and the cheapest change


def plan(
    cfg: Config,
    cluster: Cluster | str,
    nodes: int,
    *,
    ep: int | None = None,
    devices: int | None = None,
    reserve_gib: float | None = None,
    search: bool = True,
    compiled: Compiled | None = None,
) -> Plan:
    """Estimate ``cfg`` on ``nodes`` nodes of ``cluster`` (or ``devices`` GPUs) with EP ``ep``
    (default ``parallel.ep``); ``compiled``: XLA:GPU's peak of the job, which then decides the
    verdict (``verdict.judge``). Raises PlanError (a ConfigError) for jobs the trainer refuses."""
    cluster = load(cluster) if isinstance(cluster, str) else cluster
    if ep is not None and ep != cfg.parallel.ep:
        cfg = with_setting(cfg, "parallel.ep", ep)
    est = estimate(cfg, setup_for(cfg, cluster, nodes, devices=devices))
    bud = budget(cluster, reserve_gib)
    return Plan(cluster, nodes, est, bud, judge(cfg, est, bud, cluster, nodes, devices, search, compiled))


def check_fits(cfg: Config, cluster: Cluster | str, nodes: int) -> Verdict:
    """The launcher's check: does ``cfg`` fit on ``nodes`` whole nodes of ``cluster``?"""
    return plan(cfg, cluster, nodes).verdict
