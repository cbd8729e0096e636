"""GPU fused attention: cuDNN through ``jax.nn.dot_product_attention`` and Transformer Engine.

What each refuses (from jax's ``jax/_src/cudnn/fused_attention_stablehlo.py`` and
``jax.nn.dot_product_attention``; reported by ``cudnn_unavailable`` before anything compiles):
  * an NVIDIA GPU with cuDNN; fp16/bf16 inputs only (fp8 is a separate API, fp32 is refused);
  * ``jax.nn.dot_product_attention`` checks ``value.shape == key.shape``: the value head dim
    must equal the query/key head dim (no MLA-style 192/128 through this API);
  * head dim a multiple of 8 and at most 128 (256 on Hopper, sm_90, and newer); flash
    attention in cuDNN needs Ampere (sm_80) or newer.
Segment ids become a boolean [B, 1, S, S] mask, which jax turns into an additive bias (so
O(S^2) memory for packed rows); cuDNN needs even lengths when training with a bias, so odd
lengths are padded by one position, which sits after every real query and is hidden by the
causal mask.

Transformer Engine: ``transformer_engine.jax.flax.DotProductAttention`` (BSHD layout, causal
mask, GQA via ``num_gqa_groups``, ``scale_factor``). TE's JAX module falls back to an unfused
XLA attention, with a warning, unless ``NVTE_FUSED_ATTN=1`` and a fused kernel exists for the
shape: the call sets ``NVTE_FUSED_ATTN=1`` while it traces (unless the user set it) and turns
that fallback warning into an error, so ``te`` never silently runs something else. Segment ids
are refused: TE expresses packed documents only through its THD layout and
``SequenceDescriptor``, an interface marked experimental whose arguments change between releases.
"""

# transformer_engine is imported only where installed (GPU containers), never from .venv
# pyright: reportMissingImports=false
from __future__ import annotations

import contextlib
import os
import warnings

import jax
import jax.numpy as jnp

from moe_train.base.imports import import_failure
from moe_train.base.platform import Platform
from moe_train.config import ConfigError

HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _gpu_reason(platform: Platform, dtype) -> str | None:
    """Why neither fused path can run on ``platform`` with ``dtype`` (None: they may)."""
    if platform.name not in ("gpu", "cuda"):
        return f"needs an NVIDIA GPU (this platform is {platform.name})"
    if not platform.cuda:
        return f"needs an NVIDIA (CUDA) GPU, found {platform.device_kind or 'none'}"
    if jnp.dtype(dtype) not in HALF:
        return f"needs bfloat16 or float16 inputs, got {jnp.dtype(dtype).name} (set precision.compute=bf16)"
    if platform.cc is not None and platform.cc < 8.0:
        return f"needs compute capability >= 8.0 (Ampere), found sm_{platform.cc}"
    return None


def cudnn_unavailable(platform: Platform, dtype, head_dim: int, v_head_dim: int) -> str | None:
    """Why ``cudnn`` cannot run on ``platform`` (None: it can)."""
    reason = _gpu_reason(platform, dtype)
    if reason:
        return reason
    if platform.cudnn_version is None:
        return "needs cuDNN, which jax does not detect"
    if head_dim != v_head_dim:
        return (
            f"needs the value head dim equal to the query/key head dim "
            f"(jax.nn.dot_product_attention; got {head_dim} and {v_head_dim})"
        )
    limit = 256 if (platform.cc or 0) >= 9.0 else 128
    if head_dim % 8 or head_dim > limit:
        return f"needs a head dim that is a multiple of 8 and <= {limit} here, got {head_dim}"
    return None


def cudnn_attention(q_BSND, k_BSYD, v_BSYD, segment_ids_BS, *, scale: float):
    """cuDNN flash attention (causal, GQA); returns [B, S, N, D]."""
    if segment_ids_BS is None:
        return jax.nn.dot_product_attention(
            q_BSND, k_BSYD, v_BSYD, scale=scale, is_causal=True, implementation="cudnn"
        )
    S = q_BSND.shape[1]
    if S % 2:  # cuDNN trains with a bias only at even lengths; the pad is causally hidden
        widths = ((0, 0), (0, 1), (0, 0), (0, 0))
        q_BSND, k_BSYD, v_BSYD = (jnp.pad(x, widths) for x in (q_BSND, k_BSYD, v_BSYD))
        segment_ids_BS = jnp.pad(segment_ids_BS, ((0, 0), (0, 1)), mode="edge")
    mask_B1SS = (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None]
    out = jax.nn.dot_product_attention(
        q_BSND, k_BSYD, v_BSYD, mask=mask_B1SS, scale=scale, is_causal=True, implementation="cudnn"
    )
    return out[:, :S]


def te_import_error() -> str | None:
    """Why TE's fused attention cannot be imported here (None when it can)."""
    return import_failure("transformer_engine.jax", "transformer_engine.jax.flax:DotProductAttention")


def te_unavailable(platform: Platform, dtype, head_dim: int, v_head_dim: int) -> str | None:
    """Why ``te`` cannot run on ``platform`` (None: it may; TE's kernel check runs at trace time)."""
    err = te_import_error()
    if err:
        return err
    reason = _gpu_reason(platform, dtype)
    if reason:
        return reason
    if os.environ.get("NVTE_FUSED_ATTN", "1") == "0":
        return "is disabled by NVTE_FUSED_ATTN=0 (TE would run its unfused attention)"
    return None


@contextlib.contextmanager
def _fused_requested():
    """NVTE_FUSED_ATTN=1 while TE traces (its JAX module reads it at call time)."""
    old = os.environ.get("NVTE_FUSED_ATTN")
    os.environ["NVTE_FUSED_ATTN"] = "1" if old is None else old
    try:
        yield
    finally:
        if old is None:
            del os.environ["NVTE_FUSED_ATTN"]


def te_attention(q_BSND, k_BSYD, v_BSYJ, segment_ids_BS, *, scale: float):
    """Transformer Engine's fused attention (causal, GQA); returns [B, S, N, J]."""
    if segment_ids_BS is not None:
        raise ConfigError(
            "model.attention=te does not take segment ids (TE packs documents "
            "only through its experimental THD layout); choose one of: chunked, "
            "xla, cudnn (where it runs)"
        )
    from transformer_engine.jax.flax import DotProductAttention

    B, S, N, D = q_BSND.shape
    module = DotProductAttention(
        head_dim=D,
        num_attention_heads=N,
        num_gqa_groups=k_BSYD.shape[2],
        attention_dropout=0.0,
        attn_mask_type="causal",
        qkv_layout="bshd_bshd_bshd",
        scale_factor=scale,
        transpose_batch_sequence=False,
        dtype=q_BSND.dtype,
    )
    with _fused_requested(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = module.apply({}, q_BSND, k_BSYD, v_BSYJ, deterministic=True)
    words = ("unfused", "fall back", "fallback")
    fallback = [str(w.message) for w in caught if any(word in str(w.message).lower() for word in words)]
    if fallback:
        raise ConfigError(
            f"model.attention=te: Transformer Engine has no fused kernel for "
            f"q {q_BSND.shape} k {k_BSYD.shape} v {v_BSYJ.shape} "
            f"{q_BSND.dtype} ({fallback[0].splitlines()[0]}); choose one of: "
            "chunked, xla, cudnn (where it runs)"
        )
    return out
