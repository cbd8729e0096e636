"""The SwiGLU product silu(a0) * a1 with a VJP that keeps its inputs in the compute dtype.

Shape letters (``moe_train.base.notation``): M rows, F ffn; the product is elementwise, so any
leading shape works where no per-row scale is given. Used by the sorted-row expert backends
(``gemm.sorted_swiglu``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _product(a0_MF, a1_MF, scale_M):
    """(silu(a0) * a1 * scale, sigmoid(a0), silu(a0)), all fp32 [M, F]."""
    a0 = a0_MF.astype(jnp.float32)
    sig = jax.nn.sigmoid(a0)
    silu = a0 * sig
    h = silu * a1_MF.astype(jnp.float32)
    return (h if scale_M is None else h * scale_M.astype(jnp.float32)[:, None]), sig, silu


@jax.custom_vjp
def swiglu_product(a0_MF: jax.Array, a1_MF: jax.Array, scale_M: jax.Array | None = None) -> jax.Array:
    """silu(a0) * a1, times ``scale_M`` per row where given, in fp32 and returned in a0's dtype.

    Its VJP keeps a0 and a1 as given (the compute dtype) and recomputes the fp32 sigmoid in the
    backward. Autodiff of the same fp32 expression keeps a0, a1, silu(a0) and the product in
    fp32 (16 bytes per element beside h, where this keeps 2a): a scan over layers under remat
    none stacks them for every layer."""
    return _product(a0_MF, a1_MF, scale_M)[0].astype(a0_MF.dtype)


def _swiglu_product_fwd(a0_MF, a1_MF, scale_M):
    return swiglu_product(a0_MF, a1_MF, scale_M), (a0_MF, a1_MF, scale_M)


def _swiglu_product_bwd(res, dh_MF):
    a0_MF, a1_MF, scale_M = res
    _, sig, silu = _product(a0_MF, a1_MF, None)
    g = dh_MF.astype(jnp.float32)
    a1 = a1_MF.astype(jnp.float32)
    ds_M = None if scale_M is None else jnp.sum(g * silu * a1, axis=1).astype(scale_M.dtype)
    g = g if scale_M is None else g * scale_M.astype(jnp.float32)[:, None]
    da0 = g * a1 * sig * (1 + a0_MF.astype(jnp.float32) * (1 - sig))
    return da0.astype(a0_MF.dtype), (g * silu).astype(a1_MF.dtype), ds_M


swiglu_product.defvjp(_swiglu_product_fwd, _swiglu_product_bwd)
