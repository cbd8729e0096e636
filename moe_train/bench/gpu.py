"""GPU rows (``python -m moe_train.bench --gpu``, ``make bench-gpu``): one prepared run.

On one GPU, in bf16: the MoE layer forward+backward of Mixtral-8x7B-shaped experts
(H=4096, F=14336, E=8, top-2, softmax router) and DeepSeek-V3-shaped experts (H=7168,
F=2048, E=256, top-8, sigmoid group-limited router with bias), per grouped-GEMM backend
(mgpu, ragged_dot, tiled; te where Transformer Engine imports). TFLOP/s count the useful
expert FLOPs (18*T*K*H*F per forward+backward; the router is left out) and are reported as a
fraction of two dense bf16 references measured in the same run: a dense SwiGLU forward+backward
on the T*K useful rows (the same FLOPs in plain GEMMs) and one large square bf16 GEMM (the
device's practical GEMM peak). Then the experts' grouped GEMM alone (uniform and one hot
expert routing) per backend, like the CPU section.

Every row is timed side by side with its shape's dense reference (``common.time_rounds``).
A deadline (``budget_s``, default 480 s) bounds the whole run: rows that would start after
it are listed as skipped, so the run always finishes within one device lease. ``--tiny``
runs the same code at toy sizes (on CPU: the code path tests itself; mgpu and te are then
reported unavailable).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from moe_train.bench import experts as X
from moe_train.bench import gemm
from moe_train.bench.common import compile_jit, time_rounds
from moe_train.bench.layer import dense_fn, layer_fn, layer_row, operands, too_big, unavailable
from moe_train.moe.routings import MoEShape, assignments

TITLE = "GPU: MoE layer TFLOP/s against dense bf16"
BACKENDS = ("mgpu", "ragged_dot", "tiled", "te")


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    shape: MoEShape
    router: dict


@dataclasses.dataclass(frozen=True)
class Sizes:
    models: tuple[Model, ...]
    square: int  # side of the square dense GEMM reference
    gemm_routings: tuple[str, ...]
    min_reps: int = 3
    max_reps: int = 10
    target_s: float = 3.0
    budget_s: float = 480.0
    dtype: str = "bfloat16"


DEEPSEEK_ROUTER = dict(score_function="sigmoid", num_groups=8, group_top_k=4, routed_scaling=2.5)
FULL = Sizes(
    models=(
        Model("mixtral-8x7b", MoEShape(4096, 4096, 14336, 8, 2), dict(score_function="softmax")),
        Model("deepseek-v3", MoEShape(4096, 7168, 2048, 256, 8), DEEPSEEK_ROUTER),
    ),
    square=8192,
    gemm_routings=("uniform", "hot"),
)
TINY = Sizes(
    models=(
        Model("mixtral-tiny", MoEShape(256, 64, 128, 8, 2), dict(score_function="softmax")),
        Model(
            "deepseek-tiny", MoEShape(256, 64, 64, 16, 4), dict(DEEPSEEK_ROUTER, num_groups=4, group_top_k=2)
        ),
    ),
    square=256,
    gemm_routings=("hot",),
    max_reps=3,
    target_s=0.05,
    budget_s=120.0,
)


def log(msg: str) -> None:
    print(f"[bench gpu] {msg}", file=sys.stderr, flush=True)


def square_gemm(n: int, dtype, s: Sizes) -> dict[str, Any]:
    """TFLOP/s of one n x n x n dense GEMM (fp32 accumulation, output in dtype)."""
    a = jnp.ones((n, n), dtype)
    fn, _, secs = compile_jit(
        jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)), a, a
    )
    t = time_rounds({"gemm": (fn, (a, a))}, min_reps=s.min_reps, max_reps=s.max_reps, target_s=s.target_s)[
        "gemm"
    ]
    return {"n": n, "time": t, "tflops": 2.0 * n**3 / t["median_s"] / 1e12, "compile_s": secs}


def layer_rows(model: Model, s: Sizes, deadline: float) -> list[dict]:
    """Layer fwd+bwd per backend, side by side with the dense SwiGLU reference."""
    shape, dtype = model.shape, jnp.dtype(s.dtype)
    moe_ops, dense_ops, dy, dy_n = operands(shape, dtype)
    dense, _, secs = compile_jit(dense_fn(), *dense_ops, dy_n)
    fns: dict[str, tuple[Callable, tuple]] = {"dense": (dense, (*dense_ops, dy_n))}
    compile_s, rows = {"dense": secs}, []
    for kind in BACKENDS:
        reason = unavailable(kind, shape, dtype) or too_big(kind, shape, dtype)
        if reason is None and time.perf_counter() > deadline:
            reason = "over the run's time budget"
        if reason:
            rows.append(
                {**dataclasses.asdict(shape), "model": model.name, "backend": kind, "skipped": reason}
            )
            continue
        fn, _, compile_s[kind] = compile_jit(layer_fn(kind, shape, model.router), *moe_ops, dy)
        fns[kind] = (fn, (*moe_ops, dy))
    outs: dict = {}
    timings = time_rounds(fns, min_reps=s.min_reps, max_reps=s.max_reps, target_s=s.target_s, outputs=outs)
    for kind, timing in timings.items():
        stats = dataclasses.asdict(jax.device_get(outs[kind][1])) if kind != "dense" else {}
        row = layer_row(
            shape,
            kind,
            "-" if kind == "dense" else model.router["score_function"],
            timing,
            timings["dense"],
            stats,
            compile_s[kind],
        )
        row.update(model=model.name, dtype=dtype.name, tflops=row["useful_flops"] / timing["median_s"] / 1e12)
        rows.append(row)
    return rows


def gemm_rows(model: Model, s: Sizes, deadline: float, modes: tuple[str, ...] = ("fwd+bwd",)) -> list[dict]:
    """The grouped GEMM alone per backend, routing and mode, like the CPU section."""
    if time.perf_counter() > deadline:
        return [{"model": model.name, "backend": "all", "skipped": "over the run's time budget"}]
    shape = model.shape
    cases = {
        r: X.Case(
            assignments(shape.tokens, shape.experts, shape.top_k, r),
            shape.experts,
            shape.hidden,
            shape.ffn,
            jnp.dtype(s.dtype),
        )
        for r in s.gemm_routings
    }
    sizes = gemm.Sizes(
        experts=(shape.experts,),
        rows_per_expert=0,
        hidden=shape.hidden,
        ffn=shape.ffn,
        top_k=shape.top_k,
        routings=s.gemm_routings,
        fwd_routings=(),
        modes=modes,
        candidates=("mgpu", "ragged_dot", "tiled", "te"),
        min_reps=s.min_reps,
        max_reps=s.max_reps,
        target_s=s.target_s,
        budget_s=max(1.0, deadline - time.perf_counter()),
        max_bytes=60e9,
        dtype=s.dtype,
    )
    rows = []
    for mode in modes:
        rows += gemm.group_rows(cases, mode, sizes.candidates, sizes)
    for r in rows:
        r["model"] = model.name
    return rows


def run(s: Sizes) -> dict[str, Any]:
    """The GPU section's results: square GEMM, layer rows, grouped-GEMM rows."""
    t0 = time.perf_counter()
    deadline = t0 + s.budget_s
    dtype = jnp.dtype(s.dtype)
    square = square_gemm(s.square, dtype, s)
    log(f"dense {s.square}^3 GEMM: {square['tflops']:.1f} TFLOP/s")
    layers, gemms = [], []
    for model in s.models:
        layers += layer_rows(model, s, deadline)
        log(
            f"{model.name} layer: "
            + ", ".join(
                f"{r['backend']} {r['tflops']:.1f} TFLOP/s"
                for r in layers
                if r.get("model") == model.name and not r["skipped"]
            )
        )
    for model in s.models:
        gemms += gemm_rows(model, s, deadline)
    for r in layers:
        if not r["skipped"]:
            r["fraction_of_square_gemm"] = r["tflops"] / square["tflops"]
            r["fraction_of_dense_swiglu"] = 1.0 / r["ratio"]
    return {
        "title": TITLE,
        "sizes": dataclasses.asdict(s),
        "device": str(jax.devices()[0]),
        "device_kind": jax.devices()[0].device_kind,
        "square_gemm": square,
        "layer_rows": layers,
        "gemm_rows": gemms,
        "wall_s": time.perf_counter() - t0,
    }
