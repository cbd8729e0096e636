"""Synthetic routings for the benchmarks: expert choices and router inputs that realise them.

Every routing draws each token's top-k experts without replacement from a distribution
p_e (the Gumbel-top-k trick: top-k of ``log p_e + Gumbel noise``):

- ``uniform``: p_e equal.
- ``zipf``: p_e ~ 1 / rank_e ** ZIPF_S, ranks shuffled over the experts (a fixed permutation).
- ``zipf-sorted``: the same with the hottest experts first (expert 0 hottest; on EP rank 0).
- ``hot``: expert 0 is in every token's top-k (its load is T, the most top-k routing allows:
  the worst skew); the other k-1 choices are uniform over the rest.

``gumbel_logits`` gives the router logits [T, E]; ``tokens_for_logits`` makes activations x
with ``x @ gate = logits`` exactly, so a real router reproduces the routing. ``MoEShape`` is
the size of a synthetic layer problem, the base of the self-test's and the benchmarks' sizes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ZIPF_S = 1.1
ROUTINGS = ("uniform", "zipf", "zipf-sorted", "hot")
_HOT_LOGIT = 1e4


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One MoE layer problem: T tokens to top-K of E experts, H hidden, F expert ffn."""

    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int


def log_preference(num_experts: int, routing: str) -> np.ndarray:
    """log p_e (unnormalised) of the routing's expert distribution [E]."""
    E = num_experts
    if routing == "uniform":
        return np.zeros(E)
    if routing == "hot":
        pref = np.zeros(E)
        pref[0] = _HOT_LOGIT
        return pref
    rank = np.arange(E)
    if routing == "zipf":
        rank = np.random.default_rng(12345).permutation(E)
    elif routing != "zipf-sorted":
        raise ValueError(f"unknown routing {routing!r}; choose one of {ROUTINGS}")
    return -ZIPF_S * np.log1p(rank)


def gumbel_logits(num_tokens: int, num_experts: int, routing: str | np.ndarray, seed: int = 0) -> np.ndarray:
    """Router logits [T, E] = log p + Gumbel noise; ``routing`` is a name or a log p [E]."""
    pref = log_preference(num_experts, routing) if isinstance(routing, str) else routing
    rng = np.random.default_rng(1000 + seed)
    return pref + rng.gumbel(size=(num_tokens, num_experts))


def assignments(num_tokens: int, num_experts: int, top_k: int, routing: str, seed: int = 0) -> np.ndarray:
    """Expert ids [T, K] int32, distinct per token, drawn as the module doc describes."""
    logits = gumbel_logits(num_tokens, num_experts, routing, seed)
    return np.argsort(-logits, axis=1, kind="stable")[:, :top_k].astype(np.int32)


def loads(experts_TK: np.ndarray, num_experts: int) -> np.ndarray:
    """Assignments per expert [E]."""
    return np.bincount(np.asarray(experts_TK).ravel(), minlength=num_experts)


def tokens_for_logits(logits_TE: np.ndarray, gate_HE: np.ndarray, seed: int = 0) -> np.ndarray:
    """x [T, H] with x @ gate = logits: x = x0 + (logits - x0 @ gate) @ pinv(gate).

    Needs a full-column-rank gate (H >= E); x0 is standard normal.
    """
    H, E = gate_HE.shape
    if H < E:
        raise ValueError(f"the routing construction needs hidden >= experts, got H={H} E={E}")
    x0_TH = np.random.default_rng(2000 + seed).standard_normal((logits_TE.shape[0], H))
    return x0_TH + (logits_TE - x0_TH @ gate_HE) @ np.linalg.pinv(gate_HE)


def expert_weights(hidden: int, ffn: int, experts: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random fp64 gate [H, E] and expert weights w0, w1 [E, H, F], wo [E, F, H]."""
    rng = np.random.default_rng(seed)
    H, F, E = hidden, ffn, experts
    return {
        "gate": rng.standard_normal((H, E)) / np.sqrt(H),
        "w0": rng.standard_normal((E, H, F)) / np.sqrt(H),
        "w1": rng.standard_normal((E, H, F)) / np.sqrt(H),
        "wo": rng.standard_normal((E, F, H)) / np.sqrt(F),
    }
