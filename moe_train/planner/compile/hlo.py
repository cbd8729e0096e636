"""What XLA:GPU chose, read from the optimized, scheduled HLO text (``compiled.as_text()``).

The text is a list of computations (``%name (params) -> shape {`` ... ``}``), one instruction
a line: ``%name = <shape> <opcode>(<operands>), <attributes>``. Computations run as kernels'
insides (fusion bodies, reduction functions) are skipped; the rest (the entry, loop bodies,
called and async computations) hold what the GPU executes.

Kernels: fusions by their ``fusion_backend_config`` kind (``__triton_gemm`` and
``__triton_nested_gemm_fusion``: Triton GEMMs; ``__triton``: other Triton fusions;
``__cudnn$fusion``: cuDNN) and custom calls by target (``__cublas$gemm``: cuBLAS,
``__cublas$lt$matmul*``: cuBLASLt, ``__cudnn$*``: cuDNN, ``mosaic_gpu*``: Mosaic GPU,
``__gpu$xla.gpu.triton``: Pallas Triton). fp8 GEMMs: cuBLASLt's ``$f8`` calls and Triton GEMMs
whose dot reads an f8 operand.

Collectives (all-to-all, ragged all-to-all, all-gather, reduce-scatter, all-reduce,
collective-permute): each instance once, ``async`` when it runs as a ``-start``/``-done`` pair
(or an ``async-start`` wrapper) that XLA did not mark ``is_sync``, else ``sync``; ``bytes`` is
its result per GPU (all-gather: the gathered array, reduce-scatter: the shard), summed over
the instances in the text; ``in_loops`` counts those inside a loop body, which run once per
iteration (XLA:GPU's text carries no trip counts).

Overlap (what runs between an async start and its done): ``moe_train.planner.compile.overlap``.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

COLLECTIVES = (
    "all-to-all",
    "ragged-all-to-all",
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "collective-permute",
)
KERNELS = (
    "triton_gemm",
    "triton_fusion",
    "cublas",
    "cublaslt",
    "cudnn",
    "fp8_gemm",
    "mosaic_gpu",
    "pallas_triton",
)
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\) -> .*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_GEMM_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion")
GEMM_KERNELS = ("triton_gemm", "cublas", "cublaslt", "mosaic_gpu")


@dataclass(frozen=True)
class Instr:
    name: str
    shape: str  # the result shape text
    op: str  # opcode
    rest: str  # operands and attributes

    def attr(self, pattern: str) -> str | None:
        m = re.search(pattern, self.rest)
        return m.group(1) if m else None

    @property
    def operands(self) -> list[str]:
        return re.findall(r"%([^\s,()]+)", self.rest.split(")", 1)[0])


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a shape (a tuple's elements summed); f8 types are 1 byte."""
    total = 0
    for dtype, dims in ARRAY.findall(shape):
        size = 1 if dtype.startswith("f8") else _BYTES.get(dtype)
        if size is not None:
            total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
    """(computation name -> its instructions, the entry computation's name)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            current = comps.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTR.match(line)):
            current.append(Instr(*m.groups()))
    return comps, entry


def _executed(comps: dict[str, list[Instr]], entry: str) -> dict[str, bool]:
    """Computations that run as code of their own -> whether inside a loop body."""
    out, todo = {entry: False}, [(entry, False)]
    while todo:
        name, looped = todo.pop()
        for ins in comps.get(name, []):
            if ins.op == "fusion":
                continue  # a kernel: its body is not separate code
            for key in ("body", "condition", "calls", "branch_computations"):
                for callee in re.findall(rf"{key}=\{{?((?:%[^\s,}}]+,?\s*)+)", ins.rest):
                    for c in re.findall(r"%([^\s,}]+)", callee):
                        inner = looped or key == "body"
                        if c in comps and (c not in out or (inner and not out[c])):
                            out[c] = inner
                            todo.append((c, inner))
    return out


def _is_fp8_dot(comps: dict[str, list[Instr]], fused: str | None) -> bool:
    body = comps.get(fused or "", [])
    shapes = {i.name: i.shape for i in body}
    return any(i.op == "dot" and any(shapes.get(o, "").startswith("f8") for o in i.operands) for i in body)


def kernel_classes(ins: Instr, comps: dict[str, list[Instr]]) -> list[str]:
    """The kernel classes one instruction counts in ("" when none)."""
    if ins.op == "fusion":
        kind = ins.attr(r'"kind":"([^"]+)"') or ""
        if kind in _GEMM_KINDS:
            fp8 = _is_fp8_dot(comps, ins.attr(r"calls=%([^\s,]+)"))
            return ["triton_gemm"] + (["fp8_gemm"] if fp8 else [])
        return {"__triton": ["triton_fusion"], "__cudnn$fusion": ["cudnn"]}.get(kind, [])
    if ins.op != "custom-call":
        return []
    target = ins.attr(r'custom_call_target="([^"]+)"') or ""
    if target == "__cublas$gemm":
        return ["cublas"]
    if target.startswith("__cublas$lt$matmul"):
        return ["cublaslt"] + (["fp8_gemm"] if target.endswith("$f8") else [])
    if target.startswith("__cudnn$"):
        return ["cudnn"]
    if target.startswith("mosaic_gpu"):
        return ["mosaic_gpu"]
    if target == "__gpu$xla.gpu.triton":
        return ["pallas_triton"]
    return [f"custom_call:{target}"]


def _collective(ins: Instr, by_name: dict[str, Instr], comps) -> tuple[str, bool] | None:
    """(collective kind, async?) of an instruction that completes one, else None."""
    if ins.op in COLLECTIVES:
        return ins.op, False
    if ins.op.endswith("-done") and ins.op[:-5] in COLLECTIVES:
        start = by_name.get(ins.operands[0]) if ins.operands else None
        return ins.op[:-5], not (start and '"is_sync":true' in start.rest)
    if ins.op == "async-done":
        start = by_name.get(ins.operands[0]) if ins.operands else None
        wrapped = comps.get((start or ins).attr(r"calls=%([^\s,]+)") or "", [])
        ops = [i.op for i in wrapped if i.op in COLLECTIVES]
        if ops:
            return ops[-1], not (start and '"is_sync":true' in start.rest)
    return None


def inventory(text: str) -> dict:
    """``{"kernels": {class: count}, "collectives": {kind: {count, async, sync, in_loops,
    bytes}}}`` of one compiled module's text."""
    comps, entry = parse(text)
    kernels: Counter = Counter({k: 0 for k in KERNELS})
    colls: dict[str, Counter] = defaultdict(Counter)
    wrapped = {
        i.attr(r"calls=%([^\s,]+)") for c in comps.values() for i in c if i.op == "async-start"
    }  # their collective is counted at the async-done
    for name, looped in _executed(comps, entry).items():
        by_name = {i.name: i for i in comps[name]}
        for ins in comps[name]:
            kernels.update(kernel_classes(ins, comps))
            found = None if name in wrapped else _collective(ins, by_name, comps)
            if found:
                kind, is_async = found
                colls[kind].update(
                    count=1,
                    bytes=shape_bytes(ins.shape),
                    in_loops=int(looped),
                    **{"async" if is_async else "sync": 1},
                )
    fields = ("count", "async", "sync", "in_loops", "bytes")
    return {
        "kernels": dict(kernels),
        "collectives": {k: {f: colls[k][f] for f in fields} for k in COLLECTIVES if k in colls},
    }


def start_kind(ins: Instr, comps: dict[str, list[Instr]], sync: bool = False) -> str | None:
    """The collective kind an async start instruction begins (None: not one); ``sync``: of a
    start XLA marked ``is_sync`` instead (it runs alone: nothing overlaps it)."""
    if ins.op.endswith("-start") and ins.op[:-6] in COLLECTIVES:
        kind = ins.op[:-6]
    elif ins.op == "async-start":
        ops = [i.op for i in comps.get(ins.attr(r"calls=%([^\s,]+)") or "", []) if i.op in COLLECTIVES]
        kind = ops[-1] if ops else None
    else:
        return None
    return kind if ('"is_sync":true' in ins.rest) == sync else None
