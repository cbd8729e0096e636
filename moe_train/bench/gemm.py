"""Grouped GEMM efficiency: the experts' SwiGLU on routed rows vs one dense GEMM chain.

For each expert count E the tokens scale with E (``rows_per_expert`` assignments per expert
on average, up to ``max_assignments`` in all), so every E runs about the same per-expert
work. Per E and mode (forward, or forward+backward), every candidate of
``moe_train.bench.experts`` runs on the routings of the same tokens (forward+backward:
uniform, Zipf, one hot expert; forward: fewer), side by side with the ``dense``
reference (one SwiGLU on the N useful rows, the physical limit): all functions are compiled
first, warmed up once, then timed in interleaved rounds (``common.time_rounds``).
efficiency = median time / median dense time (1.0 is the limit), with the min-max of the
per-round ratios. padding waste = executed rows / useful rows (tiled: sum of tile-padded
spans; capacity: E*C slots; dense-all: E*T).

Candidates whose estimated timing cost (cost factor x dense time x rounds) or memory
exceeds the budget are listed as skipped with the estimate; so is a backend that cannot run
here (mgpu and te need a GPU).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from moe_train.bench import common
from moe_train.bench import experts as X
from moe_train.bench.common import compile_jit, min_time, ratio_stats, time_rounds
from moe_train.moe.gemm import ragged_dot_expansion_bytes
from moe_train.moe.routings import assignments
from moe_train.moe.tiled import block_sizes, default_block_rows

TITLE = "Grouped GEMM efficiency"


@dataclasses.dataclass(frozen=True)
class Sizes:
    experts: tuple[int, ...]
    rows_per_expert: int  # N = rows_per_expert * E assignments
    hidden: int
    ffn: int
    top_k: int
    routings: tuple[str, ...]  # of the fwd+bwd rows
    fwd_routings: tuple[str, ...]  # of the forward-only rows
    modes: tuple[str, ...]
    candidates: tuple[str, ...]  # grouped backends and baselines, besides the dense reference
    min_reps: int
    max_reps: int
    target_s: float  # timed seconds per group (reps = target / round time, clamped)
    budget_s: float  # skip a candidate whose estimated timing exceeds this
    max_bytes: float = 2.5e9  # skip a candidate whose activations would exceed this
    max_assignments: int = 1 << 30  # cap on N (tokens x top-k) for the largest E
    dtype: str = "float32"
    capacity_factor: float = 1.25


CANDIDATES = ("tiled", "ragged_dot", "mgpu", "te", "capacity", "dense-all")
FULL = Sizes(
    experts=(8, 32, 64, 128),
    rows_per_expert=512,
    hidden=256,
    ffn=512,
    top_k=2,
    routings=("uniform", "zipf", "hot"),
    fwd_routings=("uniform", "hot"),
    modes=("fwd", "fwd+bwd"),
    candidates=CANDIDATES,
    min_reps=3,
    max_reps=7,
    target_s=3.0,
    budget_s=12.0,
    max_assignments=16384,
)
QUICK = dataclasses.replace(
    FULL,
    experts=(8,),
    rows_per_expert=16,
    hidden=32,
    ffn=64,
    routings=("uniform", "hot"),
    fwd_routings=("hot",),
    **common.QUICK_TIMING,
    budget_s=2.0,
    max_assignments=Sizes.max_assignments,  # no cap (FULL caps N)
)


def log(msg: str) -> None:
    print(f"[bench gemm] {msg}", file=sys.stderr, flush=True)


def cost_factor(candidate: str, case: X.Case) -> float:
    """Rough time of a candidate relative to the dense reference, for the skip rule.

    XLA's ragged_dot computes every expert on every row (about E times dense) on CPU and on
    GPU alike: XLA:GPU (jax 0.11.2, seen on an H200) expands it into a dense dot over a
    zero-masked [rows, E x H] operand.
    """
    E, K = case.num_experts, case.experts_TK.shape[1]
    return {"ragged_dot": float(E), "dense-all": E / K, "capacity": case.capacity_factor}.get(candidate, 1.0)


def activation_bytes(candidate: str, case: X.Case) -> float:
    """Rough peak activation bytes of forward+backward (rows x (2F + 2H) x 3 fp32 arrays;
    ragged_dot: its masked [rows, E, H or F] expansions, in the operands' dtype)."""
    if candidate == "ragged_dot":
        return ragged_dot_expansion_bytes(
            case.assignments, case.num_experts, case.hidden, case.ffn, case.dtype
        )
    rows = {
        "dense-all": case.num_experts * case.tokens,
        "capacity": case.assignments * case.capacity_factor,
    }.get(candidate, case.assignments)
    return rows * (2 * case.ffn + 2 * case.hidden) * 4 * 3


def skip_reason(candidate: str, case: X.Case, dense_s: float, s: Sizes) -> str | None:
    """Why a candidate is not timed here (None: time it)."""
    if candidate in X.GROUPED:
        reason = X.unavailable(candidate, case.dtype, case.hidden, case.ffn)
        if reason:
            return reason
    need = activation_bytes(candidate, case)
    if need > s.max_bytes:
        return f"needs ~{need / 1e9:.1f} GB of activations (budget {s.max_bytes / 1e9:.1f} GB)"
    est = cost_factor(candidate, case) * dense_s * (s.min_reps + 1)
    if est > s.budget_s:
        return (
            f"estimated {est:.0f} s to time (~{cost_factor(candidate, case):.0f}x dense per "
            f"call), over the {s.budget_s:.0f} s budget"
        )
    return None


def make_cases(E: int, s: Sizes) -> dict[str, X.Case]:
    T = min(s.rows_per_expert * E, s.max_assignments) // s.top_k
    routings = dict.fromkeys((*s.routings, *s.fwd_routings))
    return {
        r: X.Case(assignments(T, E, s.top_k, r), E, s.hidden, s.ffn, jnp.dtype(s.dtype), s.capacity_factor)
        for r in routings
    }


def _prepare(candidate: str, cases: dict[str, X.Case], mode: str, w) -> tuple[dict, dict, float]:
    """Compile a candidate once (shapes do not depend on routing) and build its operands for
    every routing. Returns ({routing: (compiled, args)}, {routing: layout}, compile seconds)."""
    fn, compiled, secs = X.function(candidate, mode), None, 0.0
    entries, layouts = {}, {}
    for routing, case in cases.items():
        lay = X.build(case, candidate)
        args = (lay.x, *w, lay.aux, X.cotangent(candidate, lay, case.num_experts))
        if compiled is None:
            compiled, _, secs = compile_jit(fn, *args)
        entries[routing], layouts[routing] = (compiled, args), lay
        if candidate in ("dense-all", "dense"):
            break  # routing-independent work: one row
    return entries, layouts, secs


def block_rows(lay: X.Layout) -> int:
    """The largest block the tiled backend runs on this layout (capped by its rows)."""
    m = lay.tile_rows
    assert m is not None, "a layout of the tiled backend"
    return max(block_sizes(m, min(default_block_rows(m), lay.x.shape[0])))


def _row(cand, routing, case, mode, lay, timing, ref, secs) -> dict[str, Any]:
    loads = case.loads()
    useful = case.useful_flops(mode)
    executed = useful * lay.executed_rows / case.assignments
    row = {
        "experts": case.num_experts,
        "tokens": case.tokens,
        "top_k": case.experts_TK.shape[1],
        "assignments": case.assignments,
        "hidden": case.hidden,
        "ffn": case.ffn,
        "dtype": jnp.dtype(case.dtype).name,
        "routing": routing,
        "mode": mode,
        "backend": cand,
        "tile_rows": lay.tile_rows,
        "block_rows": block_rows(lay) if lay.tile_rows else None,
        "max_over_mean_load": float(loads.max() / loads.mean()),
        "useful_flops": useful,
        "executed_flops": executed,
        "padding_waste": executed / useful,
        "drop_rate": lay.drop_rate,
        "compile_s": secs,
        "time": timing,
        "dense_time": ref,
        "skipped": None,
    }
    row.update(ratio_stats(timing, ref))
    row["tflops"] = useful / timing["median_s"] / 1e12
    return row


def group_rows(cases: dict[str, X.Case], mode: str, candidates, s: Sizes) -> list[dict]:
    """Every candidate x routing of one shape and mode, timed side by side with dense."""
    base = next(iter(cases.values()))
    w = X.weights(base)
    dense_entries, dense_layouts, dense_secs = _prepare("dense", cases, mode, w)
    ((dense_fn, dense_args),) = dense_entries.values()
    dense_s = min_time(dense_fn, dense_args)
    entries = {("dense", "-"): (dense_fn, dense_args)}
    layouts = {("dense", "-"): (dense_layouts[next(iter(cases))], dense_secs)}
    skipped = []
    for cand in candidates:
        reason = skip_reason(cand, base, dense_s, s)
        if reason:
            skipped.append({"experts": base.num_experts, "mode": mode, "backend": cand, "skipped": reason})
            continue
        try:
            ents, lays, secs = _prepare(cand, cases, mode, w)
        except jax.errors.JaxRuntimeError as err:  # e.g. RESOURCE_EXHAUSTED while compiling
            skipped.append(
                {
                    "experts": base.num_experts,
                    "mode": mode,
                    "backend": cand,
                    "skipped": f"failed to compile: {str(err).splitlines()[0][:300]}",
                    "error": True,
                }
            )
            continue
        for routing in ents:
            key = (cand, routing if cand != "dense-all" else "-")
            entries[key], layouts[key] = ents[routing], (lays[routing], secs)
    timings = time_rounds(
        {k: v for k, v in entries.items()}, min_reps=s.min_reps, max_reps=s.max_reps, target_s=s.target_s
    )
    ref = timings[("dense", "-")]
    rows = []
    for (cand, routing), timing in timings.items():
        case = cases.get(routing, base)
        lay, secs = layouts[(cand, routing)]
        rows.append(_row(cand, routing, case, mode, lay, timing, ref, secs))
    return rows + skipped


def run(s: Sizes) -> dict[str, Any]:
    """The section's results (JSON-ready; the Markdown is added by the caller)."""
    t0 = time.perf_counter()
    rows: list[dict] = []
    for E in s.experts:
        cases = make_cases(E, s)
        for mode in s.modes:
            t1 = time.perf_counter()
            routings = s.fwd_routings if mode == "fwd" else s.routings
            rows += group_rows({r: cases[r] for r in routings}, mode, s.candidates, s)
            timed = [
                r
                for r in rows
                if r.get("experts") == E
                and r.get("mode") == mode
                and not r["skipped"]
                and r["backend"] == "tiled"
            ]
            log(
                f"E={E} {mode}: tiled/dense "
                + ", ".join(f"{r['routing']} {r['ratio']:.2f}" for r in timed)
                + f" [{time.perf_counter() - t1:.0f} s]"
            )
    return common.section_result(TITLE, s, rows=rows, wall_s=time.perf_counter() - t0)


def summary(rows: list[dict], backend: str = "tiled") -> dict[str, Any]:
    """Worst ratio and padding waste of a backend's timed rows, by mode and routing kind."""
    out: dict[str, Any] = {}
    for mode in X.MODES:
        for kind, routings in (("uniform", ("uniform",)), ("skewed", ("zipf", "hot"))):
            sel = [
                r
                for r in rows
                if not r["skipped"]
                and r["backend"] == backend
                and r["mode"] == mode
                and r["routing"] in routings
            ]
            if sel:
                out[f"{mode} {kind}"] = {
                    "max_ratio": max(r["ratio"] for r in sel),
                    "max_padding_waste": max(r["padding_waste"] for r in sel),
                }
    return out


def realistic(row: dict) -> bool:
    """The issue's realistic-shape rule: tokens x top-k >= 8 x experts x tile rows."""
    return bool(row.get("tile_rows")) and row["assignments"] >= 8 * row["experts"] * row["tile_rows"]
