"""Command-line pieces the kit's tool commands share (``bench``, ``gpucheck``)."""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path


def add_out_option(parser: argparse.ArgumentParser, default: str, layout: str) -> None:
    """``--out OUT`` (a ``Path``, default ``default``): results go to ``OUT/<layout>``."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(default),
        help=f"results go to OUT/{layout} (default: {default})",
    )


def utc_stamp() -> str:
    """Now in UTC, as a results folder's name: ``20261207T020304Z``."""
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def comma_list(text: str) -> list[str]:
    """The names of a comma-separated option value, empty ones dropped."""
    return [s for s in text.split(",") if s]
