"""The checks behind ``moe_train.config.validate``: a range for every numeric field, size limits,
the capacity buckets and the cross-field rules, all before anything compiles.

``RANGES`` maps every int and float field (``section.key``) to its valid range; one loop checks
them all (floats must also be finite) and tests/test_config.py fails when a numeric field has
no entry. Then ``SIZES`` bounds the products that become one array or index space (tokens per
step, one weight matrix, one device's expert weights per layer) by int32 indexing, so absurd
sizes stop here as one line instead of as a traceback in XLA. Every failure is a
``ConfigError`` naming the key, the value and what is valid. This module reads the config only
through attributes, so it imports nothing from ``moe_train.config`` (which re-exports
``ConfigError`` and ``some_divisors`` from here, and parses tuple fields with ``parse_floats``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

INT32_MAX = 2**31 - 1  # largest count XLA indexes with int32
MAX_BUCKETS = 16  # capacity buckets (each compiles its own step)
_DIVISOR_SCAN = 10**6  # some_divisors tries candidates below this only (bounded time)


class ConfigError(ValueError):
    """A user-facing configuration problem: printed as one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class Range:
    """``lo <= value <= hi`` (``<`` where open); floats must be finite too."""

    kind: type  # int or float
    lo: float
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: Any) -> bool:
        if self.kind is float and not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def text(self) -> str:
        if self.kind is int:
            return f"an integer in {self.lo}..{self.hi}"
        if self.hi == math.inf:
            return f"a finite number {'>' if self.lo_open else '>='} {self.lo:g}"
        return (
            f"a finite number in {'(' if self.lo_open else '['}{self.lo:g}, "
            f"{self.hi:g}{')' if self.hi_open else ']'}"
        )


def _int(lo: int, hi: int = INT32_MAX) -> Range:
    return Range(int, lo, hi)


def _nonneg() -> Range:
    return Range(float, 0.0)


def _positive() -> Range:
    return Range(float, 0.0, lo_open=True)


RANGES: dict[str, Range] = {
    "model.vocab_size": _int(1),
    "model.hidden": _int(1),
    "model.num_layers": _int(1, 2**16),
    "model.num_heads": _int(1),
    "model.num_kv_heads": _int(1),
    "model.head_dim": _int(0),
    "model.rope_theta": _positive(),
    "model.norm_eps": _positive(),
    "model.first_dense_layers": _int(0, 2**16),
    "model.dense_ffn": _int(1),
    "model.attention_block": _int(0),
    "model.q_lora_rank": _int(0),
    "model.kv_lora_rank": _int(1),
    "model.qk_nope_head_dim": _int(0),
    "model.qk_rope_head_dim": _int(2),
    "model.v_head_dim": _int(1),
    "model.mtp_depth": _int(0, 16),
    "model.mtp_loss_weight": _nonneg(),
    "model.mtp_loss_weight_late": _nonneg(),
    "model.mtp_late_step": _int(0),
    "model.tied_logit_scale": _nonneg(),
    "moe.num_experts": _int(1),
    "moe.top_k": _int(1),
    "moe.expert_ffn": _int(1),
    "moe.num_shared_experts": _int(0),
    "moe.shared_ffn": _int(0),
    "moe.num_groups": _int(0),
    "moe.group_top_k": _int(0),
    "moe.routed_scaling": _positive(),
    "moe.tile_rows": _int(0),
    "moe.aux_loss_coef": _nonneg(),
    "moe.seq_aux_loss_coef": _nonneg(),
    "moe.z_loss_coef": _nonneg(),
    "moe.bias_update_rate": _nonneg(),
    "moe.overlap_chunks": _int(1),
    "moe.bucket_step_down_after": _int(1),
    "data.seed": _int(0),
    "optim.lr": _positive(),
    "optim.min_lr_ratio": Range(float, 0.0, 1.0),
    "optim.warmup_steps": _int(0),
    "optim.decay_steps": _int(0),
    "optim.weight_decay": _nonneg(),
    "optim.b1": Range(float, 0.0, 1.0, hi_open=True),
    "optim.b2": Range(float, 0.0, 1.0, hi_open=True),
    "optim.eps": _positive(),
    "optim.grad_clip": _nonneg(),
    "train.steps": _int(1),
    "train.batch_size": _int(1),
    "train.seq_len": _int(1),
    "train.seed": _int(0),
    "train.checkpoint_every": _int(0),
    "train.keep_checkpoints": _int(1),
    "train.checkpoint_minutes": _nonneg(),
    "train.log_every": _int(1),
    "train.telemetry_interval_s": _nonneg(),
    "train.eval_every": _int(0),
    "train.eval_tokens": _int(0),
    "train.micro_batches": _int(1),
    "train.micro_batch_size": _int(0),
    "train.loss_chunk": _int(0),
    "train.max_nonfinite_skips": _int(1),
    "parallel.devices": _int(0),
    "parallel.ep": _int(1),
    "parallel.dp": _int(0),
    "parallel.domain_size": _int(0),
    "parallel.num_processes": _int(0),
    "parallel.process_id": _int(-1),
    "parallel.init_timeout_s": _int(1),
    "parallel.heartbeat_timeout_s": _int(1),
    # delayed scaling keeps this many amaxes per tensor (Transformer Engine's default is 1024);
    # beyond a margin of 16 the largest value already falls into e4m3's subnormals
    "precision.amax_history": _int(1, 2**16),
    "precision.margin": _int(0, 16),
    "rope.factor": Range(float, 1.0),
    "rope.original_max_positions": _int(1),
    "rope.beta_fast": _positive(),
    "rope.beta_slow": _positive(),
    "rope.mscale": _nonneg(),
    "rope.mscale_all_dim": _nonneg(),
    "study.capacity_factor": _nonneg(),
}


def _get(cfg: Any, key: str) -> Any:
    section, field = key.split(".")
    return getattr(getattr(cfg, section), field)


def check_ranges(cfg: Any) -> None:
    """Every ``RANGES`` field inside its range (floats finite)."""
    for key, valid in RANGES.items():
        value = _get(cfg, key)
        if value not in valid:
            raise ConfigError(f"{key}={value!r} is not valid; expected {valid.text()}")


def _shared_ffn(e: Any) -> int:
    return e.shared_ffn or e.expert_ffn


# (what it is, formula in config keys, elements[, hint]); each must fit int32 indexing
def _sizes(cfg: Any) -> list[tuple]:
    m, e, t = cfg.model, cfg.moe, cfg.train
    hd = (
        m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.attention_kind == "mla"
        else m.head_dim or max(1, m.hidden // m.num_heads)
    )
    tokens = t.batch_size * t.seq_len
    return [
        ("tokens per step", "train.batch_size*train.seq_len", tokens),
        ("routed token rows per step", "train.batch_size*train.seq_len*moe.top_k", tokens * e.top_k),
        ("the embedding", "model.vocab_size*model.hidden", m.vocab_size * m.hidden),
        ("the query projection", "model.hidden*model.num_heads*head_dim", m.hidden * m.num_heads * hd),
        ("the dense MLP weight", "model.hidden*model.dense_ffn", m.hidden * m.dense_ffn),
        (
            "the shared experts' weight",
            "model.hidden*moe.num_shared_experts*moe.shared_ffn",
            m.hidden * e.num_shared_experts * _shared_ffn(e),
        ),
        (
            "one device's expert weight per layer",
            "ceil(moe.num_experts/parallel.ep)*moe.expert_ffn*model.hidden",
            -(-e.num_experts // cfg.parallel.ep) * e.expert_ffn * m.hidden,
            "raise parallel.ep or ",
        ),
    ]


def check_sizes(cfg: Any) -> None:
    """No array or token count of the run beyond int32 indexing (after ``check_ranges``)."""
    for what, formula, n, *hint in _sizes(cfg):
        if n > INT32_MAX:
            raise ConfigError(
                f"{formula}={n} ({what}) is too large: at most {INT32_MAX} "
                f"(int32 indexing); {''.join(hint)}shrink one of them"
            )


BUCKETS_EXAMPLE = "1.0,1.25,1.5,2.0"  # capacity buckets as messages show them


def parse_floats(text: str, key: str) -> tuple[float, ...]:
    """A tuple-of-numbers field's text ("2.0,1.0,1.5") as sorted floats (empty items are
    skipped); ConfigError naming ``key`` if an item is not a number."""
    try:
        return tuple(sorted(float(f) for f in text.split(",") if f.strip()))
    except ValueError:
        raise ConfigError(
            f"{key}={text!r}: expected comma-separated numbers such as {BUCKETS_EXAMPLE}"
        ) from None


def check_buckets(factors: tuple[float, ...]) -> None:
    """``moe.capacity_buckets``: 1..MAX_BUCKETS finite, positive factors."""
    key = f"moe.capacity_buckets={','.join(f'{f:g}' for f in factors) or repr('')}"
    if not factors:
        raise ConfigError(f"{key}: expected at least one factor, e.g. {BUCKETS_EXAMPLE}")
    if not all(math.isfinite(f) and f > 0 for f in factors):
        raise ConfigError(f"{key}: factors must be finite and positive, e.g. {BUCKETS_EXAMPLE}")
    if len(factors) > MAX_BUCKETS:
        raise ConfigError(
            f"{key}: {len(factors)} factors; at most {MAX_BUCKETS} (each compiles its own step)"
        )


def some_divisors(n: int, limit: int = 12) -> list[int]:
    """Up to ``limit`` divisors of ``n``, smallest first, for messages. Bounded time: at most
    ``min(sqrt(n), 10**6)`` trials, fewer once ``limit`` are found (past 10**12 the list may
    skip divisors between 10**6 and n/10**6)."""
    if n < 1 or limit < 1:
        return []
    small, large = [], []
    i = 1
    while i * i <= n and i < _DIVISOR_SCAN and len(small) < limit:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return (small + large[::-1])[:limit]


def divisors_text(n: int, limit: int = 12, at_most: int | None = None) -> str:
    """Up to ``limit`` divisors of ``n`` (those <= ``at_most``) as "1, 2, 4, ..." for messages."""
    ds = [d for d in some_divisors(n, limit + 1) if at_most is None or d <= at_most]
    return first_few(ds, limit, more=", ...")


def first_few(items: list, limit: int, sep: str = ", ", more: str = " and {} more") -> str:
    """The first ``limit`` of ``items`` joined by ``sep`` for messages, then ``more`` formatted
    with how many were left out (nothing when none were)."""
    left = len(items) - limit
    return sep.join(map(str, items[:limit])) + (more.format(left) if left > 0 else "")


MEGABLOX_ROWS = 16  # megablox's row tiles are multiples of this (bf16 packs 16 rows in a TPU vreg)


def check_megablox_rows(tile_rows: int, who: str, other: str = "") -> None:
    """ConfigError where ``moe.tile_rows`` is not a multiple of megablox's row packing; ``who``
    names what runs megablox, ``other`` a further way out (said after the fitting value)."""
    if not tile_rows % MEGABLOX_ROWS:
        return
    fit = max(MEGABLOX_ROWS, tile_rows // MEGABLOX_ROWS * MEGABLOX_ROWS)
    why = f"{who} pads groups to a multiple of {MEGABLOX_ROWS} rows"
    raise ConfigError(f"moe.tile_rows={tile_rows}: {why}; choose e.g. {fit} or 0{other}")


def check_rules(cfg: Any) -> None:
    """Cross-field rules (after ranges and sizes)."""
    m, e, t, p = cfg.model, cfg.moe, cfg.train, cfg.precision
    check_buckets(e.capacity_buckets)
    if t.batch_size % t.micro_batches:
        raise ConfigError(
            f"train.micro_batches={t.micro_batches} must divide "
            f"train.batch_size={t.batch_size}; choose one of "
            f"[{divisors_text(t.batch_size)}]"
        )
    if t.micro_batch_size and t.micro_batches != 1:
        raise ConfigError(
            f"train.micro_batch_size={t.micro_batch_size} with train.micro_batches="
            f"{t.micro_batches}: set one of them (micro_batch_size >= 0)"
        )
    if cfg.rope.scaling == "yarn":
        _check_pair(
            cfg,
            "rope.beta_fast",
            "rope.beta_slow",
            operator.le,
            "must be larger than",
            " (the frequencies between them are blended)",
        )
    _check_pair(
        cfg,
        "moe.top_k",
        "moe.num_experts",
        operator.gt,
        "is larger than",
        f"; choose top_k in 1..{e.num_experts}",
    )
    if m.attention_kind == "mla":
        _check_mla(m)
    elif m.head_dim == 0 and m.hidden % m.num_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} does not divide model.hidden={m.hidden}; "
            f"valid num_heads: {divisors_text(m.hidden, at_most=256)} "
            f"(or set model.head_dim)"
        )
    if m.attention_kind == "gqa":
        _check_pair(cfg, "model.num_kv_heads", "model.num_heads", _not_dividing, "does not divide")
    _check_pair(cfg, "model.first_dense_layers", "model.num_layers", operator.gt, "exceeds")
    _check_groups(cfg)
    _check_capacity(cfg)
    if e.backend == "megablox":
        check_megablox_rows(e.tile_rows, "megablox")
    if p.fp8_recipe == "mxfp8" and p.fp8_backend == "xla":
        raise ConfigError(
            "precision.fp8_recipe=mxfp8 needs Transformer Engine (MXFP8 block "
            "scaling on Blackwell); with precision.fp8_backend=xla choose one of: "
            "delayed, current"
        )
    _check_data(cfg)
    if cfg.data.source == "bytes" and m.vocab_size < 256:
        raise ConfigError(f"data.source=bytes needs model.vocab_size >= 256, got {m.vocab_size}")


def _check_data(cfg: Any) -> None:
    """Data source, its path, packing and held-out evaluation."""
    d, m, t = cfg.data, cfg.model, cfg.train
    if d.source in ("tokens", "bytes") and not d.path:
        raise ConfigError(f"data.source={d.source} needs data.path=<file>")
    if d.source == "prepared" and not d.path:
        raise ConfigError(
            "data.source=prepared needs data.path=<directory written by python -m moe_train.data prepare>"
        )
    if t.eval_every and d.source in ("tokens", "bytes"):
        raise ConfigError(
            f"train.eval_every={t.eval_every} needs held-out data, which "
            f"data.source={d.source} has none of (every window may be trained on); "
            f"use data.source=prepared with a val split, or set train.eval_every=0"
        )
    if d.source == "prepared" and d.packing and m.attention == "te":
        raise ConfigError(
            "model.attention=te does not take segment ids (packed documents, "
            "data.packing=true); choose one of: auto, chunked, xla, cudnn, or "
            "set data.packing=false"
        )


def _check_mla(m: Any) -> None:
    if m.qk_rope_head_dim % 2:
        raise ConfigError(
            f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (RoPE rotates pairs of dims), e.g. 64"
        )


def _check_capacity(cfg: Any) -> None:
    """The token-dropping baseline (study.capacity_factor) runs on the plain local path."""
    f = cfg.study.capacity_factor
    if not f:
        return
    if cfg.parallel.ep != 1:
        why = "runs without expert parallelism; set parallel.ep=1 or study.capacity_factor=0"
    elif cfg.precision.compute == "fp8":
        why = "has no fp8 path; choose precision.compute fp32 or bf16"
    else:
        return
    raise ConfigError(f"study.capacity_factor={f} (the token-dropping baseline) {why}")


def _not_dividing(a: int, b: int) -> bool:
    return b % a != 0


def _check_pair(
    cfg: Any, key: str, other: str, bad: Callable[[Any, Any], bool], verb: str, hint: str = ""
) -> None:
    """ConfigError "``key``=a ``verb`` ``other``=b``hint``" when ``bad(a, b)`` (two fields)."""
    a, b = _get(cfg, key), _get(cfg, other)
    if bad(a, b):
        raise ConfigError(f"{key}={a} {verb} {other}={b}{hint}")


def _check_groups(cfg: Any) -> None:
    e = cfg.moe
    if e.num_groups == 0:
        return
    _check_pair(cfg, "moe.num_groups", "moe.num_experts", _not_dividing, "does not divide")
    if not 1 <= e.group_top_k <= e.num_groups:
        raise ConfigError(f"moe.group_top_k={e.group_top_k} must be in 1..{e.num_groups}")
    if e.top_k > e.group_top_k * (e.num_experts // e.num_groups):
        raise ConfigError(f"moe.top_k={e.top_k} exceeds the experts in {e.group_top_k} groups")


def check(cfg: Any) -> None:
    """All of the above, in order: ranges, sizes, rules."""
    check_ranges(cfg)
    check_sizes(cfg)
    check_rules(cfg)


def micro_batch_size_error(cfg: Any, per: int, devices: int) -> ConfigError:
    """``train.micro_batch_size`` not dividing the sequences per device (config.for_devices)."""
    t = cfg.train
    return ConfigError(
        f"train.micro_batch_size={t.micro_batch_size} does not divide the {per} "
        f"sequences per device (train.batch_size={t.batch_size} over {devices} "
        f"devices); choose one of [{divisors_text(per)}]"
    )
