"""Parameter counts and model FLOPs per token, computed from the config alone.

Parameters counted (exactly the tensors the trainer initialises; no biases anywhere):

* ``embedding``: the input table ``[V, H]``.
* ``lm_head``: the output projection ``[H, V]``; 0 when ``model.tie_embeddings`` (the
  embedding table is then reused as the output projection and counted once).
* ``attention``: per layer q ``[H, nh*hd]``, k and v ``[H, nkv*hd]``, o ``[nh*hd, H]``,
  with ``hd = model.head_dim or hidden // num_heads``.
* ``norms``: per layer attn_norm and mlp_norm ``[H]`` (plus q_norm and k_norm ``[hd]`` when
  ``model.qk_norm``), and final_norm ``[H]``.
* ``dense_mlp``: the first ``model.first_dense_layers`` layers, SwiGLU wi_0, wi_1 ``[H, Fd]``
  and wo ``[Fd, H]`` with ``Fd = model.dense_ffn``.
* ``router``: the gate ``[H, E]`` of every MoE layer. The aux-loss-free expert bias ``[E]``
  is optimiser-free state, not a parameter, and is not counted.
* ``routed_experts``: per MoE layer wi_0, wi_1 ``[E, H, F]`` and wo ``[E, F, H]``, ``F =
  moe.expert_ffn``.
* ``shared_experts``: per MoE layer one fused SwiGLU of width ``S * Fs`` (``S =
  moe.num_shared_experts``, ``Fs = moe.shared_ffn or F``).

``active`` is what one token touches: everything above except that only ``top_k`` of the
``E`` routed experts count (``active_routed_experts``). The embedding table is included in
``active`` (a lookup reads one row, but published "activated parameter" figures include it).

FLOPs per token (a multiply-add is 2 FLOPs; elementwise work, softmax, norms and the
router's top-k are ignored):

    matmul_active   = active - embedding - norms          (untied)
                    = active - norms                      (tied: the shared table is the lm_head)
    forward         = 2 * matmul_active  +  2 * seq_len * nh * hd * num_layers
    train           = 3 * forward                          (backward = 2 x forward)

``matmul_active`` counts the lm_head and the router; the embedding lookup is free. The
attention term is QK^T plus AV, each ``2 * seq_len * nh * hd`` FLOPs per token per layer, halved
because a causal mask leaves on average half the keys: ``2 * 2 * seq_len * nh*hd / 2``.
Training throughput is ``train_flops_per_token * tokens_per_second / devices`` per device; the
trainer divides that by ``topology.peaks.peak_flops`` for MFU. No activation recomputation is
counted (it is hardware work, not model work).
"""

from __future__ import annotations

from moe_train.config import Config, head_dim


def param_counts(cfg: Config) -> dict[str, int]:
    """Parameter counts by component, the ``total`` and the per-token ``active`` count."""
    m, e = cfg.model, cfg.moe
    H, V, L = m.hidden, m.vocab_size, m.num_layers
    hd = head_dim(m)
    n_dense = m.first_dense_layers
    n_moe = L - n_dense
    E, F = e.num_experts, e.expert_ffn
    shared_width = e.num_shared_experts * (e.shared_ffn or F)

    embedding = V * H
    lm_head = 0 if m.tie_embeddings else H * V
    attention = L * (H * m.num_heads * hd + 2 * H * m.num_kv_heads * hd + m.num_heads * hd * H)
    per_layer_norms = 2 * H + (2 * hd if m.qk_norm else 0)
    norms = L * per_layer_norms + H
    dense_mlp = n_dense * 3 * H * m.dense_ffn
    router = n_moe * H * E
    expert = 3 * H * F  # one routed SwiGLU expert
    routed_experts = n_moe * E * expert
    active_routed_experts = n_moe * e.top_k * expert
    shared_experts = n_moe * 3 * H * shared_width

    common = embedding + lm_head + attention + norms + dense_mlp + router + shared_experts
    total = common + routed_experts
    active = common + active_routed_experts
    matmul_active = active - norms - (0 if m.tie_embeddings else embedding)
    return {
        "total": total,
        "active": active,
        "embedding": embedding,
        "lm_head": lm_head,
        "attention": attention,
        "dense_mlp": dense_mlp,
        "routed_experts": routed_experts,
        "active_routed_experts": active_routed_experts,
        "shared_experts": shared_experts,
        "router": router,
        "norms": norms,
        "matmul_active": matmul_active,
    }


def attention_flops_per_token(cfg: Config) -> float:
    """Causal QK^T + AV in the forward pass, per token, summed over layers."""
    m = cfg.model
    return float(m.num_layers * 2 * 2 * cfg.train.seq_len * m.num_heads * head_dim(m) / 2)


def forward_flops_per_token(cfg: Config) -> float:
    """``2 * matmul_active + causal attention`` (see the module docstring)."""
    return 2.0 * param_counts(cfg)["matmul_active"] + attention_flops_per_token(cfg)


def train_flops_per_token(cfg: Config) -> float:
    """Forward plus backward: ``3 * forward_flops_per_token``."""
    return 3.0 * forward_flops_per_token(cfg)
