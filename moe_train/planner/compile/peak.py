"""What fills a compiled step's peak, from XLA's own buffer assignment
(``python -m moe_train.planner.compile --peak``, ``make compile PEAK=1``).

The compile is asked to dump its module (``dump_options``); XLA then writes, beside the
optimized HLO, ``*-live-range.txt`` whose "Live ranges at N (peak)" section lists every buffer
live at the peak with its bytes (``name{tuple index}: B bytes``). Each buffer is traced to the
source line that made it through the HLO's ``op_name`` metadata (the trainer's named scopes and
state paths; a loop's carried value through the loop's init tuple), and the buffers are summed
per scope (``scope_of``): the planner's items can be checked against that, term by term.
The live peak can sit below XLA's temp allocation (fragmentation: ``*-memory-usage-report``).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from pathlib import Path

PEAK_HEADER = re.compile(r"^\s*Live ranges at \d+ \(peak\):")
LIVE_LINE = re.compile(r"^\s+([\w.\-]+)(\{[\d,]*\})?: (\d+) bytes")
COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
OPERANDS = re.compile(r"\b(?:tuple|while)\((.*?)\)(?:,|$)")
# path pieces that say how JAX got there, not where in the model
NOISE = re.compile(
    r"^(jit\(step\)|jvp\(.*\)|transpose\(.*\)|closed_call|while|body|cond|"
    r"shard_map|checkpoint|remat|rematted_computation|jit\(.*\)|"
    r"pjit\(.*\)|custom_vjp_call.*|custom_jvp_call.*)$"
)
STATE = (
    ("state.opt_state", "state: optimizer"),
    ("state.params", "state: parameters"),
    ("state.moe_state", "state: MoE"),
    ("state", "state: other"),
)
TOP = 12  # scopes printed
WIDTH = 110  # characters of a scope printed (fused ops' names list every piece)
STACKED = "[stacked] "  # _source's mark for a value written into a per-iteration stack


def dump_options(dump_dir: Path) -> dict[str, object]:
    """XLA debug options for ``Lowered.compile``: dump the step's module, with its buffer
    assignment and live ranges, into ``dump_dir``."""
    return {"xla_dump_to": str(dump_dir), "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": "jit_step"}


@dataclasses.dataclass(frozen=True)
class Peak:
    """The buffers live at the step's peak, summed per source scope."""

    live_bytes: int  # all buffers live at the peak
    scopes: tuple[tuple[str, int, int], ...]  # (scope, bytes, buffers), largest first
    largest: tuple[tuple[str, str, int], ...]  # (buffer, scope, bytes) of the biggest buffers

    def record(self) -> dict:
        return {
            "live_bytes": self.live_bytes,
            "scopes": [{"scope": s, "bytes": b, "buffers": n} for s, b, n in self.scopes],
            "largest": [{"buffer": n, "scope": s, "bytes": b} for n, s, b in self.largest],
        }


def scope_of(op_name: str) -> str:
    """The model-facing part of an ``op_name``: JAX's wrappers dropped, then ``scope:
    primitive``, ``(backward)`` where it ran in a transpose; state paths by kind; a value a
    loop writes into a per-iteration stack (scanned layers' saved values, stacked gradients)
    is named by what it stacks."""
    if op_name.startswith(STACKED):
        return "stacked per layer: " + scope_of(op_name.removeprefix(STACKED))
    if op_name.startswith("state"):
        return next(label for prefix, label in STATE if op_name.startswith(prefix))
    pieces = op_name.split("/")
    keep = [p for p in pieces[:-1] if p and not NOISE.match(p)]
    backward = any(p.startswith("transpose(") for p in pieces)
    where = "/".join(keep) + ": " + pieces[-1] if keep else pieces[-1]
    return where + (" (backward)" if backward else "")


def _instructions(hlo_text: str) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """(name -> (op_name or "", the rest of its line) for every instruction of the module,
    computation -> the name of its ROOT instruction, "#" + computation -> its instructions'
    names joined by commas)."""
    out, roots, comp = {}, {}, ""
    for line in hlo_text.splitlines():
        head = COMPUTATION.match(line)
        if head:
            comp = head.group(1)
            continue
        m = INSTR.match(line)
        if m:
            name, rest = m.groups()
            op = OP_NAME.search(rest)
            out[name] = (op.group(1).replace("\\'", "'") if op else "", rest)
            if line.lstrip().startswith("ROOT "):
                roots[comp] = name
            roots["#" + comp] = roots.get("#" + comp, "") + name + ","
    return out, roots


def _operands(rest: str) -> list[str]:
    m = OPERANDS.search(rest)
    return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []


def _source(name: str, index: str, hlo: tuple[dict, dict], depth: int = 0) -> str:
    """The op_name behind buffer ``name{index}``: its own; for a tuple's element, that of the
    value it holds; for a loop's, that of the value the loop body writes there (else the
    loop's initial value)."""
    instrs, roots = hlo
    op, rest = instrs.get(name, ("", ""))
    parts = [int(i) for i in index.strip("{}").split(",") if i] if index else []
    if parts and depth < 8:
        args = _operands(rest)
        if " while(" in rest and len(args) == 1:
            body = re.search(r"body=%([\w.\-]+)", rest)
            root = roots.get(body.group(1), "") if body else ""
            found = _source(root, index, hlo, depth + 1) if root else ""
            if found and not found.endswith("source)"):
                return found
            return _source(args[0], index, hlo, depth + 1)
        if " tuple(" in rest and parts[0] < len(args):
            rest_index = "{" + ",".join(map(str, parts[1:])) + "}" if parts[1:] else ""
            return _source(args[parts[0]], rest_index, hlo, depth + 1)
    if op.endswith("dynamic_update_slice") and depth < 8:
        update = _update_operand(rest, hlo)
        if update:
            return STACKED + _source(update, "", hlo, depth + 1).removeprefix(STACKED)
    if not op and rest and depth < 8:
        return _unnamed(rest, hlo, depth)
    return op or f"{name} ({'loop state' if ' while(' in rest else 'no source'})"


def _update_operand(rest: str, hlo: tuple[dict, dict]) -> str:
    """The value a dynamic-update-slice (or a fusion holding one) writes: its operand 1,
    followed inside the fusion through bitcasts and copies to the fusion's own operand."""
    instrs, roots = hlo
    called = re.search(r"calls=%([\w.\-]+)", rest)
    if not called:
        dus = re.search(r"dynamic-update-slice\(([^)]*)\)", rest)
        args = re.findall(r"%([\w.\-]+)", dus.group(1)) if dus else []
        return args[1] if len(args) > 1 else ""
    inner = [n for n in roots.get("#" + called.group(1), "").split(",") if n]
    dus = next((n for n in inner if " dynamic-update-slice(" in instrs[n][1]), "")
    args = re.findall(r"%([\w.\-]+)", instrs[dus][1].split("metadata=")[0]) if dus else []
    if len(args) < 2:
        return ""
    outer = re.findall(r"%([\w.\-]+)", rest.split("kind=")[0])
    name = args[1]
    for _ in range(8):  # inside the fusion: back through bitcasts/copies to a parameter
        line = instrs.get(name, ("", ""))[1]
        param = re.search(r" parameter\((\d+)\)", line)
        if param:
            n = int(param.group(1))
            return outer[n] if n < len(outer) else ""
        passes = re.search(r" (?:bitcast|copy|reshape|convert|transpose)\(%([\w.\-]+)", line)
        if not passes:
            return name
        name = passes.group(1)
    return name


def _unnamed(rest: str, hlo: tuple[dict, dict], depth: int) -> str:
    """The source of an instruction XLA made without metadata: a fusion's from its fused
    computation's root, a tuple element read (get-tuple-element) from that element, a
    bitcast or copy from its operand."""
    called = re.search(r"calls=%([\w.\-]+)", rest)
    root = hlo[1].get(called.group(1), "") if called else ""
    if root:
        return _source(root, "", hlo, depth + 1)
    args = re.findall(r"%([\w.\-]+)", rest.split("metadata=")[0])
    if not args:
        return "(no source)"
    element = re.search(r"get-tuple-element\(.*index=(\d+)", rest)
    return _source(args[0], "{" + element.group(1) + "}" if element else "", hlo, depth + 1)


def live_at_peak(live_range_text: str) -> list[tuple[str, str, int]]:
    """(buffer name, tuple index, bytes) of the "Live ranges at N (peak)" section."""
    out, inside = [], False
    for line in live_range_text.splitlines():
        if PEAK_HEADER.match(line):
            inside = True
            continue
        if inside:
            m = LIVE_LINE.match(line)
            if not m:
                break
            out.append((m.group(1), m.group(2) or "", int(m.group(3))))
    return out


def summarize(live: list[tuple[str, str, int]], hlo_text: str, largest: int = 8) -> Peak:
    """``live`` summed per scope, through the optimized ``hlo_text``'s metadata."""
    hlo = _instructions(hlo_text)
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    buffers = []
    for name, index, nbytes in live:
        scope = scope_of(_source(name, index, hlo))
        totals[scope][0] += nbytes
        totals[scope][1] += 1
        buffers.append((name + index, scope, nbytes))
    scopes = sorted(((s, b, n) for s, (b, n) in totals.items()), key=lambda t: -t[1])
    buffers.sort(key=lambda t: -t[2])
    return Peak(sum(b for _, _, b in live), tuple(scopes), tuple(buffers[:largest]))


def read(dump_dir: Path) -> Peak | None:
    """The step's Peak from a dump directory (None where XLA wrote no live ranges)."""
    ranges = sorted(dump_dir.glob("*jit_step*after_optimizations-live-range.txt"))
    if not ranges:
        return None
    hlo_file = Path(str(ranges[-1]).replace("-live-range.txt", ".txt"))
    hlo_text = hlo_file.read_text() if hlo_file.is_file() else ""
    return summarize(live_at_peak(ranges[-1].read_text()), hlo_text)


def prune(dump_dir: Path) -> None:
    """Keep what explains the peak (optimized HLO, buffer assignment, live ranges, memory
    report); drop the rest of the dump (LLVM IR, PTX, per-pass HLO: hundreds of MB)."""
    for f in dump_dir.iterdir():
        if f.is_file() and "after_optimizations" not in f.name:
            f.unlink()


def lines(rec: dict, top: int = TOP) -> list[str]:
    """The scopes that fill the peak, as the report prints them (GiB, or MiB under 1 GiB)."""
    if not rec:
        return []
    live = rec["live_bytes"]
    name, unit = ("GiB", 2**30) if live >= 2**30 else ("MiB", 2**20)
    out = [f"live at the peak (XLA's buffer assignment): {live / unit:.2f} {name}; by source scope:"]
    for s in rec["scopes"][:top]:
        out.append(
            f"  {s['bytes'] / unit:8.2f} {name} {100 * s['bytes'] / max(live, 1):5.1f}%  "
            f"{s['buffers']:4d} buffers  {s['scope'][:WIDTH]}"
        )
    rest = rec["scopes"][top:]
    if rest:
        out.append(f"  {sum(s['bytes'] for s in rest) / unit:8.2f} {name} in {len(rest)} more scopes")
    return out
