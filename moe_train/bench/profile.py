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

Beside the module's ops the same planes say where a gap between the traced ops and a measured
time lies: op events of no instruction of the module (``unmatched``: another program's ops, or
events named other than the module's text says), and the device's own "XLA Modules" line (the
module executions: a traced time well under it is ops not matched, a module time well under the
measured time is a device waiting on its host).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
from jax.profiler import ProfileData

from moe_train.planner.compile import hlo

MOE_STEPS = ("route", "dispatch", "permute", "grouped_gemm", "unpermute", "combine")
SCOPES = (*MOE_STEPS, "attention", "norms", "model, other", "other")
CONTROL_OPS = frozenset({"while", "conditional", "call"})  # their events span their bodies' ops
TOP_OPS = 30  # the longest ops listed by name (in results.json: enough to see each MoE step's kernels)
TOP_UNMATCHED = 8  # the longest unmatched op names listed
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


def control_instructions(hlo_text: str) -> frozenset[str]:
    """The compiled module's loops, branches and calls: their op events span their bodies' ops,
    which count on their own, so they are neither the module's ops nor unmatched ones."""
    comps, _ = hlo.parse(hlo_text)
    return frozenset(ins.name for instrs in comps.values() for ins in instrs if ins.op in CONTROL_OPS)


def _op_name(ins: hlo.Instr) -> str:
    return ins.attr(r'op_name="([^"]*)"') or ""


def _fused_op_name(ins: hlo.Instr, comps: dict[str, list[hlo.Instr]]) -> str:
    """A fusion without metadata of its own (XLA:CPU's): that of the last instruction in its
    fused computation that has one (the root's where it has one)."""
    callee = ins.attr(r"calls=%([^\s,}]+)") if ins.op == "fusion" else None
    named = [n for n in map(_op_name, comps.get(callee or "", [])) if n]
    return named[-1] if named else ""


@dataclasses.dataclass(frozen=True)
class OpTrace:
    """What a trace's chosen planes (``trace_ops``) hold, in seconds over all its calls."""

    seconds: dict[str, float]  # each of the module's ops (``paths``) -> its events' time
    unmatched: dict[str, tuple[float, int]]  # other op events' instructions -> (time, events)
    control_s: float  # the module's loops, branches and calls: spans of ops counted on their own
    module_s: float | None  # the "XLA Modules" line's events; None where no plane has that line
    events: int  # op events seen: the module's, its control ops' and unmatched ones


def trace_ops(trace_dir: Path, paths: dict[str, str], control: frozenset[str] = frozenset()) -> OpTrace:
    """The op events of a trace's device planes, or its host CPU plane where there is none, by
    whether they are of the module's ops (``paths``), of its ``control`` ops, or of neither; with
    the planes' "XLA Modules" time, the device's busy span."""
    files = sorted(trace_dir.rglob("*.xplane.pb"))
    planes = list(ProfileData.from_file(str(files[-1])).planes) if files else []
    chosen = [p for p in planes if p.name.startswith("/device:")] or [
        p for p in planes if p.name == "/host:CPU"
    ]
    seconds: dict[str, float] = {}
    unmatched: dict[str, tuple[float, int]] = {}
    control_s, module_s, events = 0.0, None, 0
    for plane in chosen:
        lines = list(plane.lines)
        modules = [e.duration_ns for ln in lines if ln.name == "XLA Modules" for e in ln.events]
        if modules:
            module_s = (module_s or 0.0) + sum(modules) * 1e-9
        for op, secs, is_op in _op_events(lines):
            if op in paths:
                seconds[op] = seconds.get(op, 0.0) + secs
            elif op in control:
                control_s += secs
            elif is_op:
                t, n = unmatched.get(op, (0.0, 0))
                unmatched[op] = (t + secs, n + 1)
            else:
                continue
            events += 1
    return OpTrace(seconds, unmatched, control_s, module_s, events)


def _op_events(lines: list) -> Iterator[tuple[str, float, bool]]:
    """(instruction name, seconds, whether surely an op event) of each event of a plane's "XLA
    Ops" line where it has one (every one an op), else of all its lines (an op where it carries
    an ``hlo_op`` stat: XLA:CPU's thunks; the rest are the host's own work)."""
    ops = [ln for ln in lines if ln.name == "XLA Ops"]
    for line in ops or lines:
        for event in line.events:
            stats = dict(event.stats)
            op = stats.get("hlo_op") or instruction_name(event.name)
            yield str(op), event.duration_ns * 1e-9, bool(ops) or "hlo_op" in stats


def op_seconds(trace_dir: Path, paths: dict[str, str]) -> dict[str, float]:
    """Seconds per op of the module (``paths``' instructions) over a trace's device planes, or
    its host CPU plane where there is none; per plane, only its "XLA Ops" line where it has one."""
    return trace_ops(trace_dir, paths).seconds


def instruction_name(event_name: str) -> str:
    """The HLO instruction an op event is of: a TPU names each by its instruction's text
    (``%fusion.12 = bf16[...] fusion(...)``), XLA:CPU and GPU by the name alone."""
    m = re.match(r"%?([\w.\-]+) = ", event_name)
    return m.group(1) if m else event_name


def breakdown(call: Callable[[], Any], hlo_text: str | None, calls: int = 2) -> dict[str, Any]:
    """Trace ``calls`` runs of ``call`` (which runs the compiled program once and waits for it)
    and attribute its ops' time, ms per call: {"by_scope": {scope: ms}, "traced_ms": their sum,
    "top_ops": the longest ops, "unmatched_ms": op events of no instruction of the program,
    "unmatched_top": the longest of those by name, "control_ms": its loops', branches' and
    calls' events (spans of ops counted on their own; nested ones each), "module_ms": the
    device's "XLA Modules" events (None without that line: XLA:CPU), "events": op events seen};
    {"skipped": why} where the trace holds none of its ops."""
    if not hlo_text:
        return {"skipped": "the compiled program has no HLO text"}
    paths = instruction_paths(hlo_text)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                for _ in range(calls):
                    call()
            trace = trace_ops(Path(tmp), paths, control_instructions(hlo_text))
    except Exception as err:  # a profiler that cannot trace here: the timings stand without it
        return {"skipped": f"no trace: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"}
    if not trace.seconds:
        return {"skipped": "the trace holds none of the program's ops"}
    by_scope: dict[str, float] = dict.fromkeys(SCOPES, 0.0)
    for op, secs in trace.seconds.items():
        by_scope[scope_of(paths[op], op)] += secs * 1e3 / calls
    top = sorted(trace.seconds.items(), key=lambda kv: -kv[1])[:TOP_OPS]
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
    } | _gaps(trace, calls)


def _gaps(trace: OpTrace, calls: int) -> dict[str, Any]:
    """Per call, what the trace holds beside the program's ops: where a measured time that the
    traced ops fall short of went (ops not matched, or a device waiting on its host)."""
    top = sorted(trace.unmatched.items(), key=lambda kv: -kv[1][0])[:TOP_UNMATCHED]
    return {
        "unmatched_ms": sum(t for t, _ in trace.unmatched.values()) * 1e3 / calls,
        "unmatched_top": [{"op": op, "ms": t * 1e3 / calls, "count": n / calls} for op, (t, n) in top],
        "control_ms": trace.control_s * 1e3 / calls,
        "module_ms": None if trace.module_s is None else trace.module_s * 1e3 / calls,
        "events": trace.events / calls,
    }


def _short(path: str) -> str:
    """An op_name path with its scopes unwrapped, for reading."""
    return "/".join(_unwrapped(s) for s in path.split("/"))


def markdown_rows(profiles: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a table: one row per profiled program, ms per call by scope, the traced
    ops' sum, the op events matched to none of its ops and the device's module time (empty where
    not recorded) to set beside the measured time, and the share of the traced time in the MoE
    pipeline's steps."""
    header = ["program", *SCOPES, "traced ms", "unmatched ms", "module ms", "MoE steps"]
    rows = []
    for name, prof in profiles.items():
        if "skipped" in prof:
            rows.append([name, *([""] * (len(header) - 2)), prof["skipped"]])
            continue
        by, total = prof["by_scope"], prof["traced_ms"]
        moe = sum(by[s] for s in MOE_STEPS)
        rows.append(
            [
                name,
                *(f"{by[s]:.2f}" for s in SCOPES),
                f"{total:.2f}",
                *(_ms(prof.get(k)) for k in ("unmatched_ms", "module_ms")),
                f"{moe / total:.0%}" if total else "",
            ]
        )
    return header, rows


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"
