"""Compute precision: fp32, bf16, and fp8 matmuls with per-tensor scaling (``[precision]``).

``fp32`` and ``bf16`` cast the weights to that dtype at use. ``fp8`` computes in bf16 and
quantizes the operands of the matmuls to fp8: e4m3 for the forward operands (activations and
weights), e5m2 for the gradient flowing back into each matmul's output. Master weights,
optimizer state, the router (logits, softmax/sigmoid, top-k) and every loss stay fp32; the
embedding and the LM head stay bf16.

Two fp8 backends:
  xla  the dense projections are ``fp8_matmul``: ``lax.dot_general`` on fp8 operands with
       fp32 accumulation, the per-tensor scales applied to the output, in the forward and
       both backward matmuls. XLA:GPU compiles these to fp8 GEMMs (Triton fusions with f8
       operands in jax 0.11.2; it no longer rewrites "dequantize, then a bf16 dot" into a
       cuBLASLt fp8 GEMM, seen on an H200); XLA:CPU computes them exactly from the fp8
       values. The routed experts are quantized around the grouped GEMM (q/dq of the expert
       input rows, the three expert weights with one scale each over all experts, and the
       cotangent of the experts' combined output); the grouped GEMM itself runs in bf16 on
       the q/dq values.
  te   Transformer Engine's ``make_dot_general_cls`` for the dense projections
       (``moe_train.model.precision_te``); the experts use the xla q/dq.

Scales are per tensor. ``delayed``: the scale comes from the largest amax in the history
of past steps (this step's amax while the history is still empty, i.e. on the first step);
``current``: from this step's amax. Either way the step rolls its amax into the history.
scale = amax * 2**margin / fp8_max; a tensor is quantized as x / scale.

The scaling state of every quantized tensor, ``{"scale": f32[], "amax_history": f32[history]}``,
lives in the flax collection ``_overwrite_with_gradient`` (FP8_COLLECTION, the name flax's
fp8 ops and Transformer Engine use). The custom VJPs below return each tensor's new state as
the "gradient" of its old state; the train step differentiates with respect to the
collection and stores that gradient as the new state (never through the optimizer). Inside
jit every amax is a global max (XLA all-reduces over the mesh), so all devices use the same
scales; nothing here runs inside ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_train.base.platform import Platform, as_platform
from moe_train.config import Config, ConfigError, PrecisionConfig, compute_dtype
from moe_train.model import precision_te
from moe_train.moe.vjp import custom_vjp

FP8_COLLECTION = "_overwrite_with_gradient"
E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, max 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, max 57344


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one quantized tensor gets its scale (static: hashable for custom_vjp)."""

    current: bool  # scale from this step's amax; False: from the amax history (delayed)
    margin: int  # scale = amax * 2**margin / fp8_max


@dataclasses.dataclass(frozen=True)
class Policy:
    """The resolved ``[precision]`` of a run on this platform."""

    dtype: jnp.dtype  # activations and weight copies
    fp8: bool  # quantize the matmuls
    backend: str  # "xla" or "te" (dense projections; experts always xla)
    recipe: Recipe  # of the xla q/dq (the experts' under te)
    history: int  # amax-history steps
    recipe_name: str  # precision.fp8_recipe (for Transformer Engine)


# ----------------------------------------------------------------------------- scaling


def init_meta(history: int) -> dict:
    """Fresh scaling state of one tensor: scale 1, empty amax history."""
    return {"scale": jnp.ones((), jnp.float32), "amax_history": jnp.zeros((history,), jnp.float32)}


def fp8_max(q_dtype) -> float:
    return float(jnp.finfo(q_dtype).max)


def update_meta(x, meta: dict, q_dtype, recipe: Recipe) -> dict:
    """The state this step uses and keeps: the new scale and the history rolled with amax(x)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    history = meta["amax_history"]
    past = jnp.max(history)
    use = amax if recipe.current else jnp.where(past > 0, past, amax)
    scale = use * (2.0**recipe.margin) / fp8_max(q_dtype)
    scale = jnp.where((use > 0) & jnp.isfinite(use), scale, meta["scale"])
    return {"scale": scale, "amax_history": jnp.roll(history, 1).at[0].set(amax)}


def to_fp8(x, scale, q_dtype):
    """``x / scale`` in ``q_dtype``, saturating at its largest finite value."""
    s = scale.astype(x.dtype)
    top = jnp.asarray(fp8_max(q_dtype), x.dtype)
    return jnp.clip(x / s, -top, top).astype(q_dtype)


def qdq(x, scale, q_dtype):
    """Quantize ``x / scale`` to ``q_dtype`` (saturating) and dequantize back to x's dtype.

    The fp8 values pass an optimization barrier: XLA:GPU (``xla_allow_excess_precision``)
    otherwise removes the convert pair and the rounding with it (seen in jax 0.11.2's
    optimized HLO: no f8 type left), so "fp8" would silently compute in bf16."""
    with jax.named_scope(f"qdq_{jnp.dtype(q_dtype).name}"):
        q = jax.lax.optimization_barrier(to_fp8(x, scale, q_dtype))
        return q.astype(x.dtype) * scale.astype(x.dtype)


@custom_vjp(nondiff_argnums=(2, 3))
def quantize(x, meta: dict, q_dtype, recipe: Recipe):
    """Forward q/dq of a matmul operand; the gradient passes straight through."""
    return qdq(x, update_meta(x, meta, q_dtype, recipe)["scale"], q_dtype)


def _quantize_fwd(x, meta, q_dtype, recipe):
    new = update_meta(x, meta, q_dtype, recipe)
    return qdq(x, new["scale"], q_dtype), new


def _quantize_bwd(q_dtype, recipe, new, g):
    return g, new  # the new state overwrites the old one as its "gradient"


quantize.defvjp(_quantize_fwd, _quantize_bwd)


@custom_vjp(nondiff_argnums=(2, 3))
def quantize_grad(y, meta: dict, q_dtype, recipe: Recipe):
    """Identity forward; q/dq of the cotangent of ``y`` in the backward pass."""
    return y


def _quantize_grad_fwd(y, meta, q_dtype, recipe):
    return y, meta


def _quantize_grad_bwd(q_dtype, recipe, meta, g):
    new = update_meta(g, meta, q_dtype, recipe)
    return qdq(g, new["scale"], q_dtype), new


quantize_grad.defvjp(_quantize_grad_fwd, _quantize_grad_bwd)


# ----------------------------------------------------------------------------- policy


def _te_reason(p: PrecisionConfig, platform: Platform) -> str | None:
    """Why Transformer Engine's fp8 cannot be used on ``platform`` (None when it can)."""
    if platform.name != "gpu":
        return f"Transformer Engine needs an NVIDIA GPU, this is {platform.name!r}"

    return precision_te.unavailable_reason(p.fp8_recipe, platform)


@functools.cache
def _resolve(p: PrecisionConfig, platform: Platform) -> tuple[str, str]:
    """(fp8 backend, why) for ``p`` on ``platform``; ConfigError where it cannot run."""
    if p.compute != "fp8":
        return "none", ""
    reason = None if p.fp8_backend == "xla" else _te_reason(p, platform)
    if p.fp8_backend == "te" and reason:
        raise ConfigError(f"precision.fp8_backend=te: {reason}; choose one of: auto, xla")
    if p.fp8_recipe == "mxfp8" and reason:
        raise ConfigError(
            f"precision.fp8_recipe=mxfp8 needs Transformer Engine: {reason}; choose one of: delayed, current"
        )
    if p.fp8_backend == "xla":
        return "xla", "precision.fp8_backend=xla"
    if reason:
        return "xla", f"Transformer Engine not used: {reason}"
    return "te", "Transformer Engine found"


def policy(p: PrecisionConfig, platform: Platform | str | None = None) -> Policy:
    """``[precision]`` resolved for ``platform`` (``base.platform.as_platform``; None: this
    process's). The model reads it once per ``ModelSettings`` (``moe_train.model.settings``)."""
    backend, _ = _resolve(p, as_platform(platform))
    # MXFP8 block scales are TE's alone; the experts' per-tensor q/dq then scales currently.
    recipe = Recipe(current=p.fp8_recipe != "delayed", margin=p.margin)
    return Policy(
        dtype=jnp.dtype(compute_dtype(p)),
        fp8=p.compute == "fp8",
        backend=backend if p.compute == "fp8" else "none",
        recipe=recipe,
        history=p.amax_history,
        recipe_name=p.fp8_recipe,
    )


def describe(cfg: Config, platform: Platform | str) -> str:
    """One log line: what runs in which precision on ``platform`` (``as_platform``), and why."""
    p = cfg.precision
    backend, why = _resolve(p, as_platform(platform))
    if p.compute != "fp8":
        return f"precision: {p.compute} compute, fp32 master weights, router and losses"
    dense = "Transformer Engine" if backend == "te" else "XLA fp8 q/dq"
    return (
        f"precision: fp8 ({p.fp8_recipe} scaling, amax history {p.amax_history}, margin "
        f"{p.margin}) in bf16; dense projections: {dense} ({why}); experts: XLA fp8 q/dq; "
        f"fp32 master weights, router and losses; bf16 embedding and LM head"
    )


# ----------------------------------------------------------------------------- in the model


def _meta(mod: nn.Module, name: str, pol: Policy) -> dict:
    return mod.variable(FP8_COLLECTION, name, init_meta, pol.history).value


def quantize_operand(mod: nn.Module, name: str, x, pol: Policy):
    """e4m3 q/dq of ``x`` with its scaling state ``name`` in ``mod``'s fp8 collection."""
    with jax.named_scope(f"fp8_quantize_{name}"):
        return quantize(x, _meta(mod, name, pol), E4M3, pol.recipe)


def quantize_cotangent(mod: nn.Module, name: str, y, pol: Policy):
    """Identity on ``y``; e5m2 q/dq of its cotangent, state ``name`` in ``mod``."""
    with jax.named_scope(f"fp8_quantize_{name}"):
        return quantize_grad(y, _meta(mod, name, pol), E5M2, pol.recipe)


class Fp8Dot(nn.Module):
    """``x`` contracted with ``w`` over x's last ``n`` and w's first ``n`` axes as fp8 GEMMs
    (``fp8_matmul``): state ``input``, ``kernel`` (e4m3) and ``output_grad`` (e5m2)."""

    pol: Policy
    n: int = 1

    @nn.compact
    def __call__(self, x, w):
        metas = [_meta(self, name, self.pol) for name in ("input", "kernel", "output_grad")]
        with jax.named_scope("fp8_matmul"):
            return fp8_matmul(x, w, *metas, self.n, self.pol.recipe)


def _quantized(x, meta: dict, q_dtype, recipe: Recipe):
    new = update_meta(x, meta, q_dtype, recipe)
    return to_fp8(x, new["scale"], q_dtype), new


@custom_vjp(nondiff_argnums=(5, 6))
def fp8_matmul(x, w, meta_x: dict, meta_w: dict, meta_g: dict, n: int, recipe: Recipe):
    """``x . w`` with both operands in e4m3 and the output's cotangent in e5m2: every one of
    the three matmuls takes fp8 operands (XLA:GPU emits fp8 GEMMs for them; a dequantize
    before a bf16 dot stays a bf16 GEMM there), accumulates in fp32 and applies the two
    per-tensor scales to its output. The metas' "gradients" are their new states."""
    return _fp8_matmul_fwd(x, w, meta_x, meta_w, meta_g, n, recipe)[0]


def _fp8_matmul_fwd(x, w, meta_x, meta_w, meta_g, n, recipe):
    qx, new_x = _quantized(x, meta_x, E4M3, recipe)
    qw, new_w = _quantized(w, meta_w, E4M3, recipe)
    y = jax.lax.dot_general(qx, qw, _dims(x.ndim, n), preferred_element_type=jnp.float32)
    y = (y * (new_x["scale"] * new_w["scale"])).astype(x.dtype)
    w_dtype = jnp.zeros((0,), w.dtype)  # carries w's dtype for its gradient
    return y, (qx, qw, new_x, new_w, meta_g, w_dtype)


def _fp8_matmul_bwd(n, recipe, res, g_y):
    qx, qw, new_x, new_w, meta_g, w_dtype = res
    qg, new_g = _quantized(g_y, meta_g, E5M2, recipe)
    batch = qx.ndim - n  # x = [batch..., k...], w = [k..., out...], g = [batch..., out...]
    dx = jax.lax.dot_general(
        qg,
        qw,
        ((tuple(range(batch, g_y.ndim)), tuple(range(n, qw.ndim))), ((), ())),
        preferred_element_type=jnp.float32,
    )
    dw = jax.lax.dot_general(
        qx, qg, ((tuple(range(batch)), tuple(range(batch))), ((), ())), preferred_element_type=jnp.float32
    )
    s_g = new_g["scale"]
    return (
        (dx * (s_g * new_w["scale"])).astype(g_y.dtype),
        (dw * (new_x["scale"] * s_g)).astype(w_dtype.dtype),
        new_x,
        new_w,
        new_g,
    )


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def _dims(x_ndim: int, n: int):
    return (tuple(range(x_ndim - n, x_ndim)), tuple(range(n))), ((), ())


def dot(pol: Policy, name: str, x, w, n: int = 1):
    """The dense projection ``x . w`` (x's last n axes with w's first n) under ``pol``, inside
    the calling module's ``nn.compact`` method (fp8 state goes to a child ``<name>_fp8``)."""
    if not pol.fp8:
        return jax.lax.dot_general(x, w, _dims(x.ndim, n))
    if pol.backend == "te":
        return precision_te.dot(name, x, w, _dims(x.ndim, n), pol.recipe_name, pol.history, pol.recipe.margin)
    return Fp8Dot(pol, n, name=f"{name}_fp8")(x, w)
