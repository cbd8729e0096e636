"""fp8 token exchange (``moe.dispatch_dtype=fp8``): the dispatched rows cross the devices as
e4m3 with one fp32 scale per row, half the bytes of bf16; the combine stays in the
activations' dtype.

Shape letters (``moe_train.base.notation``): R rows of an exchange buffer, H hidden.

``send_rows(op, x_RH, dtype)`` applies a linear row exchange ``op`` (an ``all_to_all`` or
``all_gather`` over the leading dimension). Under fp8 each row is scaled by ``max|row| / 448``
(e4m3's largest finite value), cast to e4m3, sent as bytes with its scale, and multiplied back
on arrival. Error bound per element: ``|x' - x| <= 2^-4 |x| + 2^-10 max|row|`` (3 mantissa
bits round to within half a step; the second term covers e4m3's subnormals). Rows whose values
are exactly representable after scaling (e.g. small integers) arrive bitwise unchanged. The
backward pass is straight-through: the cotangent is exchanged by ``op``'s transpose in its own
dtype, unquantized, so gradients see the exchange as the identity on rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_train.config.schema import DISPATCH_DTYPES
from moe_train.moe.vjp import custom_vjp

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_rows(x_RH):
    """(e4m3 rows as uint8 bytes [R, H], fp32 scale [R, 1]); an all-zero row has scale 1."""
    amax_R1 = jnp.max(jnp.abs(x_RH.astype(jnp.float32)), axis=1, keepdims=True)
    scale_R1 = jnp.where(amax_R1 > 0, amax_R1 / E4M3_MAX, 1.0)
    q_RH = (x_RH.astype(jnp.float32) / scale_R1).astype(jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(q_RH, jnp.uint8), scale_R1


def dequantize_rows(bytes_RH, scale_R1, dtype):
    q_RH = jax.lax.bitcast_convert_type(bytes_RH, jnp.float8_e4m3fn)
    return (q_RH.astype(jnp.float32) * scale_R1).astype(dtype)


@custom_vjp(nondiff_argnums=(0,))
def _fp8_exchange(op, x_RH) -> jax.Array:
    bytes_RH, scale_R1 = quantize_rows(x_RH)
    return dequantize_rows(op(bytes_RH), op(scale_R1), x_RH.dtype)


def _fwd(op, x_RH):
    # the residual is an empty [R, 0] slice: it carries the rows' shape, dtype and (inside
    # shard_map) the mesh axes they vary over, and no data
    return _fp8_exchange(op, x_RH), x_RH[:, :0]


def _bwd(op, empty_R0, g):
    zeros_RH = jnp.pad(empty_R0, ((0, 0), (0, g.shape[1])))
    _, transpose = jax.vjp(op, zeros_RH)  # op is linear: its vjp is its transpose
    return transpose(g)


_fp8_exchange.defvjp(_fwd, _bwd)


def send_rows(op, x_RH, dtype: str = "activation") -> jax.Array:
    """``op(x_RH)``, the rows sent as ``dtype`` (``DISPATCH_DTYPES``)."""
    if dtype not in DISPATCH_DTYPES:
        raise ValueError(f"dispatch dtype {dtype!r}; valid: {', '.join(DISPATCH_DTYPES)}")
    if dtype == "activation":
        return op(x_RH)
    return _fp8_exchange(op, x_RH)
