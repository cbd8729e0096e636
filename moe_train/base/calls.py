"""``from_names``: a call whose keyword arguments come by name from another object's
attributes (a parsed command line, or a record whose fields a larger one repeats), so that no
``x=args.x`` line is written for each."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")  # what the target returns


def from_names(target: Callable[..., R], source: object, **given: Any) -> R:
    """``target(**given)`` (a function or a dataclass), each of its other keyword parameters
    read from ``source``'s attribute of the same name where it has one (the rest keep their
    defaults): a parsed command line (an option's dest names the parameter it sets), or a
    record whose fields a larger one repeats, passed on without an ``x=args.x`` line each."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [
        p.name
        for p in inspect.signature(target).parameters.values()
        if p.kind in named and p.name not in given and hasattr(source, p.name)
    ]
    return target(**{n: getattr(source, n) for n in names}, **given)
