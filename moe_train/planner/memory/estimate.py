"""Per-device bytes of one training step, from the config and the job's shape alone.

The formulas are stated in ``moe_train.planner.memory``'s docstring; this module evaluates them.
Nothing here imports JAX: the planner runs anywhere the config loads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from moe_train.config import Config, attention_dims, for_devices, head_dim
from moe_train.model import flops
from moe_train.parallel import jobplan
from moe_train.planner.memory import rows, step_gather

ITEMS = ("params", "grads", "optimizer", "activations", "moe_buffers", "precision_copies", "other")
# parallel.weight_gather=step's compute-dtype copy of the weights, held for the whole step
# (0 in micro_batch mode). Kept out of ITEMS, whose every entry the CLI's text report lists
# with a note of its own; ALL_ITEMS is every key of Estimate.per_device but "total".
STEP_WEIGHTS = "step_weights"
ALL_ITEMS = ITEMS + (STEP_WEIGHTS,)
PARAM_BYTES = {"float32": 4, "bfloat16": 2}  # model.param_dtype
# precision.compute -> bytes of activations and weight copies. fp8 computes in bf16: XLA's
# quantize-dequantize keeps bf16 values (on GPU the fused fp8 GEMMs read fp8 operands, but the
# tensors kept for the backward pass stay bf16), so fp8 saves no memory here.
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}
FP8_SITES = {"attention": 12, "dense": 9, "moe": 5}  # quantized tensors per sub-layer (3 per dot)
PLATFORMS = ("cpu", "gpu")  # Setup.platform: the compiler the job's step meets


@dataclass(frozen=True)
class Setup:
    """The job an estimate is for: sizes derived from the config, cluster and node count."""

    devices: int  # accelerators in the job
    ep: int  # expert-parallel group size (mesh axes expert_x x expert)
    dp: int  # data-parallel (FSDP) size: devices // ep
    tokens: int  # tokens per device per micro-batch: batch_size * seq_len / devices / micro_batches
    remat: str  # train.remat policy
    compute: str  # precision.compute: fp32 | bf16 | fp8
    backend: str  # "tiled" (padded tiles, CPU) or "sorted" (ragged/grouped GEMM on rows)
    tile_rows: int  # m of the tiled backend (0 for sorted)
    dispatcher: str  # local | allgather | a2a | hierarchical
    domains: int  # G: NVLink domains one EP group spans (mesh axis expert_x)
    domain_size: int  # D: devices of an EP group inside one domain (mesh axis expert)
    # "scores" (xla: [nh, S] fp32 scores per token) | "flash" (cuDNN, TE: O(S)) | "chunked"
    # (the kit's chunked attention: O(S), its backward's dq, dk, dv in XLA buffers) | "mask"
    # (cuDNN on packed documents: O(S) plus the token's row of the [S, S] additive mask)
    attention: str = "scores"
    loss_chunk: int = 0  # tokens per device of one cross-entropy chunk (0: all of them)
    loss_tile: int = 0  # vocab columns of one cross-entropy tile (0: the whole vocab)
    # "gpu" (a GPU preset: XLA:GPU, which fuses casts into their consumers and reduces a
    # scanned backward loop's weight gradients layer by layer) or "cpu" (XLA:CPU)
    platform: str = "cpu"

    @property
    def a(self) -> int:
        """Bytes per element of activations and weight copies."""
        return COMPUTE_BYTES[self.compute]

    @property
    def gpu(self) -> bool:
        return self.platform == "gpu"


@dataclass(frozen=True)
class Estimate:
    """Per-device bytes of one training step."""

    setup: Setup  # what it is for
    per_device: Mapping[str, int]  # ALL_ITEMS and "total" -> bytes
    moe_buffers_by_bucket: Mapping[str, int]  # capacity bucket ("1.0", ..., "worst") -> bytes
    bucket: str  # the bucket whose MoE buffers are in the total (largest finite one)
    params_total: int  # parameters of the whole model


# ----------------------------------------------------------------------------- state


def param_split(cfg: Config, s: Setup) -> tuple[int, int, int]:
    """(routed expert, FSDP-sharded, replicated) parameter counts of the job ``s``, MTP
    modules included: replicated are the norm scales and, on more than one device, any weight
    the sharding rules leave whole (``weight_shards``)."""
    routed = rep = total = 0
    for n, _, ways, kind in weight_shards(cfg, s):
        total += n
        routed += n if kind == "expert" else 0
        rep += n if kind == "norm" or (kind == "other" and ways == 1 and s.devices > 1) else 0
    return routed, total - routed - rep, rep


def weight_shards(cfg: Config, s: Setup) -> list[tuple[int, int, int, str]]:
    """(parameters, bytes each, devices splitting them, kind: expert | norm | other) of each
    kind of weight (``moe_train.parallel.sharding.weights``) on the job's mesh, split by the
    trainer's own rules (``sharding.logical_rules``). Norm scales and the router are fp32
    whatever ``model.param_dtype``."""
    from moe_train.parallel import sharding  # imports JAX: flax resolves the rules

    sizes = {sharding.DATA: s.dp, sharding.EXPERT_X: s.domains, sharding.EXPERT: s.domain_size}
    rules, pb = sharding.logical_rules(cfg, sizes), PARAM_BYTES[cfg.model.param_dtype]
    out = []
    for count, axes in sharding.weights(cfg.model, cfg.moe):
        names = tuple(name for name, _ in axes)
        kind = "expert" if "expert" in names else "norm" if len(axes) == 1 else "other"
        size = 4 if kind == "norm" or "expert_gate" in names else pb
        n = count * math.prod(width for _, width in axes)
        out.append((n, size, sharding.split_ways(names, rules, sizes), kind))
    return out


def fp8_state_bytes(cfg: Config, s: Setup) -> int:
    """fp8 scaling state (replicated): a scale and an amax history per quantized tensor."""
    if s.compute != "fp8":
        return 0
    m = cfg.model
    n_dense, n_moe = _layer_kinds(cfg)
    shared = FP8_SITES["dense"] if cfg.moe.num_shared_experts else 0
    attention = FP8_SITES["attention"]  # GQA's q, k, v, o; MLA's q_a, q_b (or q), kv_a, kv_b, o
    if m.attention_kind == "mla":
        attention = 3 * (5 if m.q_lora_rank else 4)
    sites = (
        (m.num_layers + m.mtp_depth) * attention
        + n_dense * FP8_SITES["dense"]
        + n_moe * (FP8_SITES["moe"] + shared)
        + m.mtp_depth * 3
    )  # + each eh_proj
    return sites * (1 + cfg.precision.amax_history) * 4


def state_bytes(cfg: Config, s: Setup) -> dict[str, int]:
    """params, grads, optimizer and other (MoE bias and fp8 state, batch, counters) per device."""
    params = sum(n * size // ways for n, size, ways, _ in weight_shards(cfg, s))
    _, n_moe = _layer_kinds(cfg)
    seqs = cfg.train.batch_size // s.devices
    other = (
        n_moe * cfg.moe.num_experts * 4 + seqs * (cfg.train.seq_len + 1) * 4 + 64 + fp8_state_bytes(cfg, s)
    )
    # gradient accumulation carries the running sum beside each micro-batch's gradients
    grads = params * (2 if cfg.train.micro_batches > 1 else 1) + accumulation_bytes(cfg, s)
    return dict(params=params, grads=grads, optimizer=2 * params, other=other)


def accumulation_bytes(cfg: Config, s: Setup) -> int:
    """What XLA:GPU holds beyond the running sum and one micro-batch's gradient when it
    accumulates gradients of FSDP-gathered weights (``micro_batch`` mode, dp > 1, more than one
    micro-batch, scanned layers): the backward loop writes each layer's reduce-scattered
    expert gradient into a stacked buffer while a zero-initialised stacked buffer of the same
    size is live beside it, and one stacked expert projection's master is copied transposed
    for its reduce-scatter: the routed experts' bytes and a third of them again (mixtral-8x7b
    on 8 h100-dgx nodes, EP 8, one-sequence micro-batches, compiled with --peak at 4 and 8
    layers: four stacked fp32 expert arrays beyond the planner's six, at the peak; without
    them the estimate was 1.19x low at full depth). Not counted without FSDP (dp = 1), where
    XLA:GPU held one stacked array beyond the six and the estimate errs high anyway (Mixtral on
    one node, EP 8, 4 layers: 0.91x)."""
    gather = cfg.parallel.weight_gather != step_gather.STEP
    if not (s.gpu and gather and s.dp > 1 and cfg.train.micro_batches > 1 and cfg.model.scan_layers):
        return 0
    experts = sum(n * size // ways for n, size, ways, kind in weight_shards(cfg, s) if kind == "expert")
    return experts + experts // 3  # SwiGLU's three projections: one of them transposed


def step_copy_bytes(cfg: Config, s: Setup) -> int:
    """Per-device bytes of ``parallel.weight_gather=step``'s copy of the weights (0 in
    ``micro_batch`` mode; ``moe_train.planner.memory.step_gather``)."""
    router = _layer_kinds(cfg)[1] * cfg.model.hidden * cfg.moe.num_experts  # MTP's too
    norms = sum(n for n, _, _, kind in weight_shards(cfg, s) if kind == "norm")  # MTP's too
    return step_gather.copy_bytes(
        cfg,
        s.devices,
        s.ep,
        s.dp,
        s.a,
        PARAM_BYTES[cfg.model.param_dtype],
        param_split(cfg, s),
        router,
        norms,
    )


# ----------------------------------------------------------------------------- per token


def _scores(cfg: Config, s: Setup) -> int:
    """Attention scores per token per layer. ``scores`` (xla): [heads, seq] logits, exp,
    probs in fp32, plus the probs cast to the compute dtype for the PV matmul when that is
    narrower. ``flash`` (cuDNN, TE) and ``chunked``: one fp32 logsumexp per head; the blocks'
    scores are recomputed in the backward pass (chunked's backward buffers:
    ``attention_backward_bytes``). ``mask`` (cuDNN on packed documents): that, plus the
    token's row of the [B, 1, S, S] additive mask (compute dtype) kept for the backward."""
    if s.attention in ("flash", "chunked", "mask"):
        mask = cfg.train.seq_len * s.a if s.attention == "mask" else 0
        return cfg.model.num_heads * 4 + mask
    narrow = s.a if s.a < 4 else 0
    return cfg.model.num_heads * cfg.train.seq_len * (12 + narrow)


def head_chunk_bytes(cfg: Config, s: Setup) -> int:
    """Logits of one cross-entropy tile (fp32 logits and softmax, compute-dtype logits): they
    exist for one chunk of ``loss_chunk`` tokens by ``loss_tile`` vocab columns at a time,
    forward and backward (``moe_train.model.loss``)."""
    narrow = s.a if s.a < 4 else 0
    V = cfg.model.vocab_size
    return min(s.loss_chunk or s.tokens, s.tokens) * min(s.loss_tile or V, V) * (8 + narrow)


def _attention_elements(m) -> tuple[int, int]:
    """(residual elements, matmul outputs) per token of one attention sub-layer.

    GQA, q = heads * head_dim, kv = kv_heads * head_dim: q before and after RoPE, the output
    and k, v (3 q + 2 kv); the projections' outputs q + 2 kv. MLA (``moe_train.model.mla``): the
    query latent before and after its norm (2W), q before and after RoPE (2 N D), the kv
    latent with the RoPE key and the normed latent (2Z + I), the up-projection's output
    N (U + J), full keys N D, values and the output (2 N J); its projections' outputs
    W + N D + Z + I + N (U + J)."""
    if m.attention_kind != "mla":
        q, kv = m.num_heads * head_dim(m), m.num_kv_heads * head_dim(m)
        return 3 * q + 2 * kv, q + 2 * kv
    N, W, Z = m.num_heads, m.q_lora_rank, m.kv_lora_rank
    U, I, J = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    D = U + I
    kept = 2 * W + 2 * N * D + 2 * Z + I + N * (U + J) + N * D + 2 * N * J
    return kept, W + N * D + Z + I + N * (U + J)


def token_bytes(cfg: Config, s: Setup, fused: bool = False) -> dict[str, int]:
    """Residual bytes per token of each sub-layer (see the docstring's table). ``fused``: as
    XLA:GPU keeps them where it can fuse the fp32 casts into their consumers (the block being
    recomputed, the output head); the layers a scan keeps hold what autodiff saved."""
    m, e, a = cfg.model, cfg.moe, s.a
    H = m.hidden
    attn_kept, attn_matmuls = _attention_elements(m)
    shared = e.num_shared_experts * (e.shared_ffn or e.expert_ffn)
    expert_copy = H * a if s.compute == "fp8" else 0  # the experts' q/dq copy of their input
    # a norm's residuals: its input and fp32 intermediates (H * (a + 8)); fused: the input and
    # the normed output in the compute dtype
    norm = 2 * H * a if fused else H * (a + 8)
    combine = e.top_k * H * (a if fused else a + 4)  # the gathered expert outputs (fp32 unfused)
    return dict(
        attention=norm + attn_kept * a + _scores(cfg, s),
        moe=norm + combine + 12 * e.num_experts + 4 * shared * a + expert_copy,
        dense=norm + 4 * m.dense_ffn * a,
        block_input=H * a,
        matmul_attention=H * a + attn_matmuls * a + H * a,
        matmul_moe=4 * e.num_experts + (2 * shared + H) * a if shared else 4 * e.num_experts,
        matmul_dense=(2 * m.dense_ffn + H) * a,
        head=norm + 4,  # final norm and the logsumexp; logits: per chunk
        mtp_input=3 * H * a + 2 * norm,  # an MTP depth: [emb; h] and eh_proj's output, 2 norms
    )


# ----------------------------------------------------------------------------- aggregate


def _layer_kinds(cfg: Config) -> tuple[int, int]:
    """(dense layers, MoE layers), the MTP modules' blocks included (MoE blocks, or dense ones
    in a model without MoE layers)."""
    m = cfg.model
    dense, moe = m.first_dense_layers, m.num_layers - m.first_dense_layers
    return (dense, moe + m.mtp_depth) if moe else (dense + m.mtp_depth, 0)


def activation_bytes(cfg: Config, s: Setup) -> int:
    """Token-proportional residuals held at the start of the backward pass, the recomputed
    block under remat, and the output head (MoE rows are ``moe_buffers``)."""
    t, tf = token_bytes(cfg, s), token_bytes(cfg, s, fused=s.gpu)
    n_dense, n_moe = _layer_kinds(cfg)
    full = {"moe": t["attention"] + t["moe"], "dense": t["attention"] + t["dense"]}
    redo = {"moe": tf["attention"] + tf["moe"], "dense": tf["attention"] + tf["dense"]}
    saved = {
        "none": full,
        "full": {"moe": t["block_input"], "dense": t["block_input"]},
        "matmuls": {
            "moe": t["matmul_attention"] + t["matmul_moe"],
            "dense": t["matmul_attention"] + t["matmul_dense"],
        },
        "moe": {"moe": t["block_input"] + t["moe"], "dense": t["block_input"] + t["dense"]},
    }[s.remat]
    biggest = max(redo["moe"] if n_moe else 0, redo["dense"] if n_dense else 0)
    working = 0 if s.remat == "none" else biggest  # the block being recomputed
    per_token = (
        n_moe * saved["moe"]
        + n_dense * saved["dense"]
        + working
        + (1 + cfg.model.mtp_depth) * tf["head"]
        + cfg.model.mtp_depth * tf["mtp_input"]
    )
    return s.tokens * per_token + head_chunk_bytes(cfg, s) + attention_backward_bytes(cfg, s)


def attention_backward_bytes(cfg: Config, s: Setup) -> int:
    """On GPU, the kit's chunked attention's backward buffers (``moe_train.model.attention.
    chunked``): dq accumulated in fp32 and cast to the compute dtype, dk and dv, per token of
    each layer whose backward is in flight; cuDNN and TE keep theirs inside the fused kernel.
    One layer's, two once the scanned layer loop runs twice or more: XLA:GPU double-buffers
    the loop and overlaps a peeled iteration's backward with the next one's (deepseek-v3 on
    32 gb200-nvl72 nodes, EP 64, 1-sequence micro-batches, compiled with --peak at 8 layers:
    two MoE layers' q, k and v gradients at the peak, 2.1 GiB; at 4 layers, one MoE layer in
    the loop, one)."""
    if not (s.gpu and s.attention == "chunked"):
        return 0
    qk, v, kv_heads = attention_dims(cfg.model)
    q = cfg.model.num_heads * qk
    per_token = 4 * q + s.a * (q + kv_heads * (qk + v))
    n_dense, n_moe = _layer_kinds(cfg)
    # the main layer loop's iterations: its MoE layers, or its dense ones where it has none
    looped = n_moe - cfg.model.mtp_depth if n_moe else n_dense
    layers = 2 if cfg.model.scan_layers and looped >= 2 else 1
    return layers * s.tokens * per_token


def _weight_copies(cfg: Config, s: Setup, experts: bool = True) -> dict[str, int]:
    """Bytes of one layer's weights as used (gathered over FSDP, cast to compute dtype);
    without the routed experts' unless ``experts``."""
    m, e, a = cfg.model, cfg.moe, s.a
    H = m.hidden
    shared = e.num_shared_experts * (e.shared_ffn or e.expert_ffn)
    gate = H * e.num_experts * 4 if s.devices > 1 else 0  # the fp32 router, all-gathered
    routed = _routed_layer_bytes(cfg, s) if experts else 0
    return dict(
        attention=flops.attention_params(m)[0] * a,
        moe=routed + gate + 3 * H * shared * a,
        dense=3 * H * m.dense_ffn * a,
        head=H * m.vocab_size * a,
    )


def _step_copies(cfg: Config, s: Setup) -> dict[str, int]:
    """``_weight_copies`` under ``parallel.weight_gather=step``: only what each use still
    gathers inside the EP group (the held copy keeps the other matrices and the router split
    over it); the experts are used as held, except fp8's per-layer quantized copy."""
    if not step_gather.in_group(cfg, s.devices, s.ep):
        w: dict[str, int] = dict.fromkeys(("attention", "moe", "dense", "head"), 0)
        if s.compute == "fp8":
            w["moe"] = _weight_copies(cfg, s)["moe"]
        return w
    return _weight_copies(cfg, s, experts=s.compute == "fp8")


def _layer_weights(w: dict[str, int], n_dense: int, n_moe: int) -> int:
    """Bytes of the largest layer's weight copies (attention plus its MLP or MoE)."""
    return max(
        w["attention"] + (w["moe"] if n_moe else w["dense"]), w["attention"] + (w["dense"] if n_dense else 0)
    )


def precision_copy_bytes(cfg: Config, s: Setup) -> int:
    """Compute-dtype copies of gathered weights kept for the backward pass, plus one layer's
    unsharded fp32 weight gradients before their reduce-scatter (FSDP only).

    Weights used as stored (one device, compute dtype = param dtype) need no copy, except
    under ``model.scan_layers``: the scanned body slices its layer out of the stacked
    weights, in the forward and again in the backward pass, and writes that layer's weight
    gradient into the stacked gradient (3 layers' weights; elsewhere the slice fuses into
    the cast or all-gather counted here)."""
    n_dense, n_moe = _layer_kinds(cfg)
    if s.devices == 1 and s.a == PARAM_BYTES[cfg.model.param_dtype] and s.compute != "fp8":
        scan = 3 if cfg.model.scan_layers else 0
        return scan * _layer_weights(_weight_copies(cfg, s), n_dense, n_moe)
    step = step_gather.active(cfg, s.dp, s.a, PARAM_BYTES[cfg.model.param_dtype])
    w = _step_copies(cfg, s) if step else _weight_copies(cfg, s)
    layer = _layer_weights(w, n_dense, n_moe)
    if s.remat == "none":
        kept = n_moe * (w["attention"] + w["moe"]) + n_dense * (w["attention"] + w["dense"])
    elif s.remat == "moe":
        kept = n_moe * w["moe"] + n_dense * w["dense"] + 2 * w["attention"]
    else:  # re-gathered in the backward pass: one layer plus the one being recomputed
        kept = 2 * layer
    # step: the gradient of an in-group gather stays in the compute dtype (cast after it)
    grads = (layer if step else layer * 4 // s.a) if s.devices > 1 else 0
    return kept + w["head"] + grads + (_vocab_bytes(cfg, s, w["head"]) if s.gpu else 0)


def _vocab_bytes(cfg: Config, s: Setup, head_copy: int) -> int:
    """XLA:GPU's whole-vocabulary buffers beside the head's copy: the embedding's gathered
    copy (as the head's; none when tied) and the gradients of the head (the loss's [H, V]
    accumulator) and of the embedding (the lookup's scatter-add), in the compute dtype, all
    live when the backward pass leaves the output head (compiled for H100: 4 [V, H] buffers
    at Qwen3's peak). On more than one device the loss runs per device
    (``loss.device_token_losses``) and the head's gradient summed over the devices is one
    more [V, H] beside each device's own (deepseek-v3 at full depth compiled for GB200:
    +1.6 GiB at the 1x peak). Each MTP depth looks its tokens up in the embedding again,
    and that lookup's scatter-add has a [V, H] target of its own, live through the MTP
    block's backward (deepseek-v3 at 4 layers compiled for GB200: 2 of 1.73 GiB at the
    peak)."""
    whole = cfg.model.hidden * cfg.model.vocab_size * s.a
    mtp = cfg.model.mtp_depth * whole
    summed = whole if s.devices > 1 else 0
    if cfg.model.tie_embeddings:
        return whole + mtp + summed
    return head_copy + 2 * whole + mtp + summed


def bucket_key(factor: float | None) -> str:
    """The key of the capacity bucket of ``factor``: "1", "1.25", ...; "worst" for None."""
    return "worst" if factor is None else f"{factor:g}"


def bucket_label(bucket: str) -> str:
    """A bucket's key as printed: its factor with an ``x`` ("1.25x"), or "worst"."""
    return bucket if bucket == "worst" else f"{bucket}x"


def estimate(cfg: Config, s: Setup) -> Estimate:
    """Every item of ``ITEMS`` for ``cfg`` on the job ``s``; MoE buffers at each bucket."""
    cfg = for_devices(cfg, s.devices)  # train.micro_batch_size as micro-batches of this job
    per = state_bytes(cfg, s)
    per["activations"] = activation_bytes(cfg, s)
    per["precision_copies"] = precision_copy_bytes(cfg, s)
    factors = jobplan.bucket_factors(s.dispatcher, cfg.moe.capacity_buckets)
    by_bucket = {bucket_key(f): rows.moe_buffer_bytes(cfg, s, f, _layer_kinds(cfg)[1]) for f in factors}
    bucket = "worst" if len(factors) == 1 else f"{factors[-2]:g}"
    per["moe_buffers"] = by_bucket[bucket]
    per[STEP_WEIGHTS] = step_copy_bytes(cfg, s)
    per["grads"] += _step_grad_bytes(cfg, s, per)
    per = {k: per[k] for k in ALL_ITEMS}
    per["total"] = sum(per.values())
    return Estimate(
        setup=s,
        per_device=per,
        moe_buffers_by_bucket=by_bucket,
        bucket=bucket,
        params_total=flops.param_counts(cfg)["total_with_mtp"],
    )


def _step_grad_bytes(cfg: Config, s: Setup, per: Mapping[str, int]) -> int:
    """A micro-batch's gradient with respect to the step's copy before its reduction: the
    copy's bytes again (scanned layers: the backward loop writes it whole; looped layers:
    each layer's is reduced as it comes, the largest layer's share), plus the largest
    array's fp32 cast where it exceeds what the backward pass has freed by then. On GPU
    XLA:GPU reduces each layer's gradient inside the backward loop even when scanned: the
    reduced shards (the copy / dp, in place of an fp32 micro-batch gradient beside the
    running sum) and the largest layer's share in flight."""
    copy = per[STEP_WEIGHTS]
    if not copy:
        return 0
    if s.gpu:  # XLA:GPU reduces each layer's gradient in the backward loop, as it comes
        fp32_grads = per["params"] if cfg.train.micro_batches > 1 else 0  # replaced by them
        return copy // s.dp + _copy_layer_bytes(cfg, s) - fp32_grads + _zeroed_expert_grads(cfg, s)
    if not cfg.model.scan_layers:
        copy = min(copy, _copy_layer_bytes(cfg, s))
    cast = step_gather.largest_cast(cfg, s.devices, s.ep, s.a)
    return copy + max(0, cast - per["activations"] - per["moe_buffers"] - per["precision_copies"])


def _zeroed_expert_grads(cfg: Config, s: Setup) -> int:
    """XLA:GPU's zero-initialised stacked buffer beside the one the scanned backward loop
    writes each layer's reduced expert gradients into (step mode on GPU, more than one
    micro-batch): the scanned MoE layers' routed experts, reduced over ``data``, in the
    compute dtype, once more. deepseek-v3 on 32 gb200-nvl72 nodes (EP 64, one-sequence
    micro-batches) compiled with --peak at 8 layers held two stacked bf16 sets of the five
    MoE layers' [5, 4, 3584, 2048] expert gradients where the planner counted one; from 8 to
    12 layers XLA:GPU added 8.29 GiB, the planner 7.59 without this term and 8.25 with it."""
    if not (cfg.model.scan_layers and cfg.train.micro_batches > 1):
        return 0
    scanned = _layer_kinds(cfg)[1] - cfg.model.mtp_depth if cfg.moe.num_experts else 0
    return scanned * _routed_layer_bytes(cfg, s) // s.dp


def _routed_layer_bytes(cfg: Config, s: Setup) -> int:
    """One MoE layer's routed experts on one device (its EP shard, whole over FSDP), in the
    compute dtype."""
    return (cfg.moe.num_experts // s.ep) * 3 * cfg.model.hidden * cfg.moe.expert_ffn * s.a


def _copy_layer_bytes(cfg: Config, s: Setup) -> int:
    """The largest layer's share of the step's copy (or the output head's)."""
    n_dense, n_moe = _layer_kinds(cfg)
    w, shared = _weight_copies(cfg, s), _weight_copies(cfg, s, experts=False)["moe"]
    ways = s.ep if step_gather.in_group(cfg, s.devices, s.ep) else 1
    moe = w["moe"] - shared + (w["attention"] + shared) // ways if n_moe else 0  # + router
    dense = (w["attention"] + w["dense"]) // ways if n_dense else 0
    return max(moe, dense, w["head"] // ways)
