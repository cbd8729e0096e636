"""``read_toml``: the one TOML reader of the kit (config presets, cluster presets, calibration,
compute and site files), each caller raising its own error type."""

from __future__ import annotations

import os
import tomllib


def read_toml(path: str | os.PathLike[str], error: type[Exception], what: str = "") -> dict:
    """The tables of the TOML file at ``path``. A file that is not valid TOML or cannot be
    read raises ``error`` ("<what><path>: ..."), so each caller keeps its own error type."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise error(f"{what}{path}: not valid TOML: {err}") from None
    except OSError as err:
        raise error(f"{what}{path}: {err.strerror or err}") from None
