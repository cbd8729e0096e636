"""Which kernels a run may use here, fastest first, and the small problem each is checked on.

Orders, as measured: grouped GEMM on a GPU with bf16/fp16 te, mgpu, tiled, ragged_dot; on a
GPU with fp32 tiled, ragged_dot; on CPU tiled, ragged_dot (tiled runs 18x the tokens/s of
ragged_dot in ``make bench``). ragged_dot comes last everywhere: XLA runs it as a dense dot
over every expert on CPU and on GPU (an H200's gpu-check: DeepSeek-V3's experts asked for a
112 GiB masked operand), E times the FLOPs. Attention: what
``moe_train.model.attention.resolve`` picks for ``auto`` first (cuDNN on GPUs that take it, chunked
above the measured crossover length), then the other implementations that can run here.
fp8: Transformer Engine where it can run the recipe, then XLA's q/dq.

The self-test problem keeps what decides whether a kernel works (dtype, head dims, the
alignment of the expert shapes, the tile rows) and shrinks what only costs time: at most
``MAX_WIDTH`` hidden and ffn columns, ``MAX_EXPERTS`` experts, a few hundred rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from moe_train.base.platform import Platform
from moe_train.config import Config, ConfigError, attention_dims, compute_dtype
from moe_train.config.checks import check_megablox_rows
from moe_train.model import attention, precision
from moe_train.moe import gemm
from moe_train.selftest import checks

MAX_WIDTH = 256  # hidden / expert ffn of the grouped-GEMM problem (multiple of 64: mgpu)
MAX_EXPERTS = 8
TOKENS = {"gpu": 256, "tpu": 256, "cpu": 64}  # tokens of the grouped-GEMM problem
SEQ = {"gpu": 256, "tpu": 256, "cpu": 64}  # sequence length of the attention problem
GEMM_ORDER = {
    "half": ("te", "mgpu", "tiled", "ragged_dot"),
    "fp32": ("tiled", "ragged_dot"),
    "cpu": ("tiled", "ragged_dot"),
    "tpu": ("megablox", "tiled", "ragged_dot"),
}
ATTENTION_ORDER = ("cudnn", "te", "splash", "chunked", "xla")

# (key, configured value, candidates fastest first, check(name, time_reps), time them?, why
# the first candidate leads)
Plan = tuple[str, str, list[str], Callable[[str, int], checks.Result], bool, str]


def configured(cfg: Config) -> dict[str, str]:
    """The configured value of every kernel key."""
    return {
        "moe.backend": cfg.moe.backend,
        "model.attention": cfg.model.attention,
        "precision.fp8_backend": cfg.precision.fp8_backend,
    }


def apply(cfg: Config, chosen: dict[str, str]) -> Config:
    """``cfg`` with the chosen kernels in place of the configured ones."""
    m, e, p = cfg.model, cfg.moe, cfg.precision
    m = dataclasses.replace(m, attention=chosen.get("model.attention", m.attention))
    e = dataclasses.replace(e, backend=chosen.get("moe.backend", e.backend))
    p = dataclasses.replace(p, fp8_backend=chosen.get("precision.fp8_backend", p.fp8_backend))
    return dataclasses.replace(cfg, model=m, moe=e, precision=p)


def _small(n: int, cap: int) -> int:
    return min(n, cap)


def gemm_candidates(cfg: Config, platform: Platform) -> list[str]:
    """Grouped-GEMM backends that can run the run's experts on ``platform``, fastest first."""
    dtype = compute_dtype(cfg.precision)
    e, H = cfg.moe, cfg.model.hidden
    if platform.name == "gpu":
        order = GEMM_ORDER["fp32" if dtype == "float32" else "half"]
    else:
        order = GEMM_ORDER["tpu" if platform.name == "tpu" else "cpu"]
    ok = [b for b in order if gemm._unavailable_reason(b, dtype, H, e.expert_ffn, platform) is None]
    if e.backend != "auto" and e.backend not in ok:
        reason = gemm._unavailable_reason(e.backend, dtype, H, e.expert_ffn, platform)
        raise ConfigError(
            f"moe.backend={e.backend} cannot run here: {reason}; choose one of: {', '.join(['auto', *ok])}"
        )
    if e.backend == "auto" and ok[:1] == ["megablox"]:
        # auto's choice here would fail on the first trace (an explicit megablox is refused by
        # the config's own checks, which do not know the platform)
        check_megablox_rows(
            e.tile_rows, "moe.backend=auto runs megablox here, which", ", or moe.backend=tiled"
        )
    return ok


def gemm_problem(cfg: Config, platform: Platform) -> checks.GemmProblem:
    e, experts = cfg.moe, _small(cfg.moe.num_experts, MAX_EXPERTS)
    return checks.GemmProblem(
        tokens=TOKENS.get(platform.name, TOKENS["cpu"]),
        hidden=_small(cfg.model.hidden, MAX_WIDTH),
        ffn=_small(e.expert_ffn, MAX_WIDTH),
        experts=experts,
        top_k=max(1, min(e.top_k, experts - 1)),
        dtype=compute_dtype(cfg.precision),
        routing="hot-empty",
        tile_rows=e.tile_rows,
    )


def attention_candidates(cfg: Config, platform: Platform, seq_len: int) -> tuple[list[str], str]:
    """Attention implementations that can run on ``platform``, ``auto``'s pick first, and why it leads."""
    m, dtype = cfg.model, compute_dtype(cfg.precision)
    d, j, _ = attention_dims(m)
    dims: dict[str, Any] = dict(platform=platform, dtype=dtype, head_dim=d, v_head_dim=j)
    first, why = attention.resolve(m.attention, seq_len=seq_len, **dims)  # ConfigError if it cannot
    ok = [n for n, reason in attention.available(**dims).items() if reason is None]
    rest = [n for n in ATTENTION_ORDER if n in ok and n != first]
    return [first, *rest], why


def attention_problem(cfg: Config, platform: Platform) -> checks.AttentionProblem:
    m = cfg.model
    d, j, kv_heads = attention_dims(m)  # MLA: a head's own keys and values (kv_heads = heads)
    ratio = m.num_heads // kv_heads
    kv = _small(kv_heads, 2)
    return checks.AttentionProblem(
        batch=1,
        seq_len=_small(cfg.train.seq_len, SEQ.get(platform.name, SEQ["cpu"])),
        heads=kv * _small(ratio, 4),
        kv_heads=kv,
        head_dim=d,
        v_head_dim=j,
        dtype=compute_dtype(cfg.precision),
        block=m.attention_block,
    )


def fp8_candidates(cfg: Config, platform: Platform) -> list[str]:
    """fp8 backends that can run the recipe on ``platform`` (ConfigError for an explicit one that cannot)."""
    p = cfg.precision
    precision.policy(p, platform)  # raises ConfigError: te / mxfp8 where TE cannot run
    te_reason = precision._te_reason(p, platform)
    return (["te"] if te_reason is None else []) + ([] if p.fp8_recipe == "mxfp8" else ["xla"])


def plans(cfg: Config, platform: Platform) -> Iterator[Plan]:
    """A ``Plan`` per kernel the run uses on ``platform`` (the checks run on this machine)."""
    gp = gemm_problem(cfg, platform)
    yield (
        "moe.backend",
        cfg.moe.backend,
        gemm_candidates(cfg, platform),
        lambda name, reps: checks.check_gemm(name, gp, time_reps=reps),
        platform.name == "gpu",
        "",
    )
    ap = attention_problem(cfg, platform)
    cands, why = attention_candidates(cfg, platform, cfg.train.seq_len)
    yield (
        "model.attention",
        cfg.model.attention,
        cands,
        lambda name, reps: checks.check_attention(name, ap, time_reps=reps),
        False,
        why,
    )
    if cfg.precision.compute == "fp8":
        p = cfg.precision
        yield (
            "precision.fp8_backend",
            p.fp8_backend,
            fp8_candidates(cfg, platform),
            lambda name, reps: checks.check_fp8(name, p.fp8_recipe, p.amax_history, p.margin, time_reps=reps),
            False,
            "",
        )
