"""Transformer Engine's fp8 GEMMs for the dense projections (GPU, where TE's JAX API imports).

``precision.fp8_backend`` ``auto`` picks this where ``transformer_engine.jax`` imports on a GPU
that supports the recipe, ``te`` requires it; otherwise ``moe_train.model.precision``'s XLA q/dq
runs and the trainer logs why. The routed experts always use the XLA q/dq (TE's quantized
grouped GEMM supports MXFP8 only and would replace the grouped-GEMM backend).

``precision.fp8_recipe`` -> TE recipe (``transformer_engine.common.recipe``):
  delayed  DelayedScaling(margin, HYBRID: e4m3 forward / e5m2 backward, amax_history_len,
           amax_compute_algo "max"); Hopper (sm_90) and newer
  current  Float8CurrentScaling(HYBRID); Hopper and newer
  mxfp8    MXFP8BlockScaling() (32-element blocks, e8m0 scales); Blackwell (sm_100) and newer

``te_flax.make_dot_general_cls(recipe)`` returns a flax module used in place of
``lax.dot_general`` (no batch dimensions): the kernel stays this kit's parameter (fp32 master,
cast to bf16 at use). DelayedScaling keeps its amax histories and scales in the flax
collection ``_overwrite_with_gradient``, the collection and overwrite-with-gradient rule of
``moe_train.model.precision``, so the train step updates and checkpoints them the same way.
Under ``train.remat=matmuls`` TE's GEMMs are not ``dot_general``s, so they are recomputed.
"""

# transformer_engine is imported only where installed (GPU containers), never from .venv
# pyright: reportMissingImports=false
from __future__ import annotations

import functools

import jax

from moe_train.base.imports import import_failure
from moe_train.base.platform import Platform, or_here

MIN_COMPUTE_CAPABILITY = {"delayed": 9.0, "current": 9.0, "mxfp8": 10.0}


def _import_error() -> str | None:
    """Why TE's fp8 cannot be used here (its ``make_dot_general_cls`` is TE 2.x's)."""
    te = "transformer_engine."
    recipe, flax = te + "common.recipe", te + "jax.flax:make_dot_general_cls"
    return import_failure("transformer_engine.jax", recipe, flax)


def unavailable_reason(recipe_name: str, platform: Platform | None = None) -> str | None:
    """Why TE cannot run ``recipe_name`` on ``platform`` (None: this process's; None if it can)."""
    err = _import_error()
    if err:
        return err
    cc = or_here(platform).cc
    need = MIN_COMPUTE_CAPABILITY[recipe_name]
    if cc is not None and cc < need:
        return f"fp8_recipe={recipe_name} needs compute capability >= {need}, found sm_{cc}"
    return None


@functools.cache
def dot_general_cls(recipe_name: str, history: int, margin: int):
    """TE's dot_general module class for ``recipe_name``."""
    from transformer_engine.common import recipe
    from transformer_engine.jax import flax as te_flax

    hybrid = recipe.Format.HYBRID
    make = {
        "delayed": lambda: recipe.DelayedScaling(
            margin=margin, fp8_format=hybrid, amax_history_len=history, amax_compute_algo="max"
        ),
        "current": lambda: recipe.Float8CurrentScaling(fp8_format=hybrid),
        "mxfp8": lambda: recipe.MXFP8BlockScaling(),
    }
    return te_flax.make_dot_general_cls(make[recipe_name]())


def dot(name: str, x, w, dims, recipe_name: str, history: int, margin: int):
    """``lax.dot_general(x, w, dims)`` through TE, as a child ``<name>_te`` of the calling
    module (inside its ``nn.compact`` method)."""
    with jax.named_scope(f"te_fp8_{name}"):
        return dot_general_cls(recipe_name, history, margin)(name=f"{name}_te")(x, w, dims)
