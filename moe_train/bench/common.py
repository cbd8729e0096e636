"""Benchmark plumbing: timing, collective bytes from lowered HLO, Markdown tables, results.

Timing: the function is compiled first (``jit(...).lower(...).compile()``, its wall time is
``compile_s``), run once as warm-up, then timed ``reps`` times with ``block_until_ready``;
a row keeps the median, min, max and quartiles. ``reps`` adapts to the step time: enough to
fill about ``target_s`` seconds, at least ``min_reps``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np

from moe_train import config
from moe_train.moe.routings import MoEShape
from moe_train.planner.compile.hlo import shape_bytes

# The timing bounds of every section's quick (or tiny) sizes: 3 timed rounds at most, rounds
# added up to about 0.05 s (``Sizes(..., **QUICK_TIMING)``).
QUICK_TIMING: dict[str, Any] = {"max_reps": 3, "target_s": 0.05}


def row_done(section: str, text: str) -> None:
    """One line as a benchmark row finishes (the full table comes at the end)."""
    print(f"  {section}: {text}", flush=True)


# ----------------------------------------------------------------------------- timing


def time_compiled(
    fn: Callable, args: Sequence, *, min_reps: int = 3, max_reps: int = 10, target_s: float = 2.0
) -> tuple[dict[str, Any], Any]:
    """Warm up once, then time ``fn(*args)`` ``reps`` times. Returns (timing, last output)."""
    out = jax.block_until_ready(fn(*args))  # warm-up
    times = []
    reps = min_reps
    while len(times) < reps:
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
        if len(times) == 1:  # size the run from the first timed repetition
            reps = max(min_reps, min(max_reps, math.ceil(target_s / max(times[0], 1e-6))))
    return summarize(times), out


K = TypeVar("K", bound=Hashable)


def preset_shape(preset: str, tokens: int) -> MoEShape:
    """The routed experts' shape of model preset ``preset`` (its hidden size, expert width,
    experts and top-k) on ``tokens`` tokens."""
    m = config.build(preset)
    return MoEShape(tokens, m.model.hidden, m.moe.expert_ffn, m.moe.num_experts, m.moe.top_k)


# The accelerator benchmark's expert shapes (issue 49), (model, full-size shape, router score
# function): its layer rows, its permutation rows and the megablox tile sweep all take these.
# DeepSeek-V3's experts, 32 of its 256 (the 256 experts' bf16 weights alone, 22.5 GB, pass one
# TPU v5e chip's 15.7 GiB).
ACCEL_SHAPES: tuple[tuple[str, MoEShape, str], ...] = (
    ("mixtral-8x7b", preset_shape("mixtral-8x7b", 8192), "softmax"),
    ("qwen3-30b-a3b", preset_shape("qwen3-30b-a3b", 16384), "softmax"),
    ("deepseek-v3-like", dataclasses.replace(preset_shape("deepseek-v3", 8192), experts=32), "sigmoid"),
)


def time_rounds(
    fns: Mapping[K, tuple[Callable, Sequence]],
    *,
    min_reps: int = 3,
    max_reps: int = 10,
    target_s: float = 2.0,
    outputs: dict | None = None,
) -> dict[K, dict[str, Any]]:
    """Time several compiled functions side by side: one warm-up call each, then ``reps``
    rounds that call every function once, in order. Returns {name: timing}.

    Interleaving spreads load changes of a shared machine evenly over the functions, so
    ratios of their medians are steadier than the absolute times. Each timing also keeps
    ``times_s`` (per round), so callers can form per-round ratios. ``outputs``, if given,
    receives each function's warm-up result.
    """
    t0 = time.perf_counter()
    for name, (fn, args) in fns.items():
        out = jax.block_until_ready(fn(*args))  # warm-up
        if outputs is not None:
            outputs[name] = out
        del out  # not held while the next one runs (a device fits one shape's outputs, not two)
    round_s = time.perf_counter() - t0
    reps = max(min_reps, min(max_reps, math.ceil(target_s / max(round_s, 1e-6))))
    times: dict[K, list[float]] = {name: [] for name in fns}
    cpu: dict[K, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, (fn, args) in fns.items():
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return {
        name: dict(summarize(ts), times_s=ts, cpu_median_s=statistics.median(cpu[name]))
        for name, ts in times.items()
    }


def min_time(fn: Callable, args: Sequence, calls: int = 2) -> float:
    """Fastest of ``calls`` runs (a cheap estimate for skip rules, not a measurement)."""
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def ratio_stats(timing: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Median ratio (median / reference median), the min-max of the per-round ratios, and
    the ratio of median process CPU times (all threads; steadier than wall time when other
    processes share the cores, but it also counts work the threads do not overlap)."""
    per_round = [a / b for a, b in zip(timing["times_s"], ref["times_s"])]
    return {
        "ratio": timing["median_s"] / ref["median_s"],
        "ratio_min": min(per_round),
        "ratio_max": max(per_round),
        "cpu_ratio": timing["cpu_median_s"] / max(ref["cpu_median_s"], 1e-9),
    }


def ratio_cell(r: dict[str, Any]) -> str:
    """A table cell of a row's ``ratio_stats``: the median ratio (min-max per round)."""
    return f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"


def summarize(times: Sequence[float]) -> dict[str, Any]:
    ts = sorted(times)
    q = np.percentile(ts, [25, 75]) if len(ts) > 1 else (ts[0], ts[0])
    return {
        "median_s": statistics.median(ts),
        "min_s": ts[0],
        "max_s": ts[-1],
        "q1_s": float(q[0]),
        "q3_s": float(q[1]),
        "reps": len(ts),
    }


def compile_jit(jitted, *args):
    """(compiled, lowered, compile seconds) of a jitted function on example ``args``."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    compiled = lowered.compile()
    return compiled, lowered, time.perf_counter() - t0


# ----------------------------------------------------------------------------- collectives

_COLLECTIVE = re.compile(r"=\s*(\w+)\[([\d,]*)\]\S*\s+(all-to-all|all-gather|reduce-scatter)\(")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,{}]*\})\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


def _replica_groups(line: str) -> list[list[int]] | None:
    m = _GROUPS_LIST.search(line)
    if m:
        return [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = _GROUPS_IOTA.search(line)
    if m:
        shape = [int(v) for v in m.group(1).split(",")]
        dims = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    return None


def collective_bytes(hlo_text: str, domain_of: Callable[[int], int]) -> dict[str, Any]:
    """Bytes one device moves through the exchange collectives of an (unoptimized) HLO module.

    Per device and per collective: all-to-all = its buffer (result) bytes, all-gather = the
    gathered (result) bytes, reduce-scatter = its input bytes (result x group size); each
    includes the device's own block. ``cross_domain`` counts the share of those bytes that
    goes to (or comes from) group members in another fast-link domain (``domain_of`` maps a
    device id of the replica groups to its domain). All-reduces (router statistics) are left
    out. Bytes are averaged over the devices in the replica groups.
    """
    out = {"all_to_all": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0, "cross_domain": 0.0, "count": 0}
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        dtype, dims, op = m.groups()
        nbytes = shape_bytes(f"{dtype}[{dims}]")
        groups = _replica_groups(line)
        n = len(groups[0]) if groups else 1
        if op == "reduce-scatter":
            nbytes *= n
        out[op.replace("-", "_")] += nbytes
        out["count"] += 1
        if groups:
            fracs = [sum(domain_of(o) != domain_of(d) for o in g) / len(g) for g in groups for d in g]
            out["cross_domain"] += nbytes * float(np.mean(fracs))
        else:
            out["cross_domain"] = float("nan")
    out["total"] = out["all_to_all"] + out["all_gather"] + out["reduce_scatter"]
    return out


# ----------------------------------------------------------------------------- output


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def environment() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "device_kind": dev.device_kind,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "load_avg": os.getloadavg(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v):
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_ms(timing: dict[str, Any] | None) -> tuple[str, str]:
    """(median ms, 'min-max') of a timing dict."""
    if not timing:
        return "", ""
    return (f"{timing['median_s'] * 1e3:.1f}", f"{timing['min_s'] * 1e3:.1f}-{timing['max_s'] * 1e3:.1f}")


def mib(nbytes: float | None) -> str:
    if nbytes is None or (isinstance(nbytes, float) and math.isnan(nbytes)):
        return ""
    return f"{nbytes / 2**20:.2f}"


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o)}")


def finite_or_none(obj):
    """``obj`` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def section_result(title: str, sizes: Any, **fields: Any) -> dict[str, Any]:
    """A section's results: its title, its ``Sizes`` (a dataclass) as a dict, then ``fields``."""
    return {"title": title, "sizes": dataclasses.asdict(sizes), **fields}


def write_results(out_dir: Path, results: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    json_path.write_text(
        json.dumps(finite_or_none(results), indent=2, default=_json_default, allow_nan=False) + "\n"
    )
    md_path.write_text(markdown + "\n")
    return json_path, md_path
