"""Decoder-only MoE transformer (Flax linen), written against logical axis names.

Letter key for tensor names:
  B batch, S sequence, T tokens (B*S), H hidden, V vocab, N query heads, K key/value heads,
  D head dim, F ffn width, E experts, L MoE layers.

Parameters are created with logical axes (``embed``, ``mlp``, ``heads``, ``expert``, ...);
``moe_train.sharding.LOGICAL_RULES`` maps them to mesh axes. The expert bias of
aux-loss-free balancing lives in the ``moe_state`` collection: it is read here and updated by
the train step from the returned expert loads, never by the optimizer. Matmul precision
follows ``[precision]`` (``moe_train.precision``): under fp8 the fp8 scaling state lives in
the ``_overwrite_with_gradient`` collection and the router still sees the un-quantized input.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_train import precision, remat
from moe_train.config import Config, head_dim
from moe_train.moe import dropless_moe
from moe_train.moe.ep import EPPlan, ep_moe

ACTIVATION_AXES = ("activation_batch", "activation_seq", "activation_embed")
STAT_KEYS = ("tokens_per_expert", "aux_loss", "seq_aux_loss", "z_loss", "dropped_tokens",
             "overflow", "recv_rows", "recv_slots", "max_pair_load", "slow_rows")


def gathered(w, axes: tuple[str, ...], dtype):
    """A weight cast for use, constrained whole along ``embed``: FSDP all-gathers the weight
    rather than letting the partitioner reshard activations to match it."""
    use_axes = tuple("activation_embed" if a == "embed" else a for a in axes)
    return nn.with_logical_constraint(w.astype(dtype), use_axes)


def _init(fan_in_axes: tuple[int, ...] = (-2,), out_axes: tuple[int, ...] = (-1,),
          batch_axes: tuple[int, ...] = ()):
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=fan_in_axes, out_axis=out_axes,
        batch_axis=batch_axes)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, returned in the input dtype."""

    eps: float
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones,
                                                                  (self.axis_name,)),
                           (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * scale).astype(x.dtype)


def rope(x_BSND, theta: float):
    """Rotary position embedding (rotate-half form) on the last axis."""
    d = x_BSND.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    pos = jnp.arange(x_BSND.shape[1], dtype=jnp.float32)
    ang_SD = jnp.outer(pos, inv_freq)[None, :, None, :]
    sin, cos = jnp.sin(ang_SD), jnp.cos(ang_SD)
    x1, x2 = jnp.split(x_BSND.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSND.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention through ``jax.nn.dot_product_attention``."""

    cfg: Config

    @nn.compact
    def __call__(self, x_BSH):
        m, pol = self.cfg.model, precision.policy(self.cfg)
        d, dt = head_dim(m), pol.dtype

        def proj(name, heads, axes):
            w = self.param(name, nn.with_logical_partitioning(_init((0,), (1, 2)), axes),
                           (m.hidden, heads, d), jnp.dtype(m.param_dtype))
            return precision.dot(pol, name, x_BSH, gathered(w, axes, dt))  # [B, S, heads, D]

        q_BSND = proj("q", m.num_heads, ("embed", "heads", "head_dim"))
        k_BSKD = proj("k", m.num_kv_heads, ("embed", "kv_heads", "head_dim"))
        v_BSKD = proj("v", m.num_kv_heads, ("embed", "kv_heads", "head_dim"))
        if m.qk_norm:
            q_BSND = RMSNorm(m.norm_eps, "head_dim", name="q_norm")(q_BSND)
            k_BSKD = RMSNorm(m.norm_eps, "head_dim", name="k_norm")(k_BSKD)
        q_BSND, k_BSKD = rope(q_BSND, m.rope_theta), rope(k_BSKD, m.rope_theta)
        o_BSND = jax.nn.dot_product_attention(q_BSND, k_BSKD, v_BSKD, is_causal=True)
        o_axes = ("heads", "head_dim", "embed")
        wo = self.param("o", nn.with_logical_partitioning(_init((0, 1), (2,)), o_axes),
                        (m.num_heads, d, m.hidden), jnp.dtype(m.param_dtype))
        return precision.dot(pol, "o", o_BSND, gathered(wo, o_axes, dt), n=2)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP: (silu(x @ wi_0) * (x @ wi_1)) @ wo."""

    ffn: int
    cfg: Config

    @nn.compact
    def __call__(self, x_BSH):
        m, pol = self.cfg.model, precision.policy(self.cfg)
        dt, pdt = pol.dtype, jnp.dtype(m.param_dtype)
        part = nn.with_logical_partitioning
        wi_0 = self.param("wi_0", part(_init(), ("embed", "mlp")), (m.hidden, self.ffn), pdt)
        wi_1 = self.param("wi_1", part(_init(), ("embed", "mlp")), (m.hidden, self.ffn), pdt)
        wo = self.param("wo", part(_init(), ("mlp", "embed")), (self.ffn, m.hidden), pdt)
        up, down = ("embed", "mlp"), ("mlp", "embed")
        h_BSF = (nn.silu(precision.dot(pol, "wi_0", x_BSH, gathered(wi_0, up, dt)))
                 * precision.dot(pol, "wi_1", x_BSH, gathered(wi_1, up, dt)))
        return precision.dot(pol, "wo", h_BSF, gathered(wo, down, dt))


class MoEBlock(nn.Module):
    """Routed experts (dropless) plus optional shared experts.

    With an ``ep_plan`` the experts run expert-parallel on the context mesh (``ep_moe``);
    without one, on this device (``dropless_moe``).
    """

    cfg: Config
    ep_plan: EPPlan | None = None

    @nn.compact
    def __call__(self, x_BSH):
        m, e = self.cfg.model, self.cfg.moe
        pdt, part = jnp.dtype(m.param_dtype), nn.with_logical_partitioning
        E, H, F = e.num_experts, m.hidden, e.expert_ffn
        gate_HE = self.param("gate", part(nn.initializers.normal(0.02), ("embed", "expert_gate")),
                             (H, E), jnp.float32)
        expert_init = _init((1,), (2,), (0,))
        wi_0_EHF = self.param("wi_0", part(expert_init, ("expert", "embed", "mlp")), (E, H, F), pdt)
        wi_1_EHF = self.param("wi_1", part(expert_init, ("expert", "embed", "mlp")), (E, H, F), pdt)
        wo_EFH = self.param("wo", part(expert_init, ("expert", "mlp", "embed")), (E, F, H), pdt)
        bias_E = self.variable("moe_state", "expert_bias", jnp.zeros, (E,), jnp.float32).value
        B, S, _ = x_BSH.shape
        pol = precision.policy(self.cfg)
        x_TH = x_BSH.reshape(B * S, H)
        w = (wi_0_EHF.astype(pol.dtype), wi_1_EHF.astype(pol.dtype), wo_EFH.astype(pol.dtype))
        expert_x_TH = None
        if pol.fp8:  # the router keeps x_TH; the experts get e4m3 rows and weights
            expert_x_TH = precision.quantize_operand(self, "expert_input", x_TH, pol)
            w = tuple(precision.quantize_operand(self, f"{n}_kernel", w_, pol)
                      for n, w_ in zip(("wi_0", "wi_1", "wo"), w))
        kwargs = dict(top_k=e.top_k, score_function=e.score_function,
                      normalize_top_k=e.normalize_top_k, num_groups=e.num_groups or None,
                      group_top_k=e.group_top_k or None, routed_scaling=e.routed_scaling,
                      expert_bias=bias_E, backend=e.backend, tile_rows=e.tile_rows or None,
                      seq_len=S, expert_input=expert_x_TH)
        operands = (x_TH, gate_HE, *w)
        if self.ep_plan is None:
            y_TH, stats = dropless_moe(*operands, **kwargs)
            n = jnp.float32(B * S * e.top_k)
            stats.update(overflow=jnp.zeros((), bool), recv_rows=n, recv_slots=n,
                         max_pair_load=jnp.float32(0), slow_rows=jnp.float32(0))
        else:
            y_TH, stats = ep_moe(*operands, plan=self.ep_plan, **kwargs)
        if pol.fp8:  # e5m2 gradient into the experts' output
            y_TH = precision.quantize_cotangent(self, "expert_output_grad", y_TH, pol)
        y_BSH = y_TH.reshape(B, S, H)
        if e.num_shared_experts:
            width = e.num_shared_experts * (e.shared_ffn or F)
            y_BSH = y_BSH + SwiGLU(width, self.cfg, name="shared")(x_BSH)
        return y_BSH, {k: stats[k] for k in STAT_KEYS}


def _attention_sublayer(block: nn.Module, x_BSH):
    """``attn(attn_norm(x))`` as submodules of ``block`` (a function, so ``train.remat=moe``
    can rematerialise it alone)."""
    return Attention(block.cfg, name="attn")(RMSNorm(block.cfg.model.norm_eps, name="attn_norm")(x_BSH))


class Block(nn.Module):
    """Pre-norm transformer block; ``dense`` selects a SwiGLU MLP instead of MoE."""

    cfg: Config
    dense: bool
    ep_plan: EPPlan | None = None

    @nn.compact
    def __call__(self, x_BSH):
        m = self.cfg.model
        x_BSH = x_BSH + remat.wrap_attention(_attention_sublayer, self.cfg.train.remat)(self, x_BSH)
        h_BSH = RMSNorm(m.norm_eps, name="mlp_norm")(x_BSH)
        if self.dense:
            return x_BSH + SwiGLU(m.dense_ffn, self.cfg, name="mlp")(h_BSH), None
        y_BSH, stats = MoEBlock(self.cfg, self.ep_plan, name="moe")(h_BSH)
        return x_BSH + y_BSH, stats


class Transformer(nn.Module):
    """Token ids [B,S] -> (fp32 logits [B,S,V], per-MoE-layer stats stacked on axis 0)."""

    cfg: Config
    ep_plan: EPPlan | None = None  # expert-parallel MoE layers on the context mesh

    @nn.compact
    def __call__(self, tokens_BS):
        m = self.cfg.model
        dt = precision.policy(self.cfg).dtype  # bf16 under fp8: embedding and head unquantized
        embed_VH = self.param("embed", nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")), (m.vocab_size, m.hidden),
            jnp.dtype(m.param_dtype))
        table_VH = gathered(embed_VH, ("vocab", "embed"), dt)
        x_BSH = table_VH[tokens_BS]
        x_BSH = nn.with_logical_constraint(x_BSH, ACTIVATION_AXES)
        layer_stats = []
        block_cls = remat.wrap_block(Block, self.cfg.train.remat)
        for i in range(m.num_layers):
            x_BSH, stats = block_cls(self.cfg, dense=i < m.first_dense_layers,
                                  ep_plan=self.ep_plan, name=f"layer_{i}")(x_BSH)
            x_BSH = nn.with_logical_constraint(x_BSH, ACTIVATION_AXES)
            if stats is not None:
                layer_stats.append(stats)
        x_BSH = RMSNorm(m.norm_eps, name="final_norm")(x_BSH)
        if m.tie_embeddings:
            # The embedding is initialised at unit scale; 1/sqrt(H) keeps tied logits O(1).
            logits_BSV = (x_BSH @ table_VH.T) * (m.hidden ** -0.5)
        else:
            head_HV = self.param("lm_head", nn.with_logical_partitioning(
                _init(), ("embed", "vocab")), (m.hidden, m.vocab_size), jnp.dtype(m.param_dtype))
            logits_BSV = x_BSH @ gathered(head_HV, ("embed", "vocab"), dt)
        stats_L = {k: jnp.stack([s[k] for s in layer_stats]) for k in STAT_KEYS} if layer_stats else {}
        return logits_BSV.astype(jnp.float32), stats_L
