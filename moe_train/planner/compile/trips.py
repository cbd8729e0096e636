"""A loop's trip count where XLA's backend config gives none, read from its own code.

XLA writes ``known_trip_count`` on most loops, but not on the one it has rewritten (the
micro-batch loop, once XLA:GPU peels its first and last iterations into the caller and its
induction variable starts at 1). That loop still carries ``known_induction_variable`` (the
tuple index of its counter) and plain arithmetic: the counter starts at a constant (through
copies), the condition compares it with a constant, and the body adds a constant to it
(each possibly inside a one-op fusion). ``trip`` reads the three and counts the runs; any
other form (a bound computed at run time: the tiled experts' walks) gives None.
"""

from __future__ import annotations

import math
import re

from moe_train.planner.compile.hlo import Instr

_INDUCTION = re.compile(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}')
_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}


def _constant(name: str, by_name: dict[str, Instr]) -> int | None:
    """The integer a scalar instruction holds: a constant, through copies and bitcasts."""
    while (ins := by_name.get(name)) is not None:
        if ins.op == "constant":
            m = re.match(r"(-?\d+)\)", ins.rest)
            return int(m.group(1)) if m else None
        if ins.op not in ("copy", "bitcast") or not ins.operands:
            return None
        name = ins.operands[0]
    return None


def _root(ins: Instr, comps: dict[str, list[Instr]]) -> tuple[Instr, dict[str, Instr]]:
    """A one-op fusion's operation (with its computation's instructions), else ``ins``."""
    if ins.op == "fusion" and (called := comps.get(ins.attr(r"calls=%([^\s,]+)") or "")):
        return called[-1], {i.name: i for i in called}
    return ins, {}


def _bound(cond: list[Instr], comps: dict[str, list[Instr]]) -> tuple[str, int] | None:
    """(direction, constant) of ``counter <direction> constant``, the condition's root."""
    root, inner = _root(cond[-1], comps)
    if root.op != "compare" or len(root.operands) != 2:
        return None
    where = {**{i.name: i for i in cond}, **inner}
    direction = root.attr(r"direction=([A-Z]+)")
    left, right = (_constant(o, where) for o in root.operands)
    if direction not in _FLIP or (left is None) == (right is None):
        return None
    return (direction, right) if right is not None else (_FLIP[direction], left)  # pyright: ignore[reportReturnType]


def _step(body: list[Instr], index: int, comps: dict[str, list[Instr]]) -> int | None:
    """The constant the body adds to the counter (tuple element ``index`` of its root)."""
    by_name = {i.name: i for i in body}
    root = body[-1] if body else None
    if root is None or root.op != "tuple" or len(root.operands) <= index:
        return None
    add, inner = _root(by_name.get(root.operands[index]) or root, comps)
    if add.op != "add" or len(add.operands) != 2:
        return None
    found = [c for o in add.operands if (c := _constant(o, {**by_name, **inner})) is not None]
    return found[0] if len(found) == 1 else None


def trip(loop: Instr, caller: list[Instr], comps: dict[str, list[Instr]]) -> int | None:
    """How many times the while ``loop`` (an instruction of ``caller``) runs its body."""
    m = _INDUCTION.search(loop.rest)
    body = comps.get(loop.attr(r"body=%([^\s,]+)") or "", [])
    cond = comps.get(loop.attr(r"condition=%([^\s,]+)") or "", [])
    if not (m and body and cond and loop.operands):
        return None
    index, by_name = int(m.group(1)), {i.name: i for i in caller}
    init_tuple = by_name.get(loop.operands[0])
    if init_tuple is None or init_tuple.op != "tuple" or len(init_tuple.operands) <= index:
        return None
    start, bound, step = (
        _constant(init_tuple.operands[index], by_name),
        _bound(cond, comps),
        _step(body, index, comps),
    )
    if start is None or bound is None or not step:
        return None
    direction, end = bound
    inclusive = direction in ("LE", "GE")
    if (direction in ("LT", "LE")) != (step > 0):
        return None
    span = (end - start) / step + (1 if inclusive else 0)
    return max(0, math.ceil(span) if not inclusive else math.floor(span))
