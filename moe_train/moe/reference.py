"""Dense per-expert reference MoE: every expert on every token, obviously correct.

Shape letters (``moe_train.base.notation``): T tokens, H hidden, E experts, F expert ffn, K top-k.

Used as the test oracle and as the "run every expert on every token" benchmark baseline
(it costs E/K times the useful expert FLOPs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_train.moe.router import Routing, route_tokens


def swiglu_mlp(x_TH: jax.Array, w0_HF: jax.Array, w1_HF: jax.Array, wo_FH: jax.Array) -> jax.Array:
    """Dense SwiGLU MLP in x's dtype with fp32 accumulation; returns fp32 [T, H]."""
    dtype = x_TH.dtype
    a0_TF = jnp.dot(x_TH, w0_HF.astype(dtype), preferred_element_type=jnp.float32)
    a1_TF = jnp.dot(x_TH, w1_HF.astype(dtype), preferred_element_type=jnp.float32)
    h_TF = (jax.nn.silu(a0_TF) * a1_TF).astype(dtype)
    return jnp.dot(h_TF, wo_FH.astype(dtype), preferred_element_type=jnp.float32)


def dense_combine_weights(weights_TK: jax.Array, experts_TK: jax.Array, num_experts: int):
    """Dense combine matrix [T, E] fp32: w[t, e] if e was chosen for t, else 0."""
    one_hot_TKE = jax.nn.one_hot(experts_TK, num_experts, dtype=jnp.float32)
    return jnp.einsum("tke,tk->te", one_hot_TKE, weights_TK.astype(jnp.float32))


def dense_reference_moe(
    x_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH, routing: Routing, *, seq_len=None, expert_bias=None
):
    """Python loop over experts: y = sum_e combine[:, e] * swiglu_e(x).

    Routes as dropless_moe does and returns (y, stats) like it.
    """
    H = x_TH.shape[-1]
    lead_shape = x_TH.shape[:-1]
    x_TH = x_TH.reshape(-1, H)
    E = gate_kernel_HE.shape[-1]
    weights_TK, experts_TK, stats = route_tokens(
        x_TH, gate_kernel_HE, routing, expert_bias=expert_bias, seq_len=seq_len
    )
    combine_TE = dense_combine_weights(weights_TK, experts_TK, E)
    y_TH = jnp.zeros(x_TH.shape, jnp.float32)
    for e in range(E):
        out_TH = swiglu_mlp(x_TH, wi_0_EHF[e], wi_1_EHF[e], wo_EFH[e])
        y_TH = y_TH + combine_TE[:, e : e + 1] * out_TH.astype(x_TH.dtype).astype(jnp.float32)
    return y_TH.astype(x_TH.dtype).reshape(*lead_shape, H), stats
