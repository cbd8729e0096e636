"""Rotary position embeddings: the two pair layouts and YaRN frequency scaling.

Shape letters (``moe_train.base.notation``): B batch, S sequence, N heads, D rotated head dim
(even), D/2 frequencies.
Positions are 0..S-1 unless the caller passes per-row positions (packed documents,
``moe_train.data.packing.positions``).

- Layout ``half`` (rotate-half: dim i pairs with dim i + D/2) is what Llama, Mixtral and
  Qwen3 checkpoints use; ``interleaved`` (dim 2i pairs with 2i + 1) is what DeepSeek-V3's
  released weights use (its config says ``rope_interleave: true``): the query and key
  projections were trained with that pairing, so loading them needs it. (An implementation
  that de-interleaves q and k and then rotates halves gives the same attention scores: both
  operands of each dot product are permuted alike.)
- YaRN (``rope.scaling = "yarn"``) stretches the context of a model trained on
  ``original_max_positions`` tokens by ``factor``: frequencies that turn fewer than
  ``beta_slow`` times over the original context are interpolated (divided by ``factor``),
  those turning more than ``beta_fast`` times are kept, and a linear ramp over the dims in
  between blends the two. Rotated values are scaled by ``m(factor, mscale) /
  m(factor, mscale_all_dim)`` with m(s, c) = 0.1 c ln s + 1 (1 for s <= 1); attention adds
  m(factor, mscale_all_dim)^2 to its softmax scale (``softmax_scale_factor``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction m(factor, mscale): 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, positions: int) -> float:
    """The (fractional) dim index whose frequency turns ``rotations`` times in ``positions``."""
    return dim * math.log(positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_ramp(r: Any, dim: int, theta: float) -> jax.Array:
    """Per frequency [D/2], 1 where the original frequency is kept (fast), 0 where it is
    interpolated (slow), linear in between."""
    low = max(math.floor(_correction_dim(r.beta_fast, dim, theta, r.original_max_positions)), 0)
    high = min(math.ceil(_correction_dim(r.beta_slow, dim, theta, r.original_max_positions)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = (jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low)
    return 1.0 - jnp.clip(ramp, 0.0, 1.0)


def inv_frequencies(dim: int, theta: float, r: Any) -> jax.Array:
    """Rotation frequency of each pair [D/2] fp32 (``r``: a ``RopeConfig``)."""
    base = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if r.scaling == "none":
        return base
    keep = yarn_ramp(r, dim, theta)
    return base / r.factor * (1.0 - keep) + base * keep


def value_scale(r: Any) -> float:
    """The factor YaRN applies to cos and sin (1 without scaling)."""
    if r.scaling == "none":
        return 1.0
    return yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)


def softmax_scale_factor(r: Any) -> float:
    """What YaRN multiplies attention's 1/sqrt(head dim) by (1 without scaling)."""
    if r.scaling == "none" or not r.mscale_all_dim:
        return 1.0
    return yarn_mscale(r.factor, r.mscale_all_dim) ** 2


def apply(x_BSND: jax.Array, theta: float, r: Any, positions_BS=None) -> jax.Array:
    """``x`` rotated by position in ``r.layout``; computed in fp32, cast back. Positions are
    0..S-1 in every row, or ``positions_BS`` (int [B, S]: packed documents restart at 0)."""
    d = x_BSND.shape[-1]
    inv = inv_frequencies(d, theta, r)
    if positions_BS is None:
        ang_SD = jnp.outer(jnp.arange(x_BSND.shape[1], dtype=jnp.float32), inv)[None, :, None, :]
    else:  # the same products, per row: [B, S, 1, D/2]
        ang_SD = (positions_BS.astype(jnp.float32)[:, :, None] * inv)[:, :, None, :]
    scale = value_scale(r)
    sin, cos = jnp.sin(ang_SD) * scale, jnp.cos(ang_SD) * scale
    x = x_BSND.astype(jnp.float32)
    if r.layout == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        x1, x2 = jnp.split(x, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSND.dtype)
