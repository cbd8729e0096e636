"""The overlap the schedule really has: what XLA:GPU places between each async collective's
start and its done, in kernels, GEMM FLOPs and seconds.

The scheduled text lists each computation's instructions in the order they run, so the
kernels between an async collective's start and its done (in the same computation) are the
work the GPU can do while it is in flight: a *window*. A loop inside a window counts its
body's kernels times its known trip count (the chunked attention's loops), unless the body
runs collectives itself. A loop whose bounds are traced (the tiled experts: a loop over the
experts, in it one per block size) counts as a walk over its R buffer rows: R / C runs of
its largest blocks' body (``_row_walk``; counting one run undercounted a walk's GEMMs by
the number of its blocks). Each window counts the GEMM kernels
(Triton GEMM, cuBLAS, cuBLASLt, Mosaic GPU) and other kernels inside it, the GEMMs' FLOPs and
the collective's bytes (its result per GPU), and how many times it runs per step: the product
of the known trip counts (``known_trip_count``) of the loops around it (1 where XLA gives
none). A collective XLA runs synchronously (a start marked ``is_sync``: XLA found nothing to
overlap it with, or no start/done pair) is a window with nothing inside: its transfer counts
and hides nothing (at 8 overlap chunks more than half of Mixtral's row exchanges are such).

FLOPs: a dot (in a GEMM fusion's body) is 2 x its result's elements x its contracted size;
a cuBLAS call the same from its ``lhs_contracting_dimensions``; a Mosaic GPU grouped GEMM
(the experts) 2 x R x a x b from its row operand [R, .] and its [L, a, b] weight (or weight
gradient): nominal FLOPs at the bucket's padded rows, an upper bound of the work done.

``hidden``: at the preset's rates (the all-to-all link of the step-time model,
``moe_train.planner.steptime.link_bytes_per_s``, and the grouped-GEMM rate, peak x
``grouped_gemm_efficiency``), each window hides at most min(its transfer, its GEMMs), summed
over every run; beside the collective's whole transfer time. ``report`` prints it beside the
share the step-time model hides (``moe_train.planner.compute.a2a_hidden`` and the
``fsdp_hidden_*`` shares, whose
shipped values are these measurements).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from moe_train.planner.compile import groups, trips
from moe_train.planner.compile.hlo import (
    ARRAY,
    COLLECTIVES,
    GEMM_KERNELS,
    Instr,
    kernel_classes,
    parse,
    shape_bytes,
    start_kind,
)

_CONSTRAINTS = r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}"  # shapes with {layouts}
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass(frozen=True)
class Window:
    """One async collective: what runs while it is in flight."""

    kind: str  # collective kind (all-to-all, all-gather, ...)
    bytes: int  # its result per GPU
    gemm_kernels: int  # GEMM kernels inside
    other_kernels: int  # other kernels inside
    gemm_flops: float  # the GEMM kernels' FLOPs
    runs: int  # times per step (loop trip counts)
    sync: bool = False  # XLA runs it alone (is_sync, or no start/done): nothing inside
    span: int = 0  # its first replica group's device-id span (``groups.extent``); 0: every device
    size: int = 0  # devices in that group; 0: every device


def _dims(shape: str) -> list[list[int]]:
    return [[int(d) for d in dims.split(",") if d] for _, dims in ARRAY.findall(shape)]


def runs_per_step(comps: dict[str, list[Instr]], entry: str) -> dict[str, int]:
    """Computations that run as code of their own -> times per step (a loop body: its trip
    count, XLA's or else ``trips.trip``'s, times its caller's; 1 where neither knows it;
    computations reached twice add up)."""
    out: dict[str, int] = defaultdict(int)
    todo = [(entry, 1)]
    while todo:
        name, times = todo.pop()
        out[name] += times
        for ins in comps.get(name, []):
            if ins.op == "fusion":
                continue  # a kernel: its body is not separate code
            trip = int(m.group(1)) if (m := _TRIP.search(ins.rest)) else None
            if ins.op == "while" and trip is None:
                trip = trips.trip(ins, comps[name], comps)
            trip = 1 if trip is None else trip
            for key in ("body", "condition", "calls", "branch_computations"):
                for callee in re.findall(rf"{key}=\{{?((?:%[^\s,}}]+,?\s*)+)", ins.rest):
                    for c in re.findall(r"%([^\s,}]+)", callee):
                        if c in comps:
                            todo.append((c, times * (trip if key in ("body", "condition") else 1)))
    return dict(out)


def _dot_flops(ins: Instr, shapes: dict[str, str], dims_key: str) -> float:
    out = _dims(ins.shape)
    lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
    if not out or not lhs:
        return 0.0
    contract = [int(d) for d in re.findall(r"\d+", ins.attr(dims_key) or "")]
    return 2.0 * math.prod(out[0]) * math.prod(lhs[0][d] for d in contract if d < len(lhs[0]))


def _grouped_flops(ins: Instr) -> float:
    """2 x R x a x b of a grouped GEMM: rows [R, .] and a [L, a, b] weight among its shapes."""
    shapes = _dims(ins.shape) + _dims(ins.attr(_CONSTRAINTS) or "")
    weights = [s for s in shapes if len(s) == 3]
    rows = [s[0] for s in shapes if len(s) == 2]
    return 2.0 * max(rows) * weights[0][1] * weights[0][2] if weights and rows else 0.0


def gemm_flops(ins: Instr, comps: dict[str, list[Instr]], shapes: dict[str, str]) -> float:
    """FLOPs of one GEMM kernel (0 for any other instruction)."""
    kinds = kernel_classes(ins, comps)
    if "triton_gemm" in kinds:
        body = comps.get(ins.attr(r"calls=%([^\s,]+)") or "", [])
        inner = {i.name: i.shape for i in body}
        return sum(_dot_flops(i, inner, r"lhs_contracting_dims=\{([\d,]*)\}") for i in body if i.op == "dot")
    if "cublas" in kinds or "cublaslt" in kinds:
        return _dot_flops(ins, shapes, r'"lhs_contracting_dimensions":\[([^\]]*)\]')
    if "mosaic_gpu" in kinds:
        return _grouped_flops(ins)
    return 0.0


def _kernels(ins: Instr, comps: dict[str, list[Instr]], shapes: dict[str, str]) -> tuple[int, int, float]:
    """(GEMM kernels, other kernels, GEMM FLOPs) one instruction runs: a kernel's own, or a
    loop's (its body's, times its known trip count; a loop that runs collectives of its own
    counts nothing: XLA:GPU runs one collective at a time)."""
    kinds = [k for k in kernel_classes(ins, comps) if k != "fp8_gemm"]
    if kinds:
        is_gemm = any(k in GEMM_KERNELS for k in kinds)
        flops = gemm_flops(ins, comps, shapes) if is_gemm else 0.0
        return (len(kinds), 0, flops) if is_gemm else (0, len(kinds), 0.0)
    body = comps.get(ins.attr(r"body=%([^\s,]+)") or "", []) if ins.op == "while" else []
    if not body or any(
        start_kind(i, comps) or start_kind(i, comps, True) or i.op in COLLECTIVES for i in body
    ):
        return 0, 0, 0.0
    if not (m := _TRIP.search(ins.rest)) and (walk := _row_walk(ins, comps)):
        return walk
    trip = int(m.group(1)) if m else 1
    inner = {i.name: i.shape for i in body}
    gemm, other, flops = zip(*(_kernels(i, comps, inner) for i in body), strict=True)
    return trip * sum(gemm), trip * sum(other), trip * sum(flops)


def _block_rows(body: list[Instr], rows: int) -> int:
    """C of a loop body that slices blocks [C, .] out of [rows, .] buffers (0: none)."""
    blocks = [
        dims[0][0]
        for i in body
        if (i.op == "dynamic-slice" or "dynamic_slice" in i.name)
        and len(dims := _dims(i.shape)) == 1
        and len(dims[0]) == 2
        and dims[0][0] < rows
    ]
    return max(blocks, default=0)


def _row_walk(ins: Instr, comps: dict[str, list[Instr]]) -> tuple[int, int, float] | None:
    """(GEMM kernels, other kernels, GEMM FLOPs) of a walk over R rows in blocks whose loop
    bounds are traced (the tiled experts: a loop over the experts, in it a loop per block
    size): R / C runs of the body of its loop of the largest blocks C, R the most rows among
    the loop's 2-D buffers. Nominal, as the Mosaic GPU grouped GEMM's: every buffer row
    runs, an upper bound of the work at the bucket's padded rows. None where no nested loop
    slices row blocks (the caller then counts one run of the body)."""
    rows = max((d[0] for d in _dims(ins.shape) if len(d) == 2), default=0)
    best: tuple[int, list[Instr], dict[str, str]] | None = None
    todo = [ins]
    while todo:
        loop = todo.pop()
        body = comps.get(loop.attr(r"body=%([^\s,]+)") or "", [])
        todo += [i for i in body if i.op == "while"]
        c, shapes = _block_rows(body, rows), {i.name: i.shape for i in body}
        if c and any(gemm_flops(i, comps, shapes) for i in body) and (best is None or c > best[0]):
            best = (c, body, shapes)
    if best is None:
        return None
    c, body, shapes = best
    gemm, other, flops = zip(*(_kernels(i, comps, shapes) for i in body if i.op != "while"), strict=True)
    runs = rows // c
    return runs * sum(gemm), runs * sum(other), runs * sum(flops)


def windows(text: str) -> list[Window]:
    """Every collective of one compiled module's scheduled text, async or sync."""
    comps, entry = parse(text)
    wrapped = {i.attr(r"calls=%([^\s,]+)") for c in comps.values() for i in c if i.op == "async-start"}
    found = []
    for name, runs in runs_per_step(comps, entry).items():
        if name in wrapped:
            continue  # an async-start's collective: its window is the start's
        shapes = {i.name: i.shape for i in comps[name]}
        open_: dict[str, list] = {}  # start name -> [kind, gemm, other, flops, sync, (span, size)]
        for ins in comps[name]:
            done = ins.operands[0] if ins.op.endswith("-done") and ins.operands else None
            if done in open_:
                kind, gemm, other, flops, sync, group = open_.pop(done)
                inside = (0, 0, 0.0) if sync else (gemm, other, flops)
                found.append(Window(kind, shape_bytes(ins.shape), *inside, runs, sync, *group))
                continue
            if open_:
                gemm, other, flops = _kernels(ins, comps, shapes)
                for w in open_.values():
                    w[1] += gemm
                    w[2] += other
                    w[3] += flops
            for sync in (False, True):
                if kind := start_kind(ins, comps, sync=sync):
                    open_[ins.name] = [kind, 0, 0, 0.0, sync, _extent(ins, comps)]
                    break
            else:
                if ins.op in COLLECTIVES:
                    size = shape_bytes(ins.shape)
                    found.append(Window(ins.op, size, 0, 0, 0.0, runs, True, *_extent(ins, comps)))
    return found


def _extent(ins: Instr, comps: dict[str, list[Instr]]) -> tuple[int, int]:
    """``groups.extent`` of a collective (or of an async wrapper's collective)."""
    if ins.op == "async-start":
        inner = [i for i in comps.get(ins.attr(r"calls=%([^\s,]+)") or "", []) if i.op in COLLECTIVES]
        ins = inner[-1] if inner else ins
    return groups.extent(ins.rest)


def summary(found: list[Window]) -> dict:
    """``{kind: {pairs, with_gemm, gemm_kernels, other_kernels, bytes, bytes_with_gemm,
    gemm_flops}}`` of the async collectives: instances in the text (the first four) and per
    step (the rest)."""
    out: dict[str, dict] = {}
    for kind in COLLECTIVES:
        ws = [w for w in found if w.kind == kind and not w.sync]
        if ws:
            out[kind] = {
                "pairs": len(ws),
                "with_gemm": sum(w.gemm_kernels > 0 for w in ws),
                "gemm_kernels": sum(w.gemm_kernels for w in ws),
                "other_kernels": sum(w.other_kernels for w in ws),
                "bytes": sum(w.bytes * w.runs for w in ws),
                "bytes_with_gemm": sum(w.bytes * w.runs for w in ws if w.gemm_kernels),
                "gemm_flops": sum(w.gemm_flops * w.runs for w in ws),
            }
    return out


def traffic(w: Window, devices: int) -> float:
    """Bytes each GPU of ``w``'s group sends, of g devices (``devices`` where the group is
    every device), as the step-time model counts them: an all-gather or all-to-all sends
    (g-1)/g of its result, a reduce-scatter g-1 times its shard, an all-reduce 2(g-1)/g of
    its array (a ring), a collective-permute its result."""
    g = w.size or devices
    if g <= 1:
        return 0.0
    share = {"reduce-scatter": g - 1, "all-reduce": 2 * (g - 1) / g, "collective-permute": 1.0}
    return w.bytes * share.get(w.kind, (g - 1) / g)


def hidden(
    found: list[Window],
    kind: str,
    link_bytes_per_s: float | Callable[[int], float],
    gemm_flops_per_s: float,
    devices: int,
) -> dict:
    """``{"comm_s", "hidden_s"}`` of one collective kind per step at these rates: its whole
    transfer time (``traffic``; sync instances too), and the most the GEMMs in its windows can
    hide of it. ``link_bytes_per_s``: one rate, or the rate over a window's ``span`` (the job's
    ``devices`` for a collective over every device)."""
    rate = link_bytes_per_s if callable(link_bytes_per_s) else (lambda _span: link_bytes_per_s)
    ws = [w for w in found if w.kind == kind]
    secs = [traffic(w, devices) / rate(w.span or devices) for w in ws]
    comm = sum(s * w.runs for s, w in zip(secs, ws, strict=True))
    hide = sum(min(s, w.gemm_flops / gemm_flops_per_s) * w.runs for s, w in zip(secs, ws, strict=True))
    return {"comm_s": comm, "hidden_s": hide}
