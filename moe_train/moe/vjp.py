"""``custom_vjp(nondiff_argnums=...)``: ``functools.partial(jax.custom_vjp, nondiff_argnums=...)``
as a decorator that keeps the decorated function's return type for type checkers. Through
``functools.partial`` pyright leaves ``jax.custom_vjp``'s return type unsolved, so every
result of such a function read as ``object``; at run time the two are the same call."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import jax

R = TypeVar("R")


def custom_vjp(*, nondiff_argnums: Sequence[int]) -> Callable[[Callable[..., R]], jax.custom_vjp[R]]:
    return cast(Any, functools.partial(jax.custom_vjp, nondiff_argnums=tuple(nondiff_argnums)))
