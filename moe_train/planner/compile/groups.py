"""Which devices a collective of the scheduled HLO runs over: its first replica group.

XLA writes a collective's groups in one of three forms:

- a list: ``replica_groups={{0,1,2,3},{4,5,6,7}}`` (``{}``: one group of every device);
- an iota: ``replica_groups=[G,S]<=[d0,d1,...]T(p0,p1,...)``: the device ids 0..N-1 laid out
  as ``[d0, d1, ...]``, transposed by ``p`` (when given), read as G groups of S;
- a mesh: ``replica_groups=mesh['axis_0'=a0,'axis_1'=a1,...], device_ids=([d...]T(p...))
  {'axis_k',...}``: the device ids (an iota as above; without ``device_ids``, 0..N-1 in
  order) laid out as the mesh, and each group the devices that differ only along the named
  axes.

``extent``'s span is what the step-time model asks of a collective
(``moe_train.planner.steptime.link_bytes_per_s``):
the distance from the group's lowest device id to its highest, plus one. A job's ranks fill
its NVLink domains in order (``topology.placement``), so a group spanning no more than a
domain's GPUs runs over NVLink, a wider one over the network.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np

_LIST = re.compile(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)?\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))? \{([^}]*)\}"
)
_AXIS = re.compile(r"'([^']+)'=(\d+)")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = _ints(dims)
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose(_ints(perm)) if perm else ids


def first_group(attrs: str) -> tuple[int, ...] | None:
    """The device ids of a collective's first replica group, from its attribute text; None
    where it names every device (``{}``) or names none this module reads."""
    if m := _LIST.search(attrs):
        return tuple(_ints(m.group(1).split("}", 1)[0].strip("{"))) if m.group(1) else None
    if m := _IOTA.search(attrs):
        size = int(m.group(2))
        return tuple(int(v) for v in _iota(m.group(3), m.group(4)).reshape(-1)[:size])
    if m := _MESH.search(attrs):
        axes = [(name, int(n)) for name, n in _AXIS.findall(m.group(1))]
        sizes = [n for _, n in axes]
        ids = _iota(m.group(2), m.group(3)) if m.group(2) else np.arange(math.prod(sizes))
        ids = ids.reshape(sizes)
        over = set(re.findall(r"'([^']+)'", m.group(4)))
        ranges = [range(n) if name in over else range(1) for name, n in axes]
        return tuple(int(ids[idx]) for idx in itertools.product(*ranges))
    return None


def extent(attrs: str) -> tuple[int, int]:
    """(span, size) of a collective's first replica group: its highest minus lowest device id
    plus one, and its device count; (0, 0) for a group of every device or one unread."""
    group = first_group(attrs)
    return (max(group) - min(group) + 1, len(group)) if group else (0, 0)
