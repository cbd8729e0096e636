"""Causal self-attention kernels (``model.attention``) and the choice between them.

Shape letters (``moe_train.base.notation``; shared by the modules of this package): B batch,
S sequence (queries and keys: self-attention, one length), N query heads, Y key/value heads,
G = N // Y query heads per key/value head, D query/key head dim, J value head dim (MLA: D 192,
J 128), P blocks of the chunked kernel, C rows of a query or key block (``block``).

Implementations (``attend(..., implementation=...)``):
  xla      full [S, S] scores through XLA (``moe_train.model.attention.xla``): the reference.
  cudnn    cuDNN flash attention via ``jax.nn.dot_product_attention(implementation="cudnn")``:
           NVIDIA GPUs, bf16/fp16, equal q/k and v head dims (``moe_train.model.attention.fused``).
  chunked  flash-style blocks with an online softmax and a recomputing custom VJP, plain JAX:
           memory linear in S on any platform (``moe_train.model.attention.chunked``).
  te       Transformer Engine's fused attention where ``transformer_engine.jax`` imports on a GPU.
  splash   JAX's Pallas TPU flash attention (splash attention) on a TPU
           (``moe_train.model.attention.splash``); ``auto``'s pick there.

``resolve`` turns ``model.attention`` (including ``auto``) into one of these plus a sentence
saying why; explicit choices that cannot run here raise ``ConfigError`` naming those that can.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from moe_train.base.platform import Platform, or_here
from moe_train.config import ATTENTION, ConfigError
from moe_train.model.attention.chunked import chunked_attention
from moe_train.model.attention.fused import (
    cudnn_attention,
    cudnn_unavailable,
    te_attention,
    te_unavailable,
)
from moe_train.model.attention.splash import splash_attention, splash_unavailable
from moe_train.model.attention.xla import xla_attention

IMPLEMENTATIONS = tuple(a for a in ATTENTION if a != "auto")  # xla, cudnn, chunked, te, splash
# auto: chunked from this length on (where cuDNN cannot run). fwd+bwd step time, chunked over
# xla, median of interleaved rounds on this 2-core CPU (python -m moe_train.bench --only
# attention: B=2, N=4, Y=2, D=32, fp32, default blocks; per-round min-max in brackets):
#   S=64 1.15 (0.79-1.30), 128 0.93 (0.63-1.49), 256 0.62 (0.34-0.63), 512 0.42,
#   1024 0.28, 2048 0.14, 4096 0.14.
# The measured crossover is 128, but within the noise there; 256 is the first clear win.
CHUNKED_MIN_SEQ = 256
MIN_BLOCK, MAX_BLOCK = 64, 256  # default_block's range (see there)


def default_block(seq_len: int) -> int:
    """The chunked kernel's block rows for ``seq_len``: one (8-rounded) block up to
    ``MIN_BLOCK`` rows, else the power of two nearest below S/4 within [MIN_BLOCK, MAX_BLOCK].

    On this CPU 64-256 row blocks beat bigger ones (the block's scores stay in cache) and at
    least ~4 blocks are needed to skip a useful share of the causal triangle; the cap keeps
    the block constant, hence memory linear in S, from S = 4 * MAX_BLOCK on.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if seq_len <= MIN_BLOCK:
        return -(-seq_len // 8) * 8
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << ((seq_len // 4).bit_length() - 1)))


def available(*, platform: Platform, dtype, head_dim: int, v_head_dim: int) -> dict[str, str | None]:
    """Implementation -> None if it can run on ``platform``, else the reason it cannot."""
    return {
        "xla": None,
        "cudnn": cudnn_unavailable(platform, dtype, head_dim, v_head_dim),
        "chunked": None,
        "te": te_unavailable(platform, dtype, head_dim, v_head_dim),
        "splash": splash_unavailable(platform, head_dim, v_head_dim),
    }


def resolve(
    name: str, *, platform: Platform, dtype, head_dim: int, v_head_dim: int, seq_len: int
) -> tuple[str, str]:
    """(concrete implementation, why) for ``model.attention=name`` on ``platform`` (the model
    passes its settings' target; ``Platform.here()`` is this machine)."""
    if name not in ATTENTION:
        raise ConfigError(f"unknown model.attention={name!r}; choose one of: {', '.join(ATTENTION)}")
    why_not = available(platform=platform, dtype=dtype, head_dim=head_dim, v_head_dim=v_head_dim)
    ok = [n for n in IMPLEMENTATIONS if why_not[n] is None]
    if name != "auto":
        if why_not[name]:
            raise ConfigError(f"model.attention={name} {why_not[name]}; choose one of: {', '.join(ok)}")
        return name, f"model.attention={name} (set explicitly)"
    if why_not["cudnn"] is None:
        return "cudnn", "auto: cuDNN flash attention runs here (NVIDIA GPU, half precision)"
    if why_not["splash"] is None:
        return "splash", "auto: JAX's Pallas TPU splash attention runs here (TPU)"
    if seq_len >= CHUNKED_MIN_SEQ:
        return "chunked", (
            f"auto: cudnn {why_not['cudnn']}; seq_len {seq_len} >= "
            f"{CHUNKED_MIN_SEQ}, from where chunked beats full scores (step "
            "time measured on CPU; memory linear in S)"
        )
    return "xla", (
        f"auto: cudnn {why_not['cudnn']}; seq_len {seq_len} < {CHUNKED_MIN_SEQ}, "
        "below which full scores are as fast as chunked (measured on CPU)"
    )


def _check_shapes(q_BSND, k_BSYD, v_BSYJ, segment_ids_BS) -> None:
    if not (q_BSND.ndim == k_BSYD.ndim == v_BSYJ.ndim == 4):
        raise ValueError("attend needs q [B, S, N, D], k [B, S, Y, D] and v [B, S, Y, J]")
    (B, S, N, D), (Bk, Sk, Y, Dk) = q_BSND.shape, k_BSYD.shape
    if (Bk, Sk) != (B, S) or v_BSYJ.shape[:3] != k_BSYD.shape[:3] or Dk != D:
        raise ValueError(
            f"attend: mismatched q {q_BSND.shape}, k {k_BSYD.shape}, "
            f"v {v_BSYJ.shape} (self-attention: same B and S, q/k share D)"
        )
    if N % Y:
        raise ValueError(f"attend: {Y} key/value heads do not divide {N} query heads")
    if segment_ids_BS is not None and segment_ids_BS.shape != (B, S):
        raise ValueError(f"attend: segment_ids_BS must be [B, S] = {(B, S)}, got {segment_ids_BS.shape}")


def attend(
    q_BSND,
    k_BSYD,
    v_BSYJ,
    *,
    implementation: str,
    segment_ids_BS=None,
    block: int = 0,
    scale: float | None = None,
    platform: Platform | None = None,
):
    """Causal attention, GQA (N query heads, Y kv heads, Y divides N); returns [B, S, N, J].

    ``implementation``: a concrete one (xla, cudnn, chunked, te, splash), already resolved.
    ``segment_ids_BS``: optional int [B, S]; a query attends only to keys of the same segment
    (packed documents). ``block``: chunked's block rows, 0 = ``default_block(S)``.
    ``scale``: softmax scale, default 1/sqrt(D). ``platform``: the target (splash runs in
    Pallas interpret mode off a TPU; None: this process's).
    """
    _check_shapes(q_BSND, k_BSYD, v_BSYJ, segment_ids_BS)
    if block < 0:
        raise ValueError(f"attend: block must be >= 0 (0 picks), got {block}")
    scale = 1.0 / math.sqrt(q_BSND.shape[-1]) if scale is None else float(scale)
    if segment_ids_BS is not None:
        segment_ids_BS = jnp.asarray(segment_ids_BS, jnp.int32)
    if implementation == "xla":
        return xla_attention(q_BSND, k_BSYD, v_BSYJ, segment_ids_BS, scale=scale)
    if implementation == "chunked":
        return chunked_attention(
            q_BSND, k_BSYD, v_BSYJ, segment_ids_BS, scale=scale, block=block or default_block(q_BSND.shape[1])
        )
    if implementation == "cudnn":
        return cudnn_attention(q_BSND, k_BSYD, v_BSYJ, segment_ids_BS, scale=scale)
    if implementation == "te":
        return te_attention(q_BSND, k_BSYD, v_BSYJ, segment_ids_BS, scale=scale)
    if implementation == "splash":
        interpret = or_here(platform).name != "tpu"
        return splash_attention(
            q_BSND, k_BSYD, v_BSYJ, segment_ids_BS, scale=scale, interpret=interpret, block=block
        )
    raise ValueError(
        f"attend: implementation must be one of {IMPLEMENTATIONS} (resolve "
        f"'auto' first), got {implementation!r}"
    )
