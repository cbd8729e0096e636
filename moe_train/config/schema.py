"""The run's config sections: frozen dataclasses (a comment on every field), the fixed
choices of the string fields, and the quantities derived from one section.

``moe_train.config`` builds and validates a ``Config`` from these (presets, ``--set``) and
re-exports every name here; import them from there.
"""

from __future__ import annotations

import dataclasses

from moe_train.base.choices import BACKENDS, SCORE_FUNCTIONS

DISPATCHERS = ("auto", "allgather", "a2a", "hierarchical")  # moe.dispatcher
DISPATCH_DTYPES = ("activation", "fp8")  # moe.dispatch_dtype
ROUTERS = ("learned", "balanced")  # study.router
DATA_SOURCES = ("synthetic", "tokens", "bytes", "prepared")
TOKEN_DTYPES = ("uint16", "uint32")
DTYPES = ("float32", "bfloat16")
COMPUTE = ("fp32", "bf16", "fp8")  # precision.compute
FP8_RECIPES = ("delayed", "current", "mxfp8")  # mxfp8: Transformer Engine on Blackwell only
FP8_BACKENDS = ("auto", "xla", "te")  # precision.fp8_backend
REMAT_POLICIES = ("none", "full", "matmuls", "moe")  # moe_train.model.remat documents each
WEIGHT_GATHERS = ("micro_batch", "step")  # moe_train.train.gather documents both
ATTENTION = ("auto", "xla", "cudnn", "chunked", "te", "splash")  # model.attention (moe_train.model.attention)
ON_NONFINITE = ("stop", "skip")  # train.on_nonfinite
ROPE_LAYOUTS = ("half", "interleaved")  # rope.layout (moe_train.model.rope)
ROPE_SCALINGS = ("none", "yarn")  # rope.scaling
ATTENTION_KINDS = ("gqa", "mla")  # model.attention_kind


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape."""

    vocab_size: int = 256  # tokens in the vocabulary (256 for byte-level text)
    hidden: int = 64  # model width d_model
    num_layers: int = 2  # transformer blocks
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); divides num_heads
    head_dim: int = 0  # per-head width; 0 means hidden // num_heads (then heads must divide hidden)
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # RMSNorm epsilon
    qk_norm: bool = False  # RMSNorm on each query/key head (Qwen3)
    tie_embeddings: bool = False  # share the input embedding with the output projection
    # with tie_embeddings: logits x this; 0: hidden**-0.5 (keeps the unit-scale init's logits O(1)); 1:
    # Hugging Face's convention (from-hf sets it)
    tied_logit_scale: float = 0.0
    first_dense_layers: int = 0  # the first N blocks use a dense SwiGLU MLP instead of MoE
    dense_ffn: int = 256  # hidden width of the dense SwiGLU MLP in those blocks
    param_dtype: str = "float32"  # master weight dtype (compute precision: [precision])
    # attention kernel: auto | xla (full scores) | cudnn | chunked (flash-style) | te | splash (TPU)
    attention: str = "auto"
    attention_block: int = 0  # query/key block rows of the chunked and splash attention; 0 picks per length
    scan_layers: bool = True  # run repeated blocks under a scan (one compiled body); false: a Python loop
    # gqa (grouped-query: num_kv_heads, head_dim) | mla (multi-head latent attention, DeepSeek-V2/V3: the
    # fields below)
    attention_kind: str = "gqa"
    # mla: width of the query latent (V3: 1536); 0 projects queries straight from the hidden state
    q_lora_rank: int = 0
    kv_lora_rank: int = 512  # mla: width of the shared key/value latent (V3: 512)
    qk_nope_head_dim: int = 128  # mla: per-head query/key dims without RoPE (V3: 128)
    # mla: RoPE dims of each query head and of the one key all heads share (V3: 64); even
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128  # mla: per-head value width (V3: 128)
    mtp_depth: int = 0  # multi-token prediction modules (V3: 1): module k also predicts token i+k+1; 0: none
    # weight of the depths' mean cross-entropy in the training loss (V3: 0.3 for its first 10T tokens)
    mtp_loss_weight: float = 0.3
    # the weight from train step mtp_late_step on (V3: 0.1 for its last 4.8T tokens)
    mtp_loss_weight_late: float = 0.1
    mtp_late_step: int = 0  # optimizer step from which mtp_loss_weight_late applies; 0: never


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts layer: router, experts, load balancing."""

    num_experts: int = 8  # routed experts E
    top_k: int = 2  # experts per token k
    expert_ffn: int = 128  # hidden width F of each routed SwiGLU expert
    num_shared_experts: int = 0  # always-on shared experts (DeepSeek); 0 disables
    shared_ffn: int = 0  # hidden width of each shared expert; 0 means expert_ffn
    score_function: str = "softmax"  # softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3)
    normalize_top_k: bool = True  # renormalise the chosen weights to sum to 1
    num_groups: int = 0  # expert groups for group-limited routing; 0 disables
    group_top_k: int = 0  # groups each token may use when num_groups > 0
    routed_scaling: float = 1.0  # factor on the routed experts' weights
    backend: str = "auto"  # grouped GEMM: auto | tiled | ragged_dot | mgpu | te | megablox (TPU)
    tile_rows: int = 0  # row tile of the tiled backend and of megablox's padded groups; 0: per platform
    # switch-style load-balance loss over the global batch, E*sum_e f_e*P_e with f the share of the top-k
    # assignments (balanced: 1; Hugging Face's router_aux_loss_coef multiplies top_k times this value, so
    # theirs x top_k is ours); 0 disables
    aux_loss_coef: float = 0.01
    seq_aux_loss_coef: float = 0.0  # per-sequence load-balance loss (DeepSeek-V3); 0 disables
    z_loss_coef: float = 0.001  # router z-loss (mean squared logsumexp of logits); 0 disables
    bias_update_rate: float = 0.0  # aux-loss-free balancing: bias += rate*sign(mean-load); 0 off
    dispatcher: str = "auto"  # expert-parallel token exchange: auto | allgather | a2a | hierarchical
    overlap_chunks: int = 1  # split each rank's tokens into N chunks to overlap dispatch with GEMMs
    # rows sent to other devices: activation (their own dtype) | fp8 (e4m3 + a per-row scale: half of bf16's
    # bytes; combine and gradients stay unquantized)
    dispatch_dtype: str = "activation"
    # exchange buffers x balanced load; then worst
    capacity_buckets: tuple[float, ...] = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
    bucket_step_down_after: int = 20  # steps of lower load before using the next smaller bucket


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the training tokens come from."""

    # synthetic | tokens (pre-tokenised file) | bytes (UTF-8 text) | prepared (a directory of python -m
    # moe_train.data prepare)
    source: str = "synthetic"
    # file for tokens/bytes, directory for prepared; relative paths resolve from the working directory
    path: str = ""
    token_dtype: str = "uint16"  # element type of a tokens file: uint16 | uint32
    seed: int = 0  # seed of the batch order (and of the synthetic generator)
    # prepared: documents packed into rows with segment ids; positions restart per document; attention never
    # crosses documents; the first token of a document is not predicted from the previous one (false: plain
    # rows that cross documents); other sources have no documents
    packing: bool = True


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr as a fraction of the peak
    warmup_steps: int = 10  # linear warmup from 0 to lr
    decay_steps: int = 0  # cosine decay length after warmup; 0 means until train.steps
    weight_decay: float = 0.1  # decoupled weight decay (not applied to norms and biases)
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop, batch and checkpointing."""

    steps: int = 30  # total optimizer steps of the run
    batch_size: int = 8  # global batch in sequences
    seq_len: int = 64  # tokens per sequence
    seed: int = 0  # parameter initialisation seed
    # save every N steps; 0: off (saves still happen at the end, on signals and by checkpoint_minutes)
    checkpoint_every: int = 0
    # also save once this much wall time passed since the last save (or the start), agreed by every process;
    # 0: off
    checkpoint_minutes: float = 30.0
    keep_checkpoints: int = 3  # keep the last N checkpoints
    async_checkpoint: bool = True  # write periodic checkpoints in the background
    log_every: int = 1  # print a progress line every N steps
    # held-out loss (eval_loss, eval_ppl) every N steps and at the last step: the val split of a prepared
    # data.path, or fixed held-out walks of the synthetic chain; 0: off
    eval_every: int = 0
    # held-out tokens per evaluation, rounded up to whole batches of batch_size sequences (a smaller val split
    # is used whole); 0: 64 sequences
    eval_tokens: int = 0
    telemetry_interval_s: float = 1.0  # seconds between GPU/host samples to <out>/telemetry/; 0 disables
    remat: str = "none"  # activation checkpointing per block: none | full | matmuls | moe
    # gradient accumulation: run each step's batch as N micro-batches (activations / N)
    micro_batches: int = 1
    # instead of micro_batches: sequences per device in one micro-batch (any job size); 0: off
    micro_batch_size: int = 0
    # tokens per device in one cross-entropy chunk (the [T, V] logits never exist whole); 0 picks from the
    # vocab
    loss_chunk: int = 0
    skip_selftest: bool = False  # do not check the chosen GPU kernels against a reference before training
    # start a new run from these weights (a converted checkpoint, a run or one step): fresh optimizer, step 0;
    # "": random init
    init_from: str = ""
    # start from init_from weights that have no manifest (saved before manifests existed, or damaged),
    # unverified, with a warning; false: refused (exit 2)
    init_from_trust_unverified: bool = False
    # a step whose loss, gradients or updated state is NaN/inf: stop (exit 3, nothing saved past the last good
    # checkpoint) | skip (drop that update, count it, go on)
    on_nonfinite: str = "stop"
    # with on_nonfinite=skip: stop (exit 3) after this many consecutive skipped steps
    max_nonfinite_skips: int = 10
    tensorboard: bool = True  # write OUT/tensorboard/ event files (every scalar of metrics.jsonl); false: off
    wandb_project: str = ""  # Weights & Biases project (offline unless WANDB_MODE says otherwise); "": off


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Devices, processes and how the mesh splits them."""

    devices: int = 0  # devices in the mesh; 0 means all; on CPU, that many fake host devices
    ep: int = 1  # expert-parallel size: experts are split over groups of this many devices
    dp: int = 0  # data-parallel (FSDP) size; 0 means devices // ep
    # FSDP gathers over data: micro_batch (per micro-batch, least memory) | step (once per step)
    weight_gather: str = "micro_batch"
    # force fast-link domains of this many devices (fake domains on CPU); 0: discover them
    domain_size: int = 0
    cluster: str = ""  # cluster preset name or site .toml: peak FLOP/s for MFU, topology checks; "": none
    allow_straddle: bool = False  # allow EP groups across NVLink domains when they cannot fit inside one
    # XLA:GPU runs each all-reduce over several NVLink domains as a reduce-scatter inside each,
    # an all-reduce across them and an all-gather inside (BlueConnect; docs/compile-results.md)
    split_all_reduce: bool = False
    coordinator: str = ""  # host:port of process 0; empty: from Slurm, else single-process
    num_processes: int = 0  # processes in the job; 0: from Slurm or the coordinator setup
    process_id: int = -1  # this process's rank; -1: from Slurm
    init_timeout_s: int = 300  # give up connecting to the coordinator after this many seconds
    heartbeat_timeout_s: int = 100  # a peer silent this long fails the job (every process exits)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embeddings (``moe_train.model.rope``); the base is ``model.rope_theta``."""

    layout: str = "half"  # pairs: half (rotate-half: Llama, Mixtral, Qwen3) | interleaved (DeepSeek-V3)
    scaling: str = "none"  # none | yarn (context extension, as long-context checkpoints use)
    factor: float = 1.0  # yarn: the context stretch, new context / original_max_positions
    original_max_positions: int = 4096  # yarn: the context the model was trained on
    beta_fast: float = 32.0  # yarn: frequencies turning more often over that context are kept
    beta_slow: float = 1.0  # yarn: frequencies turning less often are divided by factor
    mscale: float = 1.0  # yarn: magnitude correction of the rotated values (numerator)
    mscale_all_dim: float = 0.0  # yarn: its denominator, and the softmax-scale correction; 0: none


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision; master weights, optimizer state, router and losses stay fp32."""

    compute: str = "fp32"  # matmul precision: fp32 | bf16 | fp8 (bf16 with fp8 quantized matmuls)
    fp8_recipe: str = "delayed"  # fp8 scales: delayed (amax history) | current (this step) | mxfp8 (TE only)
    amax_history: int = 16  # steps of amax kept per quantized tensor (delayed scaling)
    margin: int = 0  # scale down by 2**margin below the fp8 maximum (headroom against overflow)
    fp8_backend: str = "auto"  # auto (TE where transformer_engine.jax imports on GPU, else xla) | xla | te


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """Keys that exist for benchmarks and studies only (``make bench``, ``make study``): they
    change what the MoE layer computes to measure it against a baseline. A real training run
    leaves them at their defaults; the trainer warns once when one is not."""

    # learned (top-k of the scores: training) | balanced (forced balance: token t takes experts (t*K + j) mod
    # E, so every expert gets the same load, as published forced-balance figures are measured; the weights are
    # still the router's scores, but the model does not learn to route)
    router: str = "learned"
    # > 0: the GShard-style token-dropping baseline: each expert takes at most factor x the balanced share of
    # the batch's assignments and drops the rest (dropped_tokens counts them); needs parallel.ep=1 and no fp8;
    # 0: dropless (training)
    capacity_factor: float = 0.0


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run."""

    model: ModelConfig = ModelConfig()  # transformer shape
    moe: MoEConfig = MoEConfig()  # MoE layer
    data: DataConfig = DataConfig()  # training data
    optim: OptimConfig = OptimConfig()  # optimizer and schedule
    train: TrainConfig = TrainConfig()  # loop and checkpoints
    parallel: ParallelConfig = ParallelConfig()  # devices
    precision: PrecisionConfig = PrecisionConfig()  # compute dtype and fp8 scaling
    rope: RopeConfig = RopeConfig()  # rotary position embeddings
    study: StudyConfig = StudyConfig()  # benchmark and study baselines only; defaults for training


# str fields with a fixed set of values (free text: data.path, parallel.cluster,
# parallel.coordinator, train.wandb_project, train.init_from)
CHOICES: dict[str, tuple[str, ...]] = {
    "moe.score_function": SCORE_FUNCTIONS,
    "moe.backend": BACKENDS,
    "moe.dispatcher": DISPATCHERS,
    "moe.dispatch_dtype": DISPATCH_DTYPES,
    "study.router": ROUTERS,
    "data.source": DATA_SOURCES,
    "data.token_dtype": TOKEN_DTYPES,
    "model.param_dtype": DTYPES,
    "model.attention": ATTENTION,
    "model.attention_kind": ATTENTION_KINDS,
    "train.remat": REMAT_POLICIES,
    "parallel.weight_gather": WEIGHT_GATHERS,
    "train.on_nonfinite": ON_NONFINITE,
    "precision.compute": COMPUTE,
    "precision.fp8_recipe": FP8_RECIPES,
    "precision.fp8_backend": FP8_BACKENDS,
    "rope.layout": ROPE_LAYOUTS,
    "rope.scaling": ROPE_SCALINGS,
}


def study_changes(cfg: Config) -> list[str]:
    """``section.key=value`` of every ``[study]`` key not at its default (empty for a real
    training run)."""
    default = StudyConfig()
    return [
        f"study.{f.name}={getattr(cfg.study, f.name)}"
        for f in dataclasses.fields(StudyConfig)
        if getattr(cfg.study, f.name) != getattr(default, f.name)
    ]


def compute_dtype(p: PrecisionConfig) -> str:
    """dtype name of activations and weight copies: fp8 computes in bf16 around fp8 matmuls."""
    return "float32" if p.compute == "fp32" else "bfloat16"


def head_dim(m: ModelConfig) -> int:
    """GQA's per-head width (``model.head_dim``, or hidden // num_heads)."""
    return m.head_dim or m.hidden // m.num_heads


def moe_layer_count(m: ModelConfig) -> int:
    """MoE blocks a token passes through in training: the main model's (num_layers -
    first_dense_layers) plus each MTP module's block when the model has MoE layers."""
    main = m.num_layers - m.first_dense_layers
    return main + m.mtp_depth if main else 0


def attention_dims(m: ModelConfig) -> tuple[int, int, int]:
    """(query/key head dim, value head dim, key/value heads) of ``model.attention_kind``:
    GQA (head_dim, head_dim, num_kv_heads); MLA (nope + rope, v_head_dim, num_heads: each
    head has its own keys and values, up-projected from the latent)."""
    if m.attention_kind == "mla":
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.num_heads
    return head_dim(m), head_dim(m), m.num_kv_heads
