"""gpu-check section ``overlap``: the chunked token exchange (``moe.overlap_chunks``) and fp8
dispatch on this node's GPUs, with a profile.

The EP layer's forward+backward (the ``a2a`` dispatcher over every local GPU, bf16 tokens and
experts, fp32 router) runs with chunks 1, 2 and 4 and with fp8 dispatch at 4 chunks, timed
side by side (``moe_train.bench.overlap.dispatcher_rows``). Each row is checked against
chunks=1 within ``BOUNDS`` (chunked exchanges: bf16 rounding; fp8 rows: e4m3's step).
``overlap_gain`` is 1 - (fastest chunked time / chunks=1 time): the share of the layer that
the chunking hid here (negative: more, smaller exchanges cost more than they hide, which the
planner's ``a2a_hidden_*`` efficiencies should then say).
A ``jax.profiler`` trace of chunks=1 and of the fastest variant goes to
``<out>/overlap_trace/`` (TensorBoard's profile plugin or Perfetto: each call is annotated
``moe.overlap_chunks/<chunks, dispatch>``), the profile to read beside the planner's model.

Shape letters (``moe_train.base.notation``): T tokens (global), H hidden, F expert width, E
experts, K top-k.
"""

from __future__ import annotations

from typing import Any

from moe_train.bench import overlap
from moe_train.bench.overlap import Sizes
from moe_train.gpucheck import FAIL, PASS, Context, skip, verdict

VARIANTS = ((1, "activation"), (2, "activation"), (4, "activation"), (4, "fp8"))
# largest difference against chunks=1, relative to the tensor's largest magnitude: (output,
# grads). Chunked: bf16 rounding of sums in another order. fp8: e4m3's relative step 2^-4 on
# the output (the tests' fp32 rows stay within 4e-2; bf16 tokens add their own rounding) and
# the tests' gradient bound.
BOUNDS = {"activation": (2e-2, 5e-2), "fp8": (2.0**-4, 0.15)}
TRACE_DIR = "overlap_trace"


def sizes(ctx: Context, n: int):
    """GPU: T 4,096 per device, H 2,048, F 1,024, E 64, K 4; elsewhere toy sizes."""
    if ctx.on_gpu:
        return Sizes(tokens=4096 * n, hidden=2048, ffn=1024, experts=64, top_k=4, min_reps=5, target_s=3.0)
    return Sizes(tokens=32 * n, hidden=16, ffn=16, experts=2 * n, top_k=2, min_reps=1, target_s=0.01)


def operands(s) -> tuple:
    """The bench's operands with tokens and expert weights in bf16 (the router stays fp32)."""
    import jax.numpy as jnp

    x, gate, w0, w1, wo = overlap.operands(s)
    return (
        jnp.asarray(x, jnp.bfloat16),
        jnp.asarray(gate),
        *(jnp.asarray(w, jnp.bfloat16) for w in (w0, w1, wo)),
    )


def _checked(row: dict[str, Any]) -> dict[str, Any]:
    y_bound, g_bound = BOUNDS[row["dispatch_dtype"]]
    ok = row["y_rel_diff"] <= y_bound and row["grad_rel_diff"] <= g_bound
    reason = (
        ""
        if ok
        else (
            f"chunks={row['chunks']} {row['dispatch_dtype']}: output "
            f"{row['y_rel_diff']:.1e} (bound {y_bound:.0e}), grads "
            f"{row['grad_rel_diff']:.1e} (bound {g_bound:.0e}) from chunks=1"
        )
    )
    timing = row["time"]
    row = {k: v for k, v in row.items() if k != "time"}
    return {**row, "fwd_bwd_ms": timing["median_s"] * 1e3, "status": PASS if ok else FAIL, "reason": reason}


def section(ctx: Context, devices=None) -> dict[str, Any]:
    """The section; ``devices`` defaults to every local device (at most 8, a power of two)."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < 2:
        return skip(
            f"one {ctx.platform} device here: the exchange needs two or more "
            "(make bench --only overlap runs it on 8 fake CPU devices)"
        )
    n = max(d for d in (2, 4, 8) if d <= len(devices))
    s = sizes(ctx, n)
    trace = ctx.out_dir / TRACE_DIR
    trace.mkdir(parents=True, exist_ok=True)
    rows = [
        _checked(r)
        for r in overlap.dispatcher_rows(
            s, "a2a", operands(s), devices=devices[:n], domains=(1, n), variants=VARIANTS, profile_dir=trace
        )
    ]
    chunked = [r for r in rows if r["dispatch_dtype"] == "activation" and r["chunks"] > 1]
    best = min(chunked, key=lambda r: r["time_ratio"])
    return verdict(
        rows,
        devices=n,
        tokens=s.tokens,
        hidden=s.hidden,
        experts=s.experts,
        best_chunks=best["chunks"],
        overlap_gain=1.0 - best["time_ratio"],
        trace=str(trace),
    )
