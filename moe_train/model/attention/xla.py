"""The reference: full [S, S] scores through XLA, written out in einsums.

``jax.nn.dot_product_attention`` requires the value head dim to equal the query/key head dim
(it checks ``value.shape == key.shape``), which MLA-style heads (qk 192, v 128) break, so the
reference is spelled out: fp32 scores (``preferred_element_type``), masked, softmax in fp32,
probabilities cast to the value dtype, then the weighted sum. This is the numerics of
``jax.nn.dot_product_attention(..., implementation="xla")``; tests/test_attention.py checks
the two agree where both apply.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_train.model.attention.chunked import NEG


def xla_attention(q_BSND, k_BSYD, v_BSYJ, segment_ids_BS, *, scale: float):
    """Causal GQA attention with full scores; returns [B, S, N, J]."""
    B, S, N, D = q_BSND.shape
    Y, J = k_BSYD.shape[2], v_BSYJ.shape[3]
    q_BSYGD = q_BSND.reshape(B, S, Y, N // Y, D)
    s_BYGSS = jnp.einsum("bqkgd,brkd->bkgqr", q_BSYGD, k_BSYD, preferred_element_type=jnp.float32) * scale
    mask = jnp.tril(jnp.ones((S, S), bool))
    if segment_ids_BS is not None:
        same_BSS = segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :]
        mask = mask & same_BSS[:, None, None]
    s_BYGSS = jnp.where(mask, s_BYGSS, NEG)
    p_BYGSS = jax.nn.softmax(s_BYGSS, axis=-1).astype(v_BSYJ.dtype)
    o_BSYGJ = jnp.einsum("bkgqr,brkj->bqkgj", p_BYGSS, v_BSYJ)
    return o_BSYGJ.reshape(B, S, N, J)
