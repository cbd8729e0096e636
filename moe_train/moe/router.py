"""Top-k router: expert choice, combine weights and load-balancing statistics.

Shape letters (``moe_train.base.notation``): T tokens, H hidden, E experts, K top-k, B
sequences, S tokens per sequence (T = B*S). Group-limited routing names its expert groups in
words (``num_groups`` of ``E // num_groups`` experts).

All router math runs in fp32 whatever the activation dtype, so bf16 and fp32 activations
that are equal after rounding route identically.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from moe_train.base.choices import SCORE_FUNCTIONS
from moe_train.moe.permute import count_ids
from moe_train.moe.stats import MoEStats, exchange_stats


@dataclasses.dataclass(frozen=True)
class Routing:
    """How tokens choose experts: the router's static settings, one value for every layer."""

    top_k: int  # K: experts per token
    score_function: str = "softmax"  # softmax probabilities or DeepSeek-V3 sigmoid affinities
    normalize_top_k: bool = True  # renormalise the chosen weights to sum to 1 per token
    num_groups: int = 0  # group-limited routing over this many groups of experts; 0: off
    group_top_k: int = 0  # groups a token may choose experts from (with num_groups)
    routed_scaling: float = 1.0  # factor applied to the final combine weights
    balanced: bool = False  # forced balance (benchmarks): token t takes experts (t*K + j) mod E

    @classmethod
    def of(cls, moe: Any, study: Any) -> Routing:
        """The routing of a ``moe_train.config.MoEConfig`` and the ``StudyConfig`` beside it
        (``study.router=balanced``: forced balance, benchmarks only)."""
        return cls(
            moe.top_k,
            moe.score_function,
            moe.normalize_top_k,
            moe.num_groups,
            moe.group_top_k,
            moe.routed_scaling,
            study.router == "balanced",
        )


def router_logits(x_TH: jax.Array, gate_kernel_HE: jax.Array) -> jax.Array:
    """fp32 logits [T, E] = x @ gate, both operands cast to fp32."""
    return jnp.dot(
        x_TH.astype(jnp.float32), gate_kernel_HE.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )


def router_scores(logits_TE: jax.Array, score_function: str) -> jax.Array:
    """Per-expert scores: softmax probabilities or DeepSeek-V3 sigmoid affinities."""
    if score_function == "softmax":
        return jax.nn.softmax(logits_TE, axis=-1)
    if score_function == "sigmoid":
        return jax.nn.sigmoid(logits_TE)
    raise ValueError(f"unknown score_function {score_function!r}; choose one of {SCORE_FUNCTIONS}")


def _limit_groups(choice_TE: jax.Array, num_groups: int, group_top_k: int) -> jax.Array:
    """Mask (to -inf) every expert outside each token's best `group_top_k` groups.

    A group's score is the sum of the two largest choice values among its E/num_groups
    consecutive experts (the single largest when a group holds one expert).
    """
    T, E = choice_TE.shape
    if E % num_groups:
        raise ValueError(f"num_groups={num_groups} does not divide num_experts={E}")
    if not 1 <= group_top_k <= num_groups:
        raise ValueError(f"group_top_k={group_top_k} must be in 1..{num_groups}")
    per_group = E // num_groups
    by_group = choice_TE.reshape(T, num_groups, per_group)
    group_score = jax.lax.top_k(by_group, min(2, per_group))[0].sum(axis=-1)  # [T, num_groups]
    _, best_groups = jax.lax.top_k(group_score, group_top_k)  # [T, group_top_k]
    keep_group = jnp.zeros((T, num_groups), bool).at[jnp.arange(T)[:, None], best_groups].set(True)
    keep_TE = jnp.repeat(keep_group, per_group, axis=1)
    return jnp.where(keep_TE, choice_TE, -jnp.inf)


def route(logits_TE: jax.Array, routing: Routing, expert_bias: jax.Array | None = None):
    """Choose ``routing.top_k`` experts per token.

    Args:
      logits_TE: router logits (cast to fp32).
      routing: the router's settings (group-limited routing when ``num_groups`` is set).
      expert_bias: [E] added to the scores for choosing only; receives no gradient.

    Returns:
      (weights_TK fp32, experts_TK int32, scores_TE fp32). Experts are ordered by decreasing
      choice value; ties go to the lowest index (jax.lax.top_k). ``routing.balanced`` ignores
      the scores for choosing (``balanced_experts``) and the groups and bias with them.
    """
    r = routing
    top_k, num_groups, group_top_k = r.top_k, r.num_groups, r.group_top_k
    logits_TE = logits_TE.astype(jnp.float32)
    T, E = logits_TE.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in 1..{E}")
    scores_TE = router_scores(logits_TE, r.score_function)
    choice_TE = jax.lax.stop_gradient(scores_TE)
    if expert_bias is not None:
        choice_TE = choice_TE + jax.lax.stop_gradient(expert_bias.astype(jnp.float32))
    if num_groups:
        if not group_top_k:
            raise ValueError("num_groups is set but group_top_k is not")
        if top_k > group_top_k * (E // num_groups):
            raise ValueError(f"top_k={top_k} exceeds the experts in {group_top_k} groups")
        choice_TE = _limit_groups(choice_TE, num_groups, group_top_k)
    if r.balanced:  # + a zero computed from the logits: varies over the mesh axes as they do
        zero_T1 = (jax.lax.stop_gradient(logits_TE[:, :1]) > jnp.inf).astype(jnp.int32)
        experts_TK = balanced_experts(T, top_k, E) + zero_T1
    else:
        experts_TK = jax.lax.top_k(choice_TE, top_k)[1].astype(jnp.int32)
    weights_TK = picked_scores(scores_TE, experts_TK)
    if r.normalize_top_k:
        weights_TK = weights_TK / (weights_TK.sum(axis=-1, keepdims=True) + 1e-20)
    return weights_TK * r.routed_scaling, experts_TK, scores_TE


def picked_scores(scores_TE: jax.Array, experts_TK: jax.Array) -> jax.Array:
    """[T, K]: ``scores_TE[t, experts_TK[t, k]]``, each a select of its expert's column summed
    over E (one term is not zero: exact). The gradient is a select too, where a gather's is a
    scatter-add of T*K values into [T, E] (such a scatter took 1.25 ms on a TPU v5e at Qwen3's
    shape, of the routing's 5.7 ms)."""
    hit_TKE = experts_TK[..., None] == jnp.arange(scores_TE.shape[-1], dtype=experts_TK.dtype)
    return jnp.sum(jnp.where(hit_TKE, scores_TE[:, None, :], 0.0), axis=-1)


def balanced_experts(T: int, top_k: int, num_experts: int) -> jax.Array:
    """Forced-balance choice [T, K]: token t takes experts (t*K + j) mod E, j < K: distinct
    experts per token, and every expert T*K/E tokens when E divides T*K (inside ``shard_map``
    per shard, so also per EP pair)."""
    t_T1, j_1K = jnp.arange(T, dtype=jnp.int32)[:, None], jnp.arange(top_k, dtype=jnp.int32)
    return (t_T1 * top_k + j_1K) % num_experts


def expert_counts(experts_TK: jax.Array, num_experts: int) -> jax.Array:
    """Assignments per expert [E] int32 (sums to T*K)."""
    return count_ids(experts_TK, num_experts)


def _token_distribution(scores_TE: jax.Array, score_function: str) -> jax.Array:
    """Scores normalised to sum to 1 per token (softmax probabilities are already)."""
    if score_function == "softmax":
        return scores_TE
    return scores_TE / (scores_TE.sum(axis=-1, keepdims=True) + 1e-20)


def _seq_aux_loss(p_TE: jax.Array, experts_TK: jax.Array, seq_len: int | None) -> jax.Array:
    """DeepSeek-V3 sequence-wise balance loss, averaged over sequences."""
    T, E = p_TE.shape
    K = experts_TK.shape[-1]
    S = T if seq_len is None else int(seq_len)
    if S <= 0 or T % S:
        raise ValueError(f"seq_len={seq_len} must divide the number of tokens {T}")
    B = T // S
    one_hot_BSE = jax.nn.one_hot(experts_TK, E, dtype=jnp.float32).sum(axis=1).reshape(B, S, E)
    f_BE = one_hot_BSE.sum(axis=1) * (E / (K * S))
    P_BE = p_TE.reshape(B, S, E).mean(axis=1)
    return jnp.mean(jnp.sum(f_BE * P_BE, axis=-1))


def router_stats(
    logits_TE: jax.Array,
    scores_TE: jax.Array,
    experts_TK: jax.Array,
    *,
    score_function: str = "softmax",
    seq_len: int | None = None,
    axis_names: tuple[str, ...] | None = None,
) -> MoEStats:
    """Load statistics and unscaled router losses (``MoEStats``; its exchange fields are
    those of a layer without an exchange: every assignment computed where it was routed).

    aux_loss is E * sum_e f_e P_e over all tokens, seq_aux_loss the same per sequence of
    ``seq_len`` rows, then averaged; z_loss the mean logsumexp(logits)^2; router_entropy the
    mean entropy of the per-token distribution. P uses scores normalised to sum 1 per token.
    With ``axis_names`` (inside shard_map) the tokens are this shard's part of the batch and
    every statistic is over the whole batch: sums are psum-reduced over those mesh axes.
    """

    def total(v):
        return v if axis_names is None else jax.lax.psum(v, axis_names)

    T, E = logits_TE.shape
    K = experts_TK.shape[-1]
    tokens = total(jnp.float32(T))
    counts_E = total(expert_counts(experts_TK, E))
    p_TE = _token_distribution(scores_TE.astype(jnp.float32), score_function)
    f_E = counts_E.astype(jnp.float32) / (tokens * K)
    aux_loss = E * jnp.sum(f_E * total(p_TE.sum(axis=0)) / tokens)
    lse_T = jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1)
    entropy_T = -jnp.sum(p_TE * jnp.log(jnp.maximum(p_TE, 1e-30)), axis=-1)
    return MoEStats(
        tokens_per_expert=counts_E,
        aux_loss=aux_loss,
        seq_aux_loss=total(_seq_aux_loss(p_TE, experts_TK, seq_len)) / total(jnp.float32(1)),
        z_loss=total(jnp.sum(jnp.square(lse_T))) / tokens,
        router_entropy=total(jnp.sum(entropy_T)) / tokens,
        dropped_tokens=jnp.zeros((), jnp.int32),
        **exchange_stats(tokens * K),
    )


def route_tokens(
    x_TH: jax.Array,
    gate_kernel_HE: jax.Array,
    routing: Routing,
    *,
    expert_bias: jax.Array | None = None,
    seq_len: int | None = None,
    axis_names: tuple[str, ...] | None = None,
):
    """logits -> route -> stats in one call: returns (weights_TK, experts_TK, stats).

    ``axis_names`` (inside ``shard_map``): the mesh axes the batch is split over; the
    statistics are then over the whole batch (``router_stats``)."""
    logits_TE = router_logits(x_TH, gate_kernel_HE)
    weights_TK, experts_TK, scores_TE = route(logits_TE, routing, expert_bias)
    stats = router_stats(
        logits_TE,
        scores_TE,
        experts_TK,
        score_function=routing.score_function,
        seq_len=seq_len,
        axis_names=axis_names,
    )
    return weights_TK, experts_TK, stats
