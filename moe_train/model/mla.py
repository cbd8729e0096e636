"""Multi-head Latent Attention (MLA), as DeepSeek-V2 and V3 define it (arXiv:2412.19437, 2.1.1).

Shape letters (``moe_train.base.notation``): B batch, S sequence, H hidden, N heads, Z key/value
latent (``model.kv_lora_rank``), U no-RoPE dims per head (``model.qk_nope_head_dim``), I RoPE
dims (``model.qk_rope_head_dim``), D = U + I query/key head dim, J value head dim
(``model.v_head_dim``); the query latent's width is ``model.q_lora_rank``, in words.

Per token, with the report's names in brackets:

    c_q  = RMSNorm(x @ q_a)                      [B, S, q_lora_rank]  (c^Q; without it: none)
    q    = c_q @ q_b  (or x @ q)                 [B, S, N, D]  (q^C and q^R side by side)
    c_kv, k_rope = split(x @ kv_a)               [B, S, Z], [B, S, I]   (c^KV, k^R)
    k_nope, v = split(RMSNorm(c_kv) @ kv_b)      [B, S, N, U], [B, S, N, J]
    q_rope, k_rope = RoPE(q[..., U:]), RoPE(k_rope)   (one RoPE key shared by every head)
    o    = softmax(q . [k_nope, k_rope] * scale) v     scale = 1/sqrt(D), times YaRN's mscale^2
    out  = o @ o_w                               [B, S, H]

Weights keep the released checkpoints' fused layouts (``kv_a`` is ``kv_a_proj_with_mqa``: the
latent then the RoPE key; ``kv_b`` holds each head's no-RoPE key then its value), so the
Hugging Face bridge only reshapes and transposes. The RoPE pairs follow ``rope.layout``: the
released DeepSeek-V3 weights need ``interleaved`` (``moe_train.model.rope`` says why).

Every projection goes through ``precision.dot`` like the other dense projections, so fp8 and
FSDP treat them alike; the latent axes (``q_lora``, ``kv_lora``; ``kv_lora_rope``: kv_a's output,
the latent then the RoPE key) are FSDP-sharded over the mesh axes that divide them, the heads
over those left (``moe_train.parallel.sharding.logical_rules``). The value head dim differs
from the query/key head dim, which the xla and chunked kernels take and cuDNN's
(``jax.nn.dot_product_attention``) refuses (``moe_train.model.attention.resolve`` says so).
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_train.model import precision, rope
from moe_train.model.layers import CausalAttention, RMSNorm, gathered, weight


class MLA(CausalAttention):
    """Causal multi-head latent attention: [B, S, H] -> [B, S, H]; with ``segment_ids_BS``
    inside each packed document, RoPE at ``positions_BS`` (default 0..S-1)."""

    def qkv(self, x_BSH, positions_BS):
        m, pol = self.cfg.model, self.cfg.policy
        N, U, I, J = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        q_BSND = self._queries(x_BSH, N, U + I)
        kv_axes = ("embed", "kv_lora_rope")
        kv_a = weight(self, "kv_a", (m.hidden, m.kv_lora_rank + I), kv_axes)
        c_BSZ, k_rope_BSI = jnp.split(
            precision.dot(pol, "kv_a", x_BSH, gathered(kv_a, kv_axes, pol.dtype)), [m.kv_lora_rank], axis=-1
        )
        c_BSZ = RMSNorm(m.norm_eps, name="kv_a_norm")(c_BSZ)
        up_axes = ("kv_lora", "heads", "head_dim")
        kv_b = weight(self, "kv_b", (m.kv_lora_rank, N, U + J), up_axes)
        k_nope_BSNU, v_BSNJ = jnp.split(
            precision.dot(pol, "kv_b", c_BSZ, gathered(kv_b, up_axes, pol.dtype)), [U], axis=-1
        )
        r = self.cfg.rope
        q_rope_BSNI = rope.apply(q_BSND[..., U:], m.rope_theta, r, positions_BS)
        q_BSND = jnp.concatenate([q_BSND[..., :U], q_rope_BSNI], axis=-1)
        k_rope_BS1I = rope.apply(k_rope_BSI[:, :, None, :], m.rope_theta, r, positions_BS)
        k_BSND = jnp.concatenate(
            [k_nope_BSNU, jnp.broadcast_to(k_rope_BS1I, (*k_nope_BSNU.shape[:3], I))], axis=-1
        )
        return q_BSND, k_BSND, v_BSNJ

    def _queries(self, x_BSH, N: int, D: int):
        """[B, S, N, D] through the query latent (``q_lora_rank`` > 0) or straight from x."""
        m, pol = self.cfg.model, self.cfg.policy
        if not m.q_lora_rank:
            axes = ("embed", "heads", "head_dim")
            w = weight(self, "q", (m.hidden, N, D), axes)
            return precision.dot(pol, "q", x_BSH, gathered(w, axes, pol.dtype))
        down_axes, up_axes = ("embed", "q_lora"), ("q_lora", "heads", "head_dim")
        q_a = weight(self, "q_a", (m.hidden, m.q_lora_rank), down_axes)
        c_q = precision.dot(pol, "q_a", x_BSH, gathered(q_a, down_axes, pol.dtype))  # [B, S, q_lora_rank]
        c_q = RMSNorm(m.norm_eps, name="q_a_norm")(c_q)
        q_b = weight(self, "q_b", (m.q_lora_rank, N, D), up_axes)
        return precision.dot(pol, "q_b", c_q, gathered(q_b, up_axes, pol.dtype))
