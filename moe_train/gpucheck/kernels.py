"""Sections that check kernels in this process: environment, grouped GEMM, attention, fp8.

Sizes: on a GPU the experts are Mixtral-8x7B-like (H 4096, F 14336, E 8, top-2) and
DeepSeek-V3-like (H 7168, F 2048, top-8, 32 experts) with a reduced token count; attention runs
at S 4096 with 32 query and 8 key/value heads of 128. Without a GPU the same code runs at toy
sizes. Tolerances are ``moe_train.selftest.checks.TOLERANCE`` (per dtype) and
``FP8_TOLERANCE``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform as host_platform
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from moe_train.base.platform import Platform, as_platform
from moe_train.bench import gpu
from moe_train.bench.experts import unavailable
from moe_train.gpucheck import FAIL, PASS, SKIP, Context, over_budget, runs, verdict
from moe_train.model import attention as attn
from moe_train.model import precision_te
from moe_train.selftest import checks

ROUTINGS = ("uniform", "zipf", "hot", "empty")
GROUPED = ("tiled", "ragged_dot", "mgpu", "te")
# name: (tokens, hidden, ffn, experts, top_k) on a GPU / without one
# (DeepSeek-like keeps V3's expert shape and top-8 with 32 of its 256 experts: the fp32
# reference and the gradients of all 256 would need ~135 GB; the grouped-GEMM rows below,
# moe_train.bench.gpu.gemm_rows, time all 256.)
SHAPES = {
    "gpu": {"mixtral-like": (512, 4096, 14336, 8, 2), "deepseek-like": (256, 7168, 2048, 32, 8)},
    "cpu": {"mixtral-like": (64, 64, 128, 8, 2), "deepseek-like": (64, 64, 64, 16, 4)},
}
ATTENTION = {
    "gpu": checks.AttentionProblem(1, 4096, 32, 8, 128, 128, "bfloat16"),
    "cpu": checks.AttentionProblem(1, 256, 4, 2, 32, 32, "float32"),
}
FP8_SHAPE = {"gpu": (4096, 4096, 4096), "cpu": (64, 128, 128)}
TIME_REPS = 5


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvml() -> tuple[str | None, int | None]:
    """(driver version, GPU 0's total memory in bytes) from NVML; None where it is absent."""
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
        return (v.decode() if isinstance(v, bytes) else str(v)), int(total)
    except Exception:  # noqa: BLE001 (no NVML: no driver version)
        return None, None


def _te() -> dict[str, Any]:
    err = precision_te._import_error()
    if err:
        return {"imports": False, "error": err}
    recipes = {
        r: precision_te.unavailable_reason(r) or "supported" for r in precision_te.MIN_COMPUTE_CAPABILITY
    }
    return {"imports": True, "version": _version("transformer_engine"), "recipes": recipes}


def environment(ctx: Context) -> dict[str, Any]:
    """What this machine is: device, memory, driver, versions, Transformer Engine."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    driver, total = _nvml() if ctx.on_gpu else (None, None)
    info = {
        "platform": ctx.platform,
        "device_kind": dev.device_kind,
        "devices": ctx.device_count,
        "sm_count": getattr(dev, "core_count", None),
        "compute_capability": getattr(dev, "compute_capability", None),
        "memory_bytes": total,  # the GPU's (NVML); JAX's allocator may take a share of it
        "allocator_limit_bytes": stats.get("bytes_limit"),
        "driver": driver,
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "xla_platform_version": str(getattr(dev.client, "platform_version", "")),
        "cudnn": Platform.here().cudnn_version,
        "python": host_platform.python_version(),
        "packages": {
            p: _version(p)
            for p in ("flax", "optax", "orbax-checkpoint", "nvidia-ml-py", "submitit", "pytest")
        },
        "transformer_engine": _te() if ctx.on_gpu else {"imports": False, "error": "no GPU"},
    }
    if not ctx.on_gpu:
        return {"status": PASS, "reason": f"no GPU: jax.default_backend() is {ctx.platform!r}", **info}
    missing = [k for k in ("sm_count", "compute_capability", "memory_bytes", "driver") if not info[k]]
    return {"status": PASS, "reason": f"not reported: {', '.join(missing)}" if missing else "", **info}


def _shapes(ctx: Context) -> dict[str, tuple[int, ...]]:
    return SHAPES["gpu" if ctx.on_gpu else "cpu"]


def _reason(backend: str, hidden: int, ffn: int) -> str | None:
    return unavailable(backend, jnp.bfloat16, hidden, ffn)


def _result_row(res: checks.Result, **fields) -> dict[str, Any]:
    row = {**fields, "errors": res.errors, "tolerance": next(iter(res.tolerance.values()), None)}
    if res.time_s is not None:
        row["time_ms"] = res.time_s * 1e3
    if res.ok:
        return {**row, "status": PASS}
    return {**row, "status": FAIL, "reason": res.error or res.line()}


def gemm_numerics(ctx: Context) -> dict[str, Any]:
    """Every backend x shape x routing in bf16 against the fp32 per-expert reference."""
    rows = []
    for shape, (T, H, F, E, K) in _shapes(ctx).items():
        for backend in GROUPED:
            reason = _reason(backend, H, F)
            if reason:
                rows.append({"shape": shape, "backend": backend, "status": SKIP, "reason": reason})
                continue
            cand = checks.gemm_vjp(backend, E)  # one compilation per shape, every routing
            for routing in ROUTINGS:
                if ctx.left() <= 0:
                    rows.append(over_budget(shape=shape, backend=backend, routing=routing))
                    continue
                p = checks.GemmProblem(T, H, F, E, K, "bfloat16", routing)
                t0 = time.perf_counter()  # the first routing's includes the compilations
                res = checks.check_gemm(backend, p, cand=cand)
                rows.append(
                    _result_row(
                        res,
                        shape=shape,
                        backend=backend,
                        routing=routing,
                        seconds=round(time.perf_counter() - t0, 2),
                    )
                )
    checks._expert_weights.cache_clear()  # give the device memory back to the next sections
    return verdict(rows, dtype="bfloat16", tolerance=checks.TOLERANCE["bfloat16"])


def gemm_speed(ctx: Context) -> dict[str, Any]:
    """Each backend's grouped GEMM (fwd, fwd+bwd) over a dense GEMM chain of the same FLOPs."""
    sizes = gpu.FULL if ctx.on_gpu else gpu.TINY
    rows = []
    for model in sizes.models:
        if ctx.left() <= 0:
            rows.append(over_budget(model=model.name))
            continue
        for r in gpu.gemm_rows(model, sizes, ctx.deadline, modes=("fwd", "fwd+bwd")):
            if r.get("skipped"):
                rows.append(
                    {
                        "model": r["model"],
                        "backend": r["backend"],
                        "mode": r.get("mode"),
                        "status": FAIL if r.get("error") else SKIP,
                        "reason": r["skipped"],
                    }
                )
            else:
                rows.append(
                    {k: r.get(k) for k in ("model", "backend", "routing", "mode", "ratio", "useful_flops")}
                    | {"time_ms": r["time"]["median_s"] * 1e3, "status": PASS}
                )
    return verdict(
        [r for r in rows if r.get("backend") != "dense"],
        dtype=sizes.dtype,
        note="ratio = backend time / dense GEMM chain time (1.0 is the dense limit)",
    )


def _temp_bytes(fn, args) -> int | None:
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return None if stats is None else int(stats.temp_size_in_bytes)


def attention(ctx: Context) -> dict[str, Any]:
    """Every implementation the trainer can pick here vs the xla reference (fp32)."""
    p = ATTENTION["gpu" if ctx.on_gpu else "cpu"]
    rows = []
    for name, reason in attn.available(
        platform=as_platform(ctx.platform), dtype=p.dtype, head_dim=p.head_dim, v_head_dim=p.v_head_dim
    ).items():
        if reason:
            rows.append({"implementation": name, "status": SKIP, "reason": reason})
        elif ctx.left() <= 0:
            rows.append(over_budget(implementation=name))
        else:
            res = checks.check_attention(name, p, time_reps=TIME_REPS)
            row = _result_row(res, implementation=name, seq_len=p.seq_len, dtype=p.dtype)
            if res.ok:
                q, k, v, dy = checks.attention_operands(p)
                row["temp_bytes_fwd_bwd"] = _temp_bytes(
                    jax.grad(
                        lambda q, k, v, name=name, dy=dy: jnp.vdot(
                            attn.attend(q, k, v, implementation=name).astype(jnp.float32), dy
                        ),
                        argnums=(0, 1, 2),
                    ),
                    (q, k, v),
                )
            rows.append(row)
    return verdict(rows, problem=dataclasses.asdict(p))


FP8_GEMM = re.compile(r'custom_call_target="([^"]*(?:f8|fp8|F8)[^"]*)"')
CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
DEFINITION = re.compile(r"%?([\w.\-]+) = (\w+)\[")
_OPERAND = r"(?:(\w+)\[[^\]]*\](?:\{[^}]*\})? )?%?([\w.\-]+)"  # "[type[dims]{layout} ]%name"
DOT = re.compile(rf"= (\w+)\[[^\]]*\][^=]*? dot\({_OPERAND}, {_OPERAND}\)")


def hlo_gemms(hlo_text: str) -> dict[str, Any]:
    """What the optimized HLO's matmuls became: fp8 GEMM custom calls (cuBLASLt), other
    custom calls, plain dots (inside Triton GEMM fusions on a GPU) by result type, how many
    of those dots take two fp8 operands (Triton fp8 GEMMs), and ``fp8_gemms``, both counted.
    On an H200 (jax 0.11.2) the autotuned compile made the fp8 projection's three matmuls
    cuBLASLt fp8 calls; the deviceless compile (no autotuning) made them Triton fp8 dots."""
    types = dict(DEFINITION.findall(hlo_text))  # instruction names are unique in a module
    dots: dict[str, int] = {}
    fp8_dots = 0
    for result, lhs_type, lhs, rhs_type, rhs in DOT.findall(hlo_text):
        dots[result] = dots.get(result, 0) + 1
        fp8_dots += all(
            (t or types.get(op, "")).startswith("f8") for t, op in ((lhs_type, lhs), (rhs_type, rhs))
        )
    fp8_calls = FP8_GEMM.findall(hlo_text)
    return {
        "fp8_gemm_calls": sorted(set(fp8_calls)),
        "fp8_gemms": len(fp8_calls) + fp8_dots,
        "custom_calls": sorted(set(CUSTOM_CALL.findall(hlo_text))),
        "dots": dots,
        "fp8_dots": fp8_dots,
    }


def _fp8_backends(ctx: Context) -> dict[str, str | None]:
    reasons: dict[str, str | None] = {"xla": None}
    if not ctx.on_gpu:
        reasons["te"] = "Transformer Engine needs an NVIDIA GPU"
    else:
        reasons["te"] = precision_te.unavailable_reason("delayed")
    return reasons


def _fp8_row(ctx: Context, backend: str) -> dict[str, Any]:
    shape = FP8_SHAPE["gpu" if ctx.on_gpu else "cpu"]
    res = checks.check_fp8(backend, "delayed", shape=shape, time_reps=TIME_REPS)
    row = _result_row(res, backend=backend, shape=shape)
    if not res.ok:
        return row
    M, H, F = shape
    x, w = jnp.zeros((M, H), jnp.bfloat16), jnp.zeros((H, F), jnp.bfloat16)
    dy = jnp.zeros((M, F), jnp.bfloat16)  # an argument: a constant cotangent folds away
    probe = checks.fp8_probe(backend, "delayed", 16, 0)

    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(probe, x, w)
        return y, vjp(dy)

    hlo_text = jax.jit(fwd_bwd).lower(x, w, dy).compile().as_text()
    assert hlo_text is not None, "a compiled executable's HLO"
    found = hlo_gemms(hlo_text)
    row.update(found)
    if ctx.on_gpu and found["fp8_gemms"] < 3:
        row.update(
            status=FAIL,
            reason=f"{found['fp8_gemms']} fp8 GEMMs where y, dx and dw "
            f"need 3 in the optimized HLO: dots {found['dots']}, "
            f"{found['fp8_dots']} on fp8 operands, custom calls "
            f"{found['custom_calls']}",
        )
    elif not ctx.on_gpu:
        row["note"] = f"{ctx.platform}: fp8 numerics emulated (q/dq around bf16/fp32 dots), no fp8 GEMMs"
    return row


def fp8(ctx: Context) -> dict[str, Any]:
    """fp8 projections per backend (numerics, HLO) and a short fp8 run against bf16."""
    rows = []
    for backend, reason in _fp8_backends(ctx).items():
        rows.append(
            {"backend": backend, "status": SKIP, "reason": reason} if reason else _fp8_row(ctx, backend)
        )
    rows += runs.fp8_loss_band(ctx)
    return verdict(rows, tolerance=checks.FP8_TOLERANCE)
