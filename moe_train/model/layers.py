"""Building blocks shared by the model's modules: weight use under FSDP, initialisers, RMSNorm,
the dense SwiGLU MLP and the base of the attention layers.

Shape letters (``moe_train.base.notation``): B batch, S sequence, H hidden, F ffn width, N query
heads, Y key/value heads, D query/key head dim, J value head dim.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_train.model import attention, precision, rope
from moe_train.model.settings import ModelSettings
from moe_train.moe.vjp import custom_vjp

ACTIVATION_AXES = ("activation_batch", "activation_seq", "activation_embed")


# FSDP-sharded weight axes -> the (unsharded) axis a weight has while in use
# (every axis moe_train.parallel.sharding may split; the router is gathered by the MoE layer)
IN_USE = {
    "embed": "activation_embed",
    "q_lora": "activation_latent",
    "kv_lora": "activation_latent",
    "kv_lora_rope": "activation_latent",
    "heads": "activation_heads",
    "kv_heads": "activation_kv_heads",
    "mlp": "activation_mlp",
    "vocab": "activation_vocab",
    "mtp_concat": "activation_mtp_concat",
}


def gathered(w, axes: tuple[str, ...], dtype):
    """A weight cast for use, constrained whole along its FSDP axes (``embed``, the MLA
    latents): FSDP all-gathers the weight rather than letting the partitioner reshard
    activations to match it. The cast runs on the shard, so the all-gather moves the compute
    dtype (XLA:GPU otherwise gathered fp32 master weights, the embedding and head among them:
    half the FSDP bytes and whole-vocabulary fp32 buffers); the gradient is cast back to the
    master dtype on its way to the shard (``_cast_gather``; where the matmul that makes it
    already holds partial sums, XLA:GPU reduces those in the compute dtype first: ``make
    compile`` shows bf16 reduce-scatters of the experts' gradients)."""
    use_axes = tuple(IN_USE.get(a, a) for a in axes)
    rules = nn.get_logical_axis_rules()
    if not rules or jnp.dtype(dtype) == w.dtype:
        return nn.with_logical_constraint(w.astype(dtype), use_axes)
    return _cast_gather(w, jnp.dtype(dtype), w.dtype, axes, use_axes, tuple(rules))


@custom_vjp(nondiff_argnums=(1, 2, 3, 4, 5))
def _cast_gather(w, dtype, master, axes, use_axes, rules) -> jax.Array:
    """``w`` (dtype ``master``) cast to ``dtype`` on its shard (``axes``), then whole along
    ``use_axes``."""
    shard = nn.with_logical_constraint(w.astype(dtype), axes, rules=rules)
    return nn.with_logical_constraint(shard, use_axes, rules=rules)


def _cast_gather_fwd(w, dtype, master, axes, use_axes, rules):
    return _cast_gather(w, dtype, master, axes, use_axes, rules), None


def _cast_gather_bwd(dtype, master, axes, use_axes, rules, _, g):
    """The cotangent in the master dtype before it is reduced onto the shard."""
    g = nn.with_logical_constraint(g.astype(master), use_axes, rules=rules)
    return (nn.with_logical_constraint(g, axes, rules=rules),)


_cast_gather.defvjp(_cast_gather_fwd, _cast_gather_bwd)


def fan_in_init(
    fan_in_axes: tuple[int, ...] = (-2,), out_axes: tuple[int, ...] = (-1,), batch_axes: tuple[int, ...] = ()
):
    """Truncated normal of variance 1 / fan-in (``fan_in_axes`` of the weight's shape)."""
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=fan_in_axes, out_axis=out_axes, batch_axis=batch_axes
    )


def weight(
    mod: nn.Module,
    name: str,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    fan_in_axes: tuple[int, ...] = (0,),
):
    """A projection weight of ``mod`` with logical ``axes``; its output axes are those after
    ``fan_in_axes`` (which lead). Master dtype ``model.param_dtype``."""
    out_axes = tuple(range(len(fan_in_axes), len(shape)))
    init = nn.with_logical_partitioning(fan_in_init(fan_in_axes, out_axes), axes)
    return mod.param(name, init, shape, jnp.dtype(mod.cfg.model.param_dtype))


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, returned in the input dtype."""

    eps: float
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
            (x.shape[-1],),
            jnp.float32,
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * scale).astype(x.dtype)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP: (silu(x @ wi_0) * (x @ wi_1)) @ wo."""

    ffn: int
    cfg: ModelSettings

    @nn.compact
    def __call__(self, x_BSH):
        m, pol = self.cfg.model, self.cfg.policy
        dt = pol.dtype
        up, down = ("embed", "mlp"), ("mlp", "embed")
        wi_0 = weight(self, "wi_0", (m.hidden, self.ffn), up)
        wi_1 = weight(self, "wi_1", (m.hidden, self.ffn), up)
        wo = weight(self, "wo", (self.ffn, m.hidden), down)
        h_BSF = nn.silu(precision.dot(pol, "wi_0", x_BSH, gathered(wi_0, up, dt))) * precision.dot(
            pol, "wi_1", x_BSH, gathered(wi_1, up, dt)
        )
        return precision.dot(pol, "wo", h_BSF, gathered(wo, down, dt))


class CausalAttention(nn.Module):
    """Base of the attention layers (GQA, MLA): [B, S, H] -> [B, S, H]. The subclass's ``qkv``
    projects (and RoPEs at ``positions_BS``) the queries, keys and values; here they are
    attended causally through ``moe_train.model.attention`` (``model.attention`` resolved for
    this platform; with ``segment_ids_BS`` inside each packed document) and projected by ``o``."""

    cfg: ModelSettings

    @nn.compact
    def __call__(self, x_BSH, segment_ids_BS=None, positions_BS=None):
        m, pol = self.cfg.model, self.cfg.policy
        q_BSND, k_BSYD, v_BSYJ = self.qkv(x_BSH, positions_BS)
        D = q_BSND.shape[-1]
        impl, _ = attention.resolve(
            m.attention,
            platform=self.cfg.target,
            dtype=pol.dtype,
            head_dim=D,
            v_head_dim=v_BSYJ.shape[-1],
            seq_len=x_BSH.shape[1],
        )
        o_BSNJ = attention.attend(
            q_BSND,
            k_BSYD,
            v_BSYJ,
            implementation=impl,
            segment_ids_BS=segment_ids_BS,
            block=m.attention_block,
            scale=rope.softmax_scale_factor(self.cfg.rope) / math.sqrt(D),
            platform=self.cfg.target,
        )
        o_axes = ("heads", "head_dim", "embed")
        wo = weight(self, "o", (*o_BSNJ.shape[2:], m.hidden), o_axes, fan_in_axes=(0, 1))
        return precision.dot(pol, "o", o_BSNJ, gathered(wo, o_axes, pol.dtype), n=2)

    def qkv(self, x_BSH, positions_BS):
        """(q [B, S, N, D], k [B, S, Y, D], v [B, S, Y, J]), RoPE applied: each subclass
        (``transformer.Attention``, ``mla.MLA``) says how it projects them."""
        raise NotImplementedError
