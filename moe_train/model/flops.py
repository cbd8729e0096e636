"""Parameter counts and model FLOPs per token, computed from the config alone.

Parameters counted (exactly the tensors the trainer initialises; no biases anywhere):

* ``embedding``: the input table ``[V, H]``.
* ``lm_head``: the output projection ``[H, V]``; 0 when ``model.tie_embeddings`` (the
  embedding table is then reused as the output projection and counted once).
* ``attention``: per layer, GQA (``model.attention_kind=gqa``): q ``[H, nh*hd]``, k and v
  ``[H, nkv*hd]``, o ``[nh*hd, H]``, with ``hd = model.head_dim or hidden // num_heads``.
  MLA (``mla``, see ``moe_train.model.mla``): q_a ``[H, W]`` and q_b ``[W, nh*(U+I)]`` (or q
  ``[H, nh*(U+I)]`` without a query latent), kv_a ``[H, Z+I]``, kv_b ``[Z, nh*(U+J)]``, o
  ``[nh*J, H]``.
* ``norms``: per layer attn_norm and mlp_norm ``[H]`` (plus q_norm and k_norm ``[hd]`` when
  ``model.qk_norm``; MLA: q_a_norm ``[W]`` and kv_a_norm ``[Z]``), and final_norm ``[H]``.
* ``dense_mlp``: the first ``model.first_dense_layers`` layers, SwiGLU wi_0, wi_1 ``[H, Fd]``
  and wo ``[Fd, H]`` with ``Fd = model.dense_ffn``.
* ``router``: the gate ``[H, E]`` of every MoE layer. The aux-loss-free expert bias ``[E]``
  is optimiser-free state, not a parameter, and is not counted.
* ``routed_experts``: per MoE layer wi_0, wi_1 ``[E, H, F]`` and wo ``[E, F, H]``, ``F =
  moe.expert_ffn``.
* ``shared_experts``: per MoE layer one fused SwiGLU of width ``S * Fs`` (``S =
  moe.num_shared_experts``, ``Fs = moe.shared_ffn or F``).

* ``mtp``: the ``model.mtp_depth`` multi-token-prediction modules (``moe_train.model.mtp``), each
  eh_proj ``[2H, H]``, enorm, hnorm and norm ``[H]``, and one block like a MoE layer's (a
  dense one's in a model without MoE layers); ``mtp_active`` with top_k of its experts.
  They share the embedding and the output head, which ``mtp_with_shared`` adds once (how
  the released DeepSeek-V3 files store the module: "14B").

``total`` and ``active`` are the main model (what published counts name); ``total_with_mtp``
is what the trainer holds. ``active`` is what one token touches: everything above except
that only ``top_k`` of the
``E`` routed experts count (``active_routed_experts``). The embedding table is included in
``active`` (a lookup reads one row, but published "activated parameter" figures include it).

FLOPs per token (a multiply-add is 2 FLOPs; elementwise work, softmax, norms and the
router's top-k are ignored):

    matmul_active   = active - embedding - norms          (untied)
                    = active - norms                      (tied: the shared table is the lm_head)
                      + mtp_active - its norms + mtp_depth * H * V   (each depth's head)
    forward         = 2 * matmul_active  +  seq_len * nh * (dqk + dv) * (num_layers + mtp_depth)
    train           = 3 * forward                          (backward = 2 x forward)

``matmul_active`` counts the lm_head and the router; the embedding lookup is free. The
attention term is QK^T plus AV, ``2 * seq_len * nh * dqk`` and ``2 * seq_len * nh * dv`` FLOPs
per token per layer (``dqk``, ``dv``: the query/key and value head dims, both hd for GQA),
halved because a causal mask leaves on average half the keys.
Training throughput is ``train_flops_per_token * tokens_per_second / devices`` per device; the
trainer divides that by ``topology.peaks.peak_flops`` for MFU. No activation recomputation is
counted (it is hardware work, not model work).
"""

from __future__ import annotations

from moe_train.config import Config, attention_dims, head_dim


def attention_params(m) -> tuple[int, int]:
    """(weights, norm scales) of one layer's attention."""
    N = m.num_heads
    if m.attention_kind != "mla":
        hd = head_dim(m)
        norms = 2 * hd if m.qk_norm else 0
        return m.hidden * N * hd + 2 * m.hidden * m.num_kv_heads * hd + N * hd * m.hidden, norms
    H, W, Z = m.hidden, m.q_lora_rank, m.kv_lora_rank
    U, I, J = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    q = H * W + W * N * (U + I) if W else H * N * (U + I)
    return q + H * (Z + I) + Z * N * (U + J) + N * J * H, W + Z


def _moe_layer(cfg: Config) -> tuple[int, int, int, int]:
    """(router, routed experts, active routed experts, shared experts) of one MoE layer."""
    m, e = cfg.model, cfg.moe
    expert = 3 * m.hidden * e.expert_ffn  # one routed SwiGLU expert
    shared = 3 * m.hidden * e.num_shared_experts * (e.shared_ffn or e.expert_ffn)
    return m.hidden * e.num_experts, e.num_experts * expert, e.top_k * expert, shared


def _mtp(cfg: Config, attention: int, attention_norms: int) -> tuple[int, int, int]:
    """(parameters, active parameters, norm scales) of the MTP modules."""
    m = cfg.model
    H = m.hidden
    norms = 3 * H + 2 * H + attention_norms  # enorm, hnorm, norm; the block's two and attn's
    if m.first_dense_layers >= m.num_layers:  # no MoE layers: a dense block
        mlp = active_mlp = 3 * H * m.dense_ffn
    else:
        router, routed, active_routed, shared = _moe_layer(cfg)
        mlp, active_mlp = router + routed + shared, router + active_routed + shared
    common = 2 * H * H + norms + attention
    return (m.mtp_depth * (common + mlp), m.mtp_depth * (common + active_mlp), m.mtp_depth * norms)


def param_counts(cfg: Config) -> dict[str, int]:
    """Parameter counts by component, the ``total`` and the per-token ``active`` count."""
    m = cfg.model
    H, V, L = m.hidden, m.vocab_size, m.num_layers
    n_dense = m.first_dense_layers
    n_moe = L - n_dense
    attn, attn_norms = attention_params(m)
    router, routed, active_routed, shared = (n_moe * c for c in _moe_layer(cfg))

    embedding = V * H
    lm_head = 0 if m.tie_embeddings else H * V
    attention = L * attn
    norms = L * (2 * H + attn_norms) + H
    dense_mlp = n_dense * 3 * H * m.dense_ffn
    common = embedding + lm_head + attention + norms + dense_mlp + router + shared
    total, active = common + routed, common + active_routed
    mtp, mtp_active, mtp_norms = _mtp(cfg, attn, attn_norms)
    mtp_routed = m.mtp_depth * _moe_layer(cfg)[1] if n_moe else 0
    matmul_active = (
        active - norms - (0 if m.tie_embeddings else embedding) + mtp_active - mtp_norms + m.mtp_depth * H * V
    )
    return {
        "total": total,
        "active": active,
        "embedding": embedding,
        "lm_head": lm_head,
        "attention": attention,
        "dense_mlp": dense_mlp,
        "routed_experts": routed,
        "active_routed_experts": active_routed,
        "shared_experts": shared,
        "router": router,
        "norms": norms,
        "mtp": mtp,
        "mtp_active": mtp_active,
        "mtp_routed_experts": mtp_routed,
        "mtp_with_shared": mtp + (embedding + lm_head if mtp else 0),
        "total_with_mtp": total + mtp,
        "matmul_active": matmul_active,
    }


def attention_flops_per_token(cfg: Config) -> float:
    """Causal QK^T + AV in the forward pass, per token, summed over layers and MTP depths."""
    m = cfg.model
    dqk, dv, _ = attention_dims(m)
    return float((m.num_layers + m.mtp_depth) * 2 * cfg.train.seq_len * m.num_heads * (dqk + dv) / 2)


def forward_flops_per_token(cfg: Config) -> float:
    """``2 * matmul_active + causal attention`` (see the module docstring)."""
    return 2.0 * param_counts(cfg)["matmul_active"] + attention_flops_per_token(cfg)


def train_flops_per_token(cfg: Config) -> float:
    """Forward plus backward: ``3 * forward_flops_per_token``."""
    return 3.0 * forward_flops_per_token(cfg)
