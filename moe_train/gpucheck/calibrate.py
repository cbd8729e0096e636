"""gpu-check's last section: a compute calibration for ``make plan`` from what this run measured.

On a GPU with a known dense peak (``topology.peaks``) it times a square bf16 matmul (the
practical GEMM rate: ``gemm_efficiency`` = achieved / peak) and takes the best grouped-GEMM
backend's forward+backward useful FLOPs over its time under uniform routing from the
gemm_speed section, of the bf16 peak (``grouped_gemm_efficiency``). From the
attention section, the implementation ``model.attention=auto`` picks here: the model FLOPs of
its causal QK^T and AV as the planner counts them (3 x B S^2 N (Dqk + Dv) forward+backward:
the mask halves 2 x 2 S^2 N D) over its forward+backward time, of the bf16 peak
(``attention_efficiency``). From the fp8 section, the fastest fp8
projection whose HLO has fp8 GEMMs: 3 x 2 M H F over its time, of the fp8 peak
(``fp8_gemm_efficiency``). The other fields keep the shipped defaults
(``moe_train/planner/compute.toml``), and ``[compute.source]`` says which is which. The file is
``<out>/compute.toml``; ``make plan ... SET=...`` reads it with
``python -m moe_train.planner.ep_plan --compute FILE``. Elsewhere (CPU, an unknown GPU) the section is
SKIP: no peak to divide by.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_train.base.platform import as_platform
from moe_train.gpucheck import PASS, Context, skip
from moe_train.model import attention
from moe_train.planner import compute
from topology import peaks

SQUARE = 8192  # side of the timed bf16 matmul (on an H200: ~790 TFLOP/s of 989)
REPS = 10
CHAIN = 8  # dependent matmuls per timed call: the launch and the host sync amortised


def square_matmul_flops_per_s(n: int = SQUARE, reps: int = REPS, chain: int = CHAIN) -> float:
    """Achieved FLOP/s of an n x n x n bf16 matmul (fp32 accumulation, bf16 result), best of
    ``reps`` calls of ``chain`` dependent matmuls in one program (timed one matmul per call,
    an H200 gave 580 TFLOP/s, where PyTorch's GEMM reaches ~790: the launch and sync counted)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16) * (n**-0.5)  # |c| stays ~1

    def step(_, c):
        return jnp.dot(c, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    f = jax.jit(lambda a: jax.lax.fori_loop(0, chain, step, a))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 * chain / best


def grouped_rate(earlier: tuple[dict[str, Any], ...]) -> tuple[float, str] | None:
    """(useful FLOP/s, what ran) of the gemm_speed section's fastest passing fwd+bwd row under
    uniform routing: its useful expert FLOPs over its time. (Not its ratio to the section's
    dense GEMM chain: on an H200 mgpu ran at 0.64x that chain, which is no GEMM peak.)"""
    rows = _timed_rows(
        earlier,
        "gemm_speed",
        lambda r: r.get("mode") == "fwd+bwd" and r.get("routing") == "uniform" and r.get("useful_flops"),
    )
    if not rows:
        return None
    best = max(rows, key=lambda r: r["useful_flops"] / r["time_ms"])
    return (
        best["useful_flops"] / (best["time_ms"] / 1e3),
        f"{best['backend']} grouped GEMM fwd+bwd, {best.get('model', '')} experts, uniform routing",
    )


def _section(earlier: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    return next((sec for sec in earlier if sec.get("name") == name), {})


def _timed_rows(
    earlier: tuple[dict[str, Any], ...], name: str, keep: Callable[[dict[str, Any]], Any]
) -> list[dict[str, Any]]:
    """The rows of section ``name`` that passed, were timed and that ``keep`` accepts."""
    return [
        r
        for r in _section(earlier, name).get("rows", [])
        if r.get("status") == PASS and r.get("time_ms") and keep(r)
    ]


def attention_rate(earlier: tuple[dict[str, Any], ...], platform: str) -> tuple[float, str] | None:
    """(model FLOP/s, what ran) of the attention row of the implementation ``auto`` picks on
    ``platform`` for the section's problem; None when it did not pass or was not timed."""
    sec = _section(earlier, "attention")
    p = sec.get("problem")
    if not p:
        return None
    name, _ = attention.resolve(
        "auto",
        platform=as_platform(platform),
        dtype=p["dtype"],
        head_dim=p["head_dim"],
        v_head_dim=p["v_head_dim"],
        seq_len=p["seq_len"],
    )
    row = next(iter(_timed_rows(earlier, "attention", lambda r: r.get("implementation") == name)), None)
    if row is None:
        return None
    # forward: B S^2 N (Dqk + Dv) (QK^T and AV, halved by the causal mask); x3 with backward
    flops = 3.0 * p["batch"] * p["seq_len"] ** 2 * p["heads"] * (p["head_dim"] + p["v_head_dim"])
    return flops / (row["time_ms"] / 1e3), (
        f"{name} causal attention fwd+bwd, S {p['seq_len']}, "
        f"{p['heads']} heads of {p['head_dim']}, {p['dtype']}"
    )


def fp8_rate(earlier: tuple[dict[str, Any], ...]) -> tuple[float, str] | None:
    """(FLOP/s, what ran) of the fastest passing fp8 projection with fp8 GEMMs in its HLO."""
    rows = _timed_rows(
        earlier, "fp8", lambda r: (r.get("fp8_gemm_calls") or r.get("fp8_dots")) and r.get("shape")
    )
    if not rows:
        return None
    best = min(rows, key=lambda r: r["time_ms"] / math.prod(r["shape"]))
    M, H, F = best["shape"]
    return (
        6.0 * M * H * F / (best["time_ms"] / 1e3),
        f"{best['backend']} fp8 projection fwd+bwd, {M}x{H}x{F}",
    )


def file_text(measured: dict[str, float], why: dict[str, str], base: compute.Compute) -> str:
    """A compute file: ``measured`` fields (with ``why``) over ``base``'s values."""
    lines = [
        "# Written by make gpu-check from its measurements; other fields are the shipped defaults.",
        "[compute]",
    ]
    values = {k: measured[k] if k in measured else getattr(base, k) for k in compute.FIELDS}
    lines += [f"{k} = {min(1.0, max(1e-6, v)):.4f}" for k, v in values.items()]
    lines += ["", "[compute.source]"]
    for k in compute.FIELDS:
        text = why.get(k) or f"shipped default ({base.source.get(k, '')})"
        lines.append(f'{k} = "{text.replace(chr(34), chr(39))}"')
    return "\n".join(lines) + "\n"


def _share(
    measured: dict[str, float],
    why: dict[str, str],
    field: str,
    found: tuple[float, str] | None,
    peak: float,
    rates: str,
) -> None:
    """Record ``found`` (FLOP/s, what ran), if any, as ``field``: its share of ``peak``, and why;
    ``rates`` words the two in TFLOP/s (``{rate:.0f}``, ``{peak:.0f}``)."""
    if found:
        rate, what = found
        measured[field] = rate / peak
        why[field] = f"gpu-check: {what} at " + rates.format(rate=rate / 1e12, peak=peak / 1e12)


def _measured_rates(ctx: Context, peak: float, measured: dict[str, float], why: dict[str, str]) -> None:
    """The attention and fp8 shares from the earlier sections' timings, where they ran."""
    found = attention_rate(ctx.earlier, ctx.platform)
    _share(measured, why, "attention_efficiency", found, peak, "{rate:.0f} model TFLOP/s of {peak:.0f}")
    fp8_peak = peaks.peak_flops(ctx.device_kind, "fp8")
    if fp8_peak:
        found = fp8_rate(ctx.earlier)
        _share(measured, why, "fp8_gemm_efficiency", found, fp8_peak, "{rate:.0f} of {peak:.0f} TFLOP/s fp8")


def section(ctx: Context) -> dict[str, Any]:
    """Measure, then write ``<out>/compute.toml`` (PASS) or say why not (SKIP)."""
    peak = peaks.peak_flops(ctx.device_kind, "bfloat16") if ctx.on_gpu else None
    if peak is None:
        return skip(
            f"no dense bf16 peak for {ctx.platform} {ctx.device_kind!r} "
            "(topology.peaks): nothing to divide by"
        )
    rate = square_matmul_flops_per_s()
    measured = {"gemm_efficiency": rate / peak}
    why = {
        "gemm_efficiency": f"gpu-check: {SQUARE}^3 bf16 matmul at {rate / 1e12:.0f} of "
        f"{peak / 1e12:.0f} TFLOP/s on {ctx.device_kind}"
    }
    found = grouped_rate(ctx.earlier)
    _share(measured, why, "grouped_gemm_efficiency", found, peak, "{rate:.0f} of {peak:.0f} TFLOP/s")
    _measured_rates(ctx, peak, measured, why)
    path = Path(ctx.out_dir) / "compute.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(file_text(measured, why, compute.load()))
    compute.load(path)  # what it wrote reads back
    return {
        "status": PASS,
        "reason": "",
        "file": str(path),
        "tflops_square": rate / 1e12,
        "rows": [{"field": k, "value": v, "status": PASS, "source": why[k]} for k, v in measured.items()],
    }
