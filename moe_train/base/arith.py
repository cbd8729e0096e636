"""Integer arithmetic the kit's sizes share."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, for non-negative ``a`` and positive ``b``."""
    return -(-a // b)
