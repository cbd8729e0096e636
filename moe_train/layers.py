"""Building blocks shared by the model's modules: weight use under FSDP, initialisers, RMSNorm
and the dense SwiGLU MLP.

Letter key (the model's): B batch, S sequence, H hidden, F ffn width.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_train import precision
from moe_train.config import Config

ACTIVATION_AXES = ("activation_batch", "activation_seq", "activation_embed")


# FSDP-sharded weight axes -> the (unsharded) axis a weight has while in use
IN_USE = {"embed": "activation_embed", "q_lora": "activation_latent",
          "kv_lora": "activation_latent"}


def gathered(w, axes: tuple[str, ...], dtype):
    """A weight cast for use, constrained whole along its FSDP axes (``embed``, the MLA
    latents): FSDP all-gathers the weight rather than letting the partitioner reshard
    activations to match it."""
    use_axes = tuple(IN_USE.get(a, a) for a in axes)
    return nn.with_logical_constraint(w.astype(dtype), use_axes)


def fan_in_init(fan_in_axes: tuple[int, ...] = (-2,), out_axes: tuple[int, ...] = (-1,),
                batch_axes: tuple[int, ...] = ()):
    """Truncated normal of variance 1 / fan-in (``fan_in_axes`` of the weight's shape)."""
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=fan_in_axes, out_axis=out_axes,
        batch_axis=batch_axes)


def weight(mod: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...],
           fan_in_axes: tuple[int, ...] = (0,)):
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
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones,
                                                                  (self.axis_name,)),
                           (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * scale).astype(x.dtype)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP: (silu(x @ wi_0) * (x @ wi_1)) @ wo."""

    ffn: int
    cfg: Config

    @nn.compact
    def __call__(self, x_BSH):
        m, pol = self.cfg.model, precision.policy(self.cfg)
        dt = pol.dtype
        up, down = ("embed", "mlp"), ("mlp", "embed")
        wi_0 = weight(self, "wi_0", (m.hidden, self.ffn), up)
        wi_1 = weight(self, "wi_1", (m.hidden, self.ffn), up)
        wo = weight(self, "wo", (self.ffn, m.hidden), down)
        h_BSF = (nn.silu(precision.dot(pol, "wi_0", x_BSH, gathered(wi_0, up, dt)))
                 * precision.dot(pol, "wi_1", x_BSH, gathered(wi_1, up, dt)))
        return precision.dot(pol, "wo", h_BSF, gathered(wo, down, dt))
