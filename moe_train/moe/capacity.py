"""GShard-style token-dropping MoE (capacity baseline for benchmarks).

Shape letters (``moe_train.base.notation``): T tokens, H hidden, E experts, F expert ffn, K
top-k, M = T*K assignments, C capacity (slots per expert), R = E*C slot rows.

Each expert keeps at most C assignments. Priority is slot-major: every token's 1st choice
comes before any 2nd choice, and within a slot earlier tokens come first. Kept assignments
run in a dense [E, C, H] batched matmul; dropped ones contribute 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_train.moe.layer import check_expert_shapes
from moe_train.moe.permute import count_ids, stable_order, weighted_sum
from moe_train.moe.router import Routing, route_tokens


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float = 1.0) -> int:
    """C = ceil(capacity_factor * T * K / E), at least 1."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def slot_positions(experts_TK: jax.Array, num_experts: int) -> jax.Array:
    """Position [T, K] of each assignment in its expert's queue (slot-major priority)."""
    T, K = experts_TK.shape
    experts_M = experts_TK.T.reshape(-1)  # n = k*T + t
    order_M = stable_order(experts_M, num_experts)
    sorted_M = experts_M[order_M]
    counts_E = count_ids(experts_M, num_experts)
    start_E = jnp.cumsum(counts_E) - counts_E
    rank_M = jnp.arange(T * K) - start_E[sorted_M]
    position_M = jnp.zeros((T * K,), jnp.int32).at[order_M].set(rank_M.astype(jnp.int32))
    return position_M.reshape(K, T).T


def capacity_moe(
    x_TH,
    gate_kernel_HE,
    wi_0_EHF,
    wi_1_EHF,
    wo_EFH,
    routing: Routing,
    *,
    capacity_factor=1.0,
    capacity=None,
    seq_len=None,
    expert_bias=None,
):
    """Token-dropping SwiGLU MoE routed as dropless_moe routes.

    capacity (int) overrides capacity_factor. Returns (y, stats); stats as dropless_moe's
    but dropped_tokens counts the dropped assignments.
    """
    H, E, F = check_expert_shapes(x_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH)
    lead_shape = x_TH.shape[:-1]
    x_TH = x_TH.reshape(-1, H)
    T, dtype = x_TH.shape[0], x_TH.dtype
    top_k = routing.top_k
    C = int(capacity) if capacity is not None else expert_capacity(T, top_k, E, capacity_factor)
    with jax.named_scope("route"):
        weights_TK, experts_TK, stats = route_tokens(
            x_TH, gate_kernel_HE, routing, expert_bias=expert_bias, seq_len=seq_len
        )
    with jax.named_scope("permute"):
        position_TK = slot_positions(experts_TK, E)
        kept_TK = position_TK < C
        slot_TK = jnp.where(kept_TK, experts_TK * C + position_TK, E * C)  # E*C: dropped
        token_TK = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], (T, top_k))
        token_R = (
            jnp.zeros((E * C,), jnp.int32).at[slot_TK.reshape(-1)].set(token_TK.reshape(-1), mode="drop")
        )
        filled_R = jnp.zeros((E * C,), bool).at[slot_TK.reshape(-1)].set(True, mode="drop")
        x_ECH = jnp.where(filled_R[:, None], x_TH[token_R], 0).reshape(E, C, H)
    with jax.named_scope("grouped_gemm"):
        a0_ECF = jnp.einsum("ech,ehf->ecf", x_ECH, wi_0_EHF.astype(dtype), preferred_element_type=jnp.float32)
        a1_ECF = jnp.einsum("ech,ehf->ecf", x_ECH, wi_1_EHF.astype(dtype), preferred_element_type=jnp.float32)
        h_ECF = (jax.nn.silu(a0_ECF) * a1_ECF).astype(dtype)
        y_ECH = jnp.einsum(
            "ecf,efh->ech", h_ECF, wo_EFH.astype(dtype), preferred_element_type=jnp.float32
        ).astype(dtype)
    with jax.named_scope("unpermute"):
        y_RH = y_ECH.reshape(E * C, H)
        y_MH = y_RH[jnp.minimum(slot_TK, E * C - 1)].reshape(-1, H)
        y_TH = weighted_sum(y_MH, jnp.where(kept_TK, weights_TK, 0.0), dtype)
    stats = stats.replace(dropped_tokens=jnp.sum(~kept_TK).astype(jnp.int32))
    return y_TH.reshape(*lead_shape, H), stats
