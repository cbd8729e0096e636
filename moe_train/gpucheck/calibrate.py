"""gpu-check's last section: a compute calibration for ``make plan`` from what this run measured.

On a GPU with a known dense peak (``topology.peaks``) it times a square bf16 matmul (the
practical GEMM rate: ``gemm_efficiency`` = achieved / peak) and takes the best grouped-GEMM
backend's forward+backward ratio to a dense GEMM chain under uniform routing from the
gemm_speed section (``grouped_gemm_efficiency`` = gemm_efficiency / ratio). The other fields
keep the shipped defaults (``topology/compute.toml``), and ``[compute.source]`` says which is
which. The file is ``<out>/compute.toml``; ``make plan ... SET=...`` reads it with
``python -m topology plan --compute FILE``. Elsewhere (CPU, an unknown GPU) the section is
SKIP: no peak to divide by.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from moe_train.gpucheck import PASS, Context, skip
from topology import compute, peaks

SQUARE = 8192  # side of the timed bf16 matmul (on an H200: ~790 TFLOP/s of 989)
REPS = 10


def square_matmul_flops_per_s(n: int = SQUARE, reps: int = REPS) -> float:
    """Achieved FLOP/s of an n x n x n bf16 matmul (fp32 accumulation), best of ``reps``."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def grouped_ratio(earlier: tuple[dict[str, Any], ...]) -> tuple[float, str] | None:
    """(best ratio, its backend) of the gemm_speed section's passing fwd+bwd uniform rows."""
    for sec in earlier:
        if sec.get("name") != "gemm_speed":
            continue
        rows = [r for r in sec.get("rows", []) if r.get("status") == PASS
                and r.get("mode") == "fwd+bwd" and r.get("routing") == "uniform"
                and r.get("ratio")]
        if rows:
            best = min(rows, key=lambda r: r["ratio"])
            return float(best["ratio"]), str(best["backend"])
    return None


def file_text(measured: dict[str, float], why: dict[str, str], base: compute.Compute) -> str:
    """A compute file: ``measured`` fields (with ``why``) over ``base``'s values."""
    lines = ["# Written by make gpu-check from its measurements; other fields are the shipped "
             "defaults.", "[compute]"]
    values = {k: measured.get(k, getattr(base, k)) for k in compute.FIELDS}
    lines += [f"{k} = {min(1.0, max(1e-6, v)):.4f}" for k, v in values.items()]
    lines += ["", "[compute.source]"]
    for k in compute.FIELDS:
        text = why.get(k) or f"shipped default ({base.source.get(k, '')})"
        lines.append(f'{k} = "{text.replace(chr(34), chr(39))}"')
    return "\n".join(lines) + "\n"


def section(ctx: Context) -> dict[str, Any]:
    """Measure, then write ``<out>/compute.toml`` (PASS) or say why not (SKIP)."""
    peak = peaks.peak_flops(ctx.device_kind, "bfloat16") if ctx.on_gpu else None
    if peak is None:
        return skip(f"no dense bf16 peak for {ctx.platform} {ctx.device_kind!r} "
                    "(topology.peaks): nothing to divide by")
    rate = square_matmul_flops_per_s()
    measured = {"gemm_efficiency": rate / peak}
    why = {"gemm_efficiency": f"gpu-check: {SQUARE}^3 bf16 matmul at {rate / 1e12:.0f} of "
                              f"{peak / 1e12:.0f} TFLOP/s on {ctx.device_kind}"}
    found = grouped_ratio(ctx.earlier)
    if found:
        ratio, backend = found
        measured["grouped_gemm_efficiency"] = measured["gemm_efficiency"] / ratio
        why["grouped_gemm_efficiency"] = (f"gpu-check: {backend} grouped GEMM fwd+bwd at "
                                          f"{ratio:.2f}x a dense GEMM chain (uniform routing)")
    path = Path(ctx.out_dir) / "compute.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(file_text(measured, why, compute.load()))
    compute.load(path)  # what it wrote reads back
    return {"status": PASS, "reason": "", "file": str(path), "tflops_square": rate / 1e12,
            "rows": [{"field": k, "value": v, "status": PASS, "source": why[k]}
                     for k, v in measured.items()]}
