"""Run configuration: frozen dataclasses, TOML presets, dotted ``--set`` overrides.

A run's config is built in three layers: the dataclass defaults below, a preset file from
``moe_train/presets/<name>.toml``, then ``--set section.key=value`` overrides. Unknown presets,
sections and keys are rejected with the list of valid choices; ``validate`` checks the
cross-field rules before anything is compiled. The resolved config is written to
``<out>/config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any, get_type_hints

PRESET_DIR = Path(__file__).parent / "presets"

SCORE_FUNCTIONS = ("softmax", "sigmoid")
BACKENDS = ("auto", "tiled", "ragged_dot", "mgpu", "te")
DISPATCHERS = ("auto", "allgather", "a2a", "hierarchical")
DATA_SOURCES = ("synthetic", "tokens", "bytes")
TOKEN_DTYPES = ("uint16", "uint32")
DTYPES = ("float32", "bfloat16")
COMPUTE = ("fp32", "bf16", "fp8")  # precision.compute
FP8_RECIPES = ("delayed", "current", "mxfp8")  # mxfp8: Transformer Engine on Blackwell only
FP8_BACKENDS = ("auto", "xla", "te")  # precision.fp8_backend
# Keys that moved to another section: --set or a preset naming the old one is told where.
MOVED = {"model.dtype": ("precision.compute", COMPUTE)}
REMAT_POLICIES = ("none", "full", "matmuls", "moe")  # moe_train.remat documents each
ATTENTION = ("auto", "xla", "cudnn", "chunked", "te")  # model.attention (moe_train.attention)


class ConfigError(ValueError):
    """A user-facing configuration problem: printed as one line, exit code 2."""


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
    first_dense_layers: int = 0  # the first N blocks use a dense SwiGLU MLP instead of MoE
    dense_ffn: int = 256  # hidden width of the dense SwiGLU MLP in those blocks
    param_dtype: str = "float32"  # master weight dtype (compute precision: [precision])
    attention: str = "auto"  # attention kernel: auto | xla (full scores) | cudnn | chunked (flash-style) | te
    attention_block: int = 0  # query/key block rows of the chunked attention; 0 picks per length
    scan_layers: bool = True  # run repeated blocks under a scan (one compiled body); false: a Python loop


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
    backend: str = "auto"  # grouped GEMM: auto | tiled | ragged_dot | mgpu | te
    tile_rows: int = 0  # row tile of the tiled backend; 0 picks per platform
    aux_loss_coef: float = 0.01  # switch-style load-balance loss over the global batch; 0 disables
    seq_aux_loss_coef: float = 0.0  # per-sequence load-balance loss (DeepSeek-V3); 0 disables
    z_loss_coef: float = 0.001  # router z-loss (mean squared logsumexp of logits); 0 disables
    bias_update_rate: float = 0.0  # aux-loss-free balancing: bias += rate*sign(mean-load); 0 off
    dispatcher: str = "auto"  # expert-parallel token exchange: auto | allgather | a2a | hierarchical
    chunks: int = 1  # split each rank's tokens into N chunks to overlap dispatch with GEMMs
    capacity_buckets: str = "1.0,1.25,1.5,2.0,3.0,4.0"  # exchange buffers, x balanced load; then worst
    bucket_step_down_after: int = 20  # steps of lower load before using the next smaller bucket


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the training tokens come from."""

    source: str = "synthetic"  # synthetic | tokens (pre-tokenised file) | bytes (UTF-8 text)
    path: str = ""  # file for tokens/bytes; relative paths resolve from the working directory
    token_dtype: str = "uint16"  # element type of a tokens file: uint16 | uint32
    seed: int = 0  # seed of the batch order (and of the synthetic generator)


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
    checkpoint_every: int = 0  # save every N steps; 0 saves only at the end and on signals
    keep_checkpoints: int = 3  # keep the last N checkpoints
    async_checkpoint: bool = True  # write periodic checkpoints in the background
    log_every: int = 1  # print a progress line every N steps
    telemetry_interval_s: float = 1.0  # seconds between GPU/host samples to <out>/telemetry/; 0 disables
    remat: str = "none"  # activation checkpointing per block: none | full | matmuls | moe
    micro_batches: int = 1  # gradient accumulation: run each step's batch as N micro-batches (activations / N)
    micro_batch_size: int = 0  # instead of micro_batches: sequences per device in one micro-batch (any job size); 0: off
    loss_chunk: int = 0  # tokens per device in one cross-entropy chunk (the [T, V] logits never exist whole); 0 picks from the vocab
    skip_selftest: bool = False  # do not check the chosen GPU kernels against a reference before training


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Devices, processes and how the mesh splits them."""

    devices: int = 0  # devices in the mesh; 0 means all; on CPU, that many fake host devices
    ep: int = 1  # expert-parallel size: experts are split over groups of this many devices
    dp: int = 0  # data-parallel (FSDP) size; 0 means devices // ep
    domain_size: int = 0  # force fast-link domains of this many devices (fake domains on CPU); 0: discover them
    cluster: str = ""  # cluster preset name or site .toml: peak FLOP/s for MFU, topology checks; "": none
    allow_straddle: bool = False  # allow EP groups across NVLink domains when they cannot fit inside one
    coordinator: str = ""  # host:port of process 0; empty: from Slurm, else single-process
    num_processes: int = 0  # processes in the job; 0: from Slurm or the coordinator setup
    process_id: int = -1  # this process's rank; -1: from Slurm
    init_timeout_s: int = 300  # give up connecting to the coordinator after this many seconds
    heartbeat_timeout_s: int = 100  # a peer silent this long fails the job (every process exits)


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision; master weights, optimizer state, router and losses stay fp32."""

    compute: str = "fp32"  # matmul precision: fp32 | bf16 | fp8 (bf16 with fp8 quantized matmuls)
    fp8_recipe: str = "delayed"  # fp8 scales: delayed (amax history) | current (this step) | mxfp8 (TE only)
    amax_history: int = 16  # steps of amax kept per quantized tensor (delayed scaling)
    margin: int = 0  # scale down by 2**margin below the fp8 maximum (headroom against overflow)
    fp8_backend: str = "auto"  # auto (TE where transformer_engine.jax imports on GPU, else xla) | xla | te


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


def section_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config))


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _parse_value(text: str, typ: type, key: str) -> Any:
    if typ is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {text!r}")
    try:
        return typ(text)
    except ValueError:
        raise ConfigError(f"{key}: expected {typ.__name__}, got {text!r}") from None


def _check_type(value: Any, typ: type, key: str) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}")
    return value


def _section_update(section: Any, name: str, values: dict[str, Any], parse: bool) -> Any:
    hints = get_type_hints(type(section))
    valid = [f.name for f in dataclasses.fields(section)]
    changes = {}
    for key, value in values.items():
        if f"{name}.{key}" in MOVED:
            new, choices = MOVED[f"{name}.{key}"]
            raise ConfigError(f"{name}.{key} moved to {new}; set {new}=<{' | '.join(choices)}> "
                              f"instead (e.g. {new}={choices[1]})")
        if key not in valid:
            raise ConfigError(f"unknown key {name}.{key}; valid keys in [{name}]: {', '.join(valid)}")
        typ = hints[key]
        dotted = f"{name}.{key}"
        changes[key] = _parse_value(value, typ, dotted) if parse else _check_type(value, typ, dotted)
    return dataclasses.replace(section, **changes)


def apply_tables(cfg: Config, tables: dict[str, Any], parse: bool = False) -> Config:
    """Overlay ``{section: {key: value}}`` onto ``cfg``; unknown names raise ConfigError."""
    changes = {}
    for name, values in tables.items():
        if name not in section_names():
            raise ConfigError(f"unknown section {name!r}; valid sections: {', '.join(section_names())}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of keys")
        changes[name] = _section_update(getattr(cfg, name), name, values, parse)
    return dataclasses.replace(cfg, **changes)


def load_preset(name: str) -> Config:
    path = PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; valid presets: {', '.join(list_presets())}")
    with path.open("rb") as f:
        tables = tomllib.load(f)
    return apply_tables(Config(), tables)


def parse_overrides(items: list[str]) -> dict[str, dict[str, str]]:
    """``["moe.top_k=4", ...]`` -> ``{"moe": {"top_k": "4"}}``."""
    tables: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, field = key.strip().partition(".")
        if not sep or not dot or not field:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        tables.setdefault(section, {})[field] = value
    return tables


def build(preset: str, overrides: list[str] = (), **sections: dict[str, Any]) -> Config:
    """Preset + typed section overrides (from code) + textual ``--set`` overrides, validated."""
    cfg = load_preset(preset)
    if sections:
        cfg = apply_tables(cfg, sections)
    cfg = apply_tables(cfg, parse_overrides(list(overrides)), parse=True)
    validate(cfg)
    return cfg


def _choice(value: str, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(choices)}")


def _positive(cfg: Config, keys: list[str]) -> None:
    for key in keys:
        section, field = key.split(".")
        if getattr(getattr(cfg, section), field) <= 0:
            raise ConfigError(f"{key} must be positive, got {getattr(getattr(cfg, section), field)}")


def validate(cfg: Config) -> None:
    """Cross-field checks that must hold before compiling."""
    m, e = cfg.model, cfg.moe
    _positive(cfg, ["model.vocab_size", "model.hidden", "model.num_layers", "model.num_heads",
                    "model.num_kv_heads", "model.dense_ffn", "moe.num_experts", "moe.top_k",
                    "moe.expert_ffn", "train.steps", "train.batch_size", "train.seq_len",
                    "train.keep_checkpoints", "train.log_every", "optim.lr"])
    _choice(e.score_function, SCORE_FUNCTIONS, "moe.score_function")
    _choice(e.backend, BACKENDS, "moe.backend")
    _choice(e.dispatcher, DISPATCHERS, "moe.dispatcher")
    _choice(cfg.data.source, DATA_SOURCES, "data.source")
    _choice(cfg.data.token_dtype, TOKEN_DTYPES, "data.token_dtype")
    _choice(m.param_dtype, DTYPES, "model.param_dtype")
    _choice(cfg.train.remat, REMAT_POLICIES, "train.remat")
    _choice(m.attention, ATTENTION, "model.attention")
    if m.attention_block < 0 or cfg.train.loss_chunk < 0:
        raise ConfigError("model.attention_block and train.loss_chunk must be >= 0 (0 picks)")
    _validate_precision(cfg.precision)
    t = cfg.train
    if t.micro_batches < 1 or t.batch_size % t.micro_batches:
        divisors = [d for d in range(1, t.batch_size + 1) if t.batch_size % d == 0]
        raise ConfigError(f"train.micro_batches={t.micro_batches} must divide "
                          f"train.batch_size={t.batch_size}; choose one of {divisors}")
    if t.micro_batch_size < 0 or (t.micro_batch_size and t.micro_batches != 1):
        raise ConfigError(f"train.micro_batch_size={t.micro_batch_size} with train.micro_batches="
                          f"{t.micro_batches}: set one of them (micro_batch_size >= 0)")
    if e.top_k > e.num_experts:
        raise ConfigError(f"moe.top_k={e.top_k} is larger than moe.num_experts={e.num_experts}; "
                          f"choose top_k in 1..{e.num_experts}")
    if m.head_dim == 0 and m.hidden % m.num_heads:
        divisors = [h for h in range(1, m.hidden + 1) if m.hidden % h == 0 and h <= 256]
        raise ConfigError(f"model.num_heads={m.num_heads} does not divide model.hidden={m.hidden}; "
                          f"valid num_heads: {', '.join(map(str, divisors))} (or set model.head_dim)")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_kv_heads={m.num_kv_heads} does not divide "
                          f"model.num_heads={m.num_heads}")
    if m.first_dense_layers > m.num_layers:
        raise ConfigError(f"model.first_dense_layers={m.first_dense_layers} exceeds "
                          f"model.num_layers={m.num_layers}")
    _validate_groups(e)
    _validate_cluster(cfg.parallel)
    if cfg.data.source in ("tokens", "bytes") and not cfg.data.path:
        raise ConfigError(f"data.source={cfg.data.source} needs data.path=<file>")
    if cfg.data.source == "bytes" and m.vocab_size < 256:
        raise ConfigError(f"data.source=bytes needs model.vocab_size >= 256, got {m.vocab_size}")


def _validate_precision(p: PrecisionConfig) -> None:
    _choice(p.compute, COMPUTE, "precision.compute")
    _choice(p.fp8_recipe, FP8_RECIPES, "precision.fp8_recipe")
    _choice(p.fp8_backend, FP8_BACKENDS, "precision.fp8_backend")
    if p.amax_history < 1:
        raise ConfigError(f"precision.amax_history must be >= 1, got {p.amax_history}")
    if p.margin < 0:
        raise ConfigError(f"precision.margin must be >= 0, got {p.margin}")
    if p.fp8_recipe == "mxfp8" and p.fp8_backend == "xla":
        raise ConfigError("precision.fp8_recipe=mxfp8 needs Transformer Engine (MXFP8 block "
                          "scaling on Blackwell); with precision.fp8_backend=xla choose one of: "
                          "delayed, current")


def _validate_cluster(p: ParallelConfig) -> None:
    if not p.cluster:
        return
    from topology.presets import TopologyError, load  # pure TOML reading, no jax

    try:
        load(p.cluster)
    except TopologyError as err:
        raise ConfigError(f"parallel.cluster: {err}") from None


def _validate_groups(e: MoEConfig) -> None:
    if e.num_groups == 0:
        return
    if e.num_experts % e.num_groups:
        raise ConfigError(f"moe.num_groups={e.num_groups} does not divide "
                          f"moe.num_experts={e.num_experts}")
    if not 1 <= e.group_top_k <= e.num_groups:
        raise ConfigError(f"moe.group_top_k={e.group_top_k} must be in 1..{e.num_groups}")
    if e.top_k > e.group_top_k * (e.num_experts // e.num_groups):
        raise ConfigError(f"moe.top_k={e.top_k} exceeds the experts in {e.group_top_k} groups")


def for_devices(cfg: Config, devices: int) -> Config:
    """``cfg`` on a job of ``devices`` (batch-sharded) devices: ``train.micro_batch_size``
    turned into the ``train.micro_batches`` it means there. ``batch_size`` must already
    divide over the devices."""
    t = cfg.train
    if not t.micro_batch_size:
        return cfg
    per = t.batch_size // devices
    if per % t.micro_batch_size:
        ok = [k for k in range(1, per + 1) if per % k == 0]
        raise ConfigError(f"train.micro_batch_size={t.micro_batch_size} does not divide the {per} "
                          f"sequences per device (train.batch_size={t.batch_size} over {devices} "
                          f"devices); choose one of {ok}")
    train = dataclasses.replace(t, micro_batches=per // t.micro_batch_size, micro_batch_size=0)
    return dataclasses.replace(cfg, train=train)


def compute_dtype(p: PrecisionConfig) -> str:
    """dtype name of activations and weight copies: fp8 computes in bf16 around fp8 matmuls."""
    return "float32" if p.compute == "fp32" else "bfloat16"


def head_dim(m: ModelConfig) -> int:
    return m.head_dim or m.hidden // m.num_heads


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(d: dict[str, Any]) -> Config:
    return apply_tables(Config(), d)


def save_json(cfg: Config, path: Path) -> None:
    path.write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")
