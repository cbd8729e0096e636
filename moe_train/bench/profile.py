"""Where a compiled program's time goes, by the MoE pipeline's steps: a trace of a few calls
(``jax.profiler``), each op's time attributed by the named scopes its HLO instruction carries.

The trace's op events (a TPU's or GPU's device planes; XLA:CPU's thunks on the host where there
is no device plane) name their HLO instruction; the compiled module's text gives each
instruction's ``op_name`` metadata, the path of JAX and Flax scopes it was traced under (a
scope under a transformation reads ``jvp(permute)`` or ``transpose(jvp(permute))``). An op goes
to the first of these its path holds: a step of the MoE pipeline (``route``, ``dispatch``,
``permute``, ``grouped_gemm``, ``unpermute``, ``combine``), ``attention`` (the ``attn``
module), ``norms`` (modules named ``*_norm``), ``model, other`` (the rest of the Transformer:
embedding, dense blocks), else ``other`` (loss, head, optimizer, the benchmark's own loss).
Times are summed per call; ops that run concurrently (XLA:CPU's thread pool) count each.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.profiler import ProfileData

from moe_train.planner.compile import hlo

MOE_STEPS = ("route", "dispatch", "permute", "grouped_gemm", "unpermute", "combine")
SCOPES = (*MOE_STEPS, "attention", "norms", "model, other", "other")
CONTROL_OPS = frozenset({"while", "conditional", "call"})  # their events span their bodies' ops
TOP_OPS = 12  # the longest ops listed by name
ATTENTION_KERNEL = re.compile(r"(splash|flash)_")  # Pallas attention kernels' instruction names


def scope_of(op_name: str, instruction: str = "") -> str:
    """The scope (one of ``SCOPES``) an op traced under ``op_name`` (a '/'-separated path) counts
    for; an op without a path goes by its instruction's name where that names an attention
    kernel (on a TPU splash's custom calls carry no op_name: ``splash_mha_fwd_residuals.18``)."""
    if not op_name and ATTENTION_KERNEL.match(instruction):
        return "attention"
    segments = [_unwrapped(s) for s in op_name.split("/")]
    for step in MOE_STEPS:
        if step in segments:
            return step
    if any(s == "attn" or s.startswith("attn.") for s in segments):
        return "attention"
    if any(s.endswith("_norm") for s in segments):
        return "norms"
    if any("Transformer" in s for s in segments):
        return "model, other"
    return "other"


def _unwrapped(segment: str) -> str:
    """A scope name without the transformations JAX wraps it in: ``transpose(jvp(permute))``
    is ``permute``."""
    while m := re.fullmatch(r"[\w.]+\((.*)\)", segment):
        segment = m.group(1)
    return segment


def instruction_paths(hlo_text: str) -> dict[str, str]:
    """Each instruction of the compiled module that runs as an op of its own -> its op_name path
    ('' where it has none); loops, branches and calls are left out (their bodies' ops count)."""
    comps, _ = hlo.parse(hlo_text)
    out = {}
    for instrs in comps.values():
        for ins in instrs:
            if ins.op not in CONTROL_OPS:
                out[ins.name] = _op_name(ins) or _fused_op_name(ins, comps)
    return out


def _op_name(ins: hlo.Instr) -> str:
    return ins.attr(r'op_name="([^"]*)"') or ""


def _fused_op_name(ins: hlo.Instr, comps: dict[str, list[hlo.Instr]]) -> str:
    """A fusion without metadata of its own (XLA:CPU's): that of the last instruction in its
    fused computation that has one (the root's where it has one)."""
    callee = ins.attr(r"calls=%([^\s,}]+)") if ins.op == "fusion" else None
    named = [n for n in map(_op_name, comps.get(callee or "", [])) if n]
    return named[-1] if named else ""


def op_seconds(trace_dir: Path, paths: dict[str, str]) -> dict[str, float]:
    """Seconds per op of the module (``paths``' instructions) over a trace's device planes, or
    its host CPU plane where there is none; per plane, only its "XLA Ops" line where it has one."""
    files = sorted(trace_dir.rglob("*.xplane.pb"))
    if not files:
        return {}
    planes = list(ProfileData.from_file(str(files[-1])).planes)
    chosen = [p for p in planes if p.name.startswith("/device:")] or [
        p for p in planes if p.name == "/host:CPU"
    ]
    out: dict[str, float] = {}
    for plane in chosen:
        lines = list(plane.lines)
        lines = [ln for ln in lines if ln.name == "XLA Ops"] or lines
        for line in lines:
            for event in line.events:
                op = dict(event.stats).get("hlo_op") or instruction_name(event.name)
                if op in paths:
                    out[op] = out.get(op, 0.0) + event.duration_ns * 1e-9
    return out


def instruction_name(event_name: str) -> str:
    """The HLO instruction an op event is of: a TPU names each by its instruction's text
    (``%fusion.12 = bf16[...] fusion(...)``), XLA:CPU and GPU by the name alone."""
    m = re.match(r"%?([\w.\-]+) = ", event_name)
    return m.group(1) if m else event_name


def breakdown(call: Callable[[], Any], hlo_text: str | None, calls: int = 2) -> dict[str, Any]:
    """Trace ``calls`` runs of ``call`` (which runs the compiled program once and waits for it)
    and attribute its ops' time: {"by_scope": {scope: ms per call}, "traced_ms": their sum,
    "top_ops": the longest ops}; {"skipped": why} where the trace holds none of its ops."""
    if not hlo_text:
        return {"skipped": "the compiled program has no HLO text"}
    paths = instruction_paths(hlo_text)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                for _ in range(calls):
                    call()
            seconds = op_seconds(Path(tmp), paths)
    except Exception as err:  # a profiler that cannot trace here: the timings stand without it
        return {"skipped": f"no trace: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"}
    if not seconds:
        return {"skipped": "the trace holds none of the program's ops"}
    by_scope: dict[str, float] = dict.fromkeys(SCOPES, 0.0)
    for op, secs in seconds.items():
        by_scope[scope_of(paths[op], op)] += secs * 1e3 / calls
    top = sorted(seconds.items(), key=lambda kv: -kv[1])[:TOP_OPS]
    return {
        "by_scope": by_scope,
        "traced_ms": sum(by_scope.values()),
        "top_ops": [
            {
                "op": op,
                "scope": scope_of(paths[op], op),
                "ms": secs * 1e3 / calls,
                "op_name": _short(paths[op]),
            }
            for op, secs in top
        ],
    }


def _short(path: str) -> str:
    """An op_name path with its scopes unwrapped, for reading."""
    return "/".join(_unwrapped(s) for s in path.split("/"))


def markdown_rows(profiles: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a table: one row per profiled program, ms per call by scope and the
    share of the traced time in the MoE pipeline's steps."""
    header = ["program", *SCOPES, "traced ms", "MoE steps"]
    rows = []
    for name, prof in profiles.items():
        if "skipped" in prof:
            rows.append([name, *([""] * len(SCOPES)), "", prof["skipped"]])
            continue
        by, total = prof["by_scope"], prof["traced_ms"]
        moe = sum(by[s] for s in MOE_STEPS)
        rows.append(
            [name, *(f"{by[s]:.2f}" for s in SCOPES), f"{total:.2f}", f"{moe / total:.0%}" if total else ""]
        )
    return header, rows
