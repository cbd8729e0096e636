"""Whether an optional kernel library imports here: one line saying why not, for the
``*_unavailable`` checks that choose kernels before anything compiles."""

from __future__ import annotations

import functools
import importlib


@functools.cache
def import_failure(what: str, *paths: str) -> str | None:
    """Why ``what`` cannot be used here, "cannot import WHAT (Type: message)"; None when every
    path imports. A path is a module ("pkg.mod") or one of its attributes ("pkg.mod:name").
    Any exception counts: an ImportError, an OSError from missing CUDA libraries, an
    AttributeError from a release that lacks the name."""
    try:
        for path in paths:
            module, _, name = path.partition(":")
            loaded = importlib.import_module(module)
            if name:
                getattr(loaded, name)
    except Exception as err:  # noqa: BLE001 (see the docstring)
        return f"cannot import {what} ({type(err).__name__}: {err})"
    return None
