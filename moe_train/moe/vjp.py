"""Custom VJPs. ``custom_vjp(nondiff_argnums=...)``: ``functools.partial(jax.custom_vjp, ...)``
as a decorator that keeps the decorated function's return type for type checkers. Through
``functools.partial`` pyright leaves ``jax.custom_vjp``'s return type unsolved, so every
result of such a function read as ``object``; at run time the two are the same call.
``vary``/``varying_axes``: an operand's or a kernel output's varying mesh axes inside
``shard_map``, which a custom VJP's result must carry."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import jax
from jax import lax

R = TypeVar("R")


def custom_vjp(*, nondiff_argnums: Sequence[int]) -> Callable[[Callable[..., R]], jax.custom_vjp[R]]:
    return cast(Any, functools.partial(jax.custom_vjp, nondiff_argnums=tuple(nondiff_argnums)))


def varying_axes(*arrays) -> tuple:
    """Mesh axes along which any of ``arrays`` varies inside ``shard_map`` (else ())."""
    axes = frozenset()
    for a in arrays:
        mat = getattr(jax.typeof(a), "manual_axis_type", None)
        axes |= getattr(mat, "varying", frozenset())
    return tuple(sorted(axes))


def vary(a, axes: tuple):
    """``a`` typed as varying along ``axes`` (a no-op outside shard_map).

    Called on the operands before the custom VJP, so that JAX's transpose of this cast
    sums the weight gradients over the axes the weights do not vary along (the token axes).
    """
    missing = tuple(ax for ax in axes if ax not in varying_axes(a))
    return lax.pcast(a, missing, to="varying") if missing else a
