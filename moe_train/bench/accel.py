"""The accelerator benchmark (``python -m moe_train.bench --accel``, ``make bench-accel``; ``--gpu``
is the same): one prepared run on whatever accelerator JAX sees (a TPU, a GPU), in bf16.

Layer section: the MoE layer forward+backward at the expert shapes of Mixtral-8x7B,
Qwen3-30B-A3B and a DeepSeek-V3-like layer (32 experts). Each shape's T is halved until its
operands and a forward+backward working set (``footprint_bytes``, an estimate) fit
``memory_fraction`` of the device's memory (``memory_stats()["bytes_limit"]``); the row says
so. Rows per shape, timed side by side in interleaved rounds (``common.time_rounds``):

- ``dense``: one SwiGLU on the T*K useful rows with one expert's weights: the same useful
  FLOPs in plain GEMMs, the limit;
- ``plain``: the layer as written with JAX alone (``plain_layer``): router, top-k,
  ``jnp.argsort`` of the T*K expert ids, row gather, ``lax.ragged_dot`` for the three SwiGLU
  GEMMs, unsort, weighted combine;
- ``auto``: ``dropless_moe(backend="auto")``, with the backend it resolved to (that backend is
  timed once, as this row);
- ``megablox padded`` where megablox runs here: the same with each expert's rows padded to
  megablox's row tile (``moe.tile_rows``), so no tile of rows spans two groups;
- every other concrete backend ``moe.gemm.available_backends`` lists for the shape.

Each row: median time, ratio to dense (with the per-round spread), TFLOP/s of the useful
expert FLOPs (18*T*K*H*F per forward+backward; the router is not counted). A square bf16 GEMM
gives the device's practical matmul rate. Step section: ``accel_step`` (a MoE model and its
dense twin in the trainer's step: tokens/s, TFLOP/s per device, MFU). Goals (issue 49): the
layer as ``auto`` runs it at most ``LAYER_OVER_DENSE`` x dense and faster than ``plain`` at
each shape; the step at least ``STEP_OVER_DENSE`` x its dense twin's TFLOP/s and ``MFU``.

A deadline bounds the run: layer rows that would start after ``budget_s - step_reserve_s``,
and step rows after ``budget_s``, are listed as skipped. A variant that fails to compile or
run (VMEM or HBM exhausted, a kernel refusing the shape) is a row saying so; where the plain
layer ran out of device memory, it and ``auto`` run again beside dense at half the tokens, and
the goal ``auto`` / plain compares them there. ``TINY``: toy
sizes, so the code path runs on CPU (CI).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from moe_train.base.choices import BACKENDS
from moe_train.bench import accel_step, common, profile
from moe_train.bench.common import ACCEL_SHAPES, compile_jit, fmt_ms, markdown_table, time_rounds
from moe_train.bench.layer import dense_fn, layer_fn, layer_row, operands, too_big
from moe_train.moe import megablox
from moe_train.moe.gemm import available_backends, resolve_backend
from moe_train.moe.routings import MoEShape
from moe_train.train import fits
from topology import peaks

TITLE = "Accelerator: MoE layer and train step"
F32 = jnp.float32
LAYER_OVER_DENSE = 1.5  # goal: the layer as auto runs it, time / dense time, at most
PADDED = "megablox padded"  # the variant with each expert's rows padded to the row tile


def variant_names() -> tuple[str, ...]:
    """Every layer variant a row can be (beside ``dense``): ``--variants`` chooses among them."""
    return ("plain", "auto", PADDED, *BACKENDS[1:])


STEP_OVER_DENSE = 0.8  # goal: MoE step TFLOP/s / its dense twin's, at least
MFU = 0.40  # goal: the MoE step's model FLOP/s / the device's dense bf16 peak, at least
Say = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Shape:
    """One expert shape of the layer section."""

    name: str  # the model it is taken from
    shape: MoEShape  # T, H, F, E, top-k at full size (T may be scaled down to fit the device)
    score_function: str  # router: softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3; with an expert bias)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Everything one run measures, and its bounds."""

    shapes: tuple[Shape, ...]  # the layer section's expert shapes
    step_models: tuple[accel_step.StepModel, ...]  # the step section's candidates, largest first
    square: int  # side of the square bf16 GEMM (the device's practical matmul rate)
    min_reps: int = 5  # timed rounds per shape, at least
    max_reps: int = 10  # timed rounds per shape, at most
    target_s: float = 4.0  # timed seconds per shape (rounds = this / one round, clamped)
    budget_s: float = 500.0  # the run's deadline, seconds after its start (a v5e: 412 s on 2026-12-07)
    step_reserve_s: float = 150.0  # seconds of the budget kept for the step section
    memory_fraction: float = 0.8  # share of the device's memory one shape may use (footprint_bytes)
    step_memory_fraction: float = 0.9  # share the step model may take by the memory planner (errs high)
    min_tokens: int = 256  # T is not scaled below this
    dtype: str = "bfloat16"  # operands and expert GEMMs (fp32 accumulation)
    variants: tuple[str, ...] | None = None  # the layer rows run beside dense (None: every one)


FULL = Sizes(
    shapes=tuple(Shape(*spec) for spec in ACCEL_SHAPES),
    step_models=accel_step.MODELS,
    square=8192,
)
TINY = Sizes(
    shapes=(
        Shape("mixtral-tiny", MoEShape(256, 64, 128, 8, 2), "softmax"),
        Shape("qwen3-tiny", MoEShape(512, 64, 32, 32, 8), "softmax"),
        Shape("deepseek-tiny", MoEShape(256, 64, 64, 16, 8), "sigmoid"),
    ),
    step_models=(accel_step.TINY,),
    square=256,
    min_reps=3,
    **common.QUICK_TIMING,
    budget_s=240.0,
    step_reserve_s=120.0,
    min_tokens=64,
)


# ----------------------------------------------------------------------------- sizing


def device_memory() -> float | None:
    """Bytes the first device may allocate (``fits.bytes_limit``); None where the platform
    does not say (CPU)."""
    limit = fits.bytes_limit(jax.devices()[0])
    return None if limit is None else float(limit)


def footprint_bytes(shape: MoEShape, dtype) -> int:
    """Estimated device bytes of one shape's rows, all in ``dtype``: the operands (expert
    weights and their gradients, x and dy, the dense reference's T*K rows, cotangents and
    weights with gradients) plus a forward+backward working set of 4 H-wide rows (in, out and
    their gradients) and 6 F-wide rows (both SwiGLU inputs, the product and their gradients)
    per assignment."""
    T, H, F, E, K = shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k
    M = T * K
    operands = 2 * 3 * E * H * F + 2 * T * H + 2 * M * H + 2 * 3 * H * F
    return (operands + M * (4 * H + 6 * F)) * jnp.dtype(dtype).itemsize


def fit(
    shape: MoEShape, dtype, limit: float | None, fraction: float, min_tokens: int
) -> tuple[MoEShape | None, str | None]:
    """``shape`` with T halved until ``footprint_bytes`` fits ``fraction * limit``, and a note
    saying so (None when unchanged or no limit is known); (None, why) when T = ``min_tokens``
    does not fit either."""
    if limit is None:
        return shape, None
    budget, fitted = fraction * limit, shape
    while footprint_bytes(fitted, dtype) > budget and fitted.tokens // 2 >= min_tokens:
        fitted = dataclasses.replace(fitted, tokens=fitted.tokens // 2)
    need, gib = footprint_bytes(fitted, dtype) / 2**30, limit / 2**30
    if need * 2**30 > budget:
        return (
            None,
            f"does not fit: ~{need:.1f} GiB at T={fitted.tokens}, over {fraction:.0%} of {gib:.2f} GiB",
        )
    if fitted == shape:
        return shape, None
    return fitted, f"T scaled {shape.tokens} -> {fitted.tokens} to fit {fraction:.0%} of {gib:.2f} GiB"


# ----------------------------------------------------------------------------- the plain layer


def plain_layer(x_TH, gate_HE, w0_EHF, w1_EHF, wo_EFH, *, top_k: int, score_function: str, expert_bias=None):
    """The MoE layer as written with JAX alone: scores (softmax, or sigmoid with the bias added
    for choosing), top-k, the chosen weights normalised, ``argsort`` of the T*K expert ids, row
    gather, ``lax.ragged_dot`` for the three SwiGLU GEMMs (fp32 accumulation), unsort, weighted
    combine. Returns y [T, H] in x's dtype."""
    T, H = x_TH.shape
    E, dtype = gate_HE.shape[1], x_TH.dtype
    logits_TE = jnp.dot(x_TH.astype(F32), gate_HE.astype(F32))
    scores_TE = jax.nn.softmax(logits_TE) if score_function == "softmax" else jax.nn.sigmoid(logits_TE)
    choice_TE = scores_TE if expert_bias is None else scores_TE + expert_bias
    _, experts_TK = jax.lax.top_k(jax.lax.stop_gradient(choice_TE), top_k)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=1)
    weights_TK = weights_TK / weights_TK.sum(axis=1, keepdims=True)
    experts_M = experts_TK.reshape(-1)
    order_M = jnp.argsort(experts_M)  # assignments sorted by expert
    sizes_E = jnp.bincount(experts_M, length=E).astype(jnp.int32)
    gmm = lambda a, w: jax.lax.ragged_dot(a, w.astype(dtype), sizes_E, preferred_element_type=F32)
    x_MH = x_TH[order_M // top_k]  # row gather
    h_MF = (jax.nn.silu(gmm(x_MH, w0_EHF)) * gmm(x_MH, w1_EHF)).astype(dtype)
    y_MH = gmm(h_MF, wo_EFH).astype(dtype)
    y_TKH = jnp.zeros_like(y_MH).at[order_M].set(y_MH).reshape(T, top_k, H)  # unsort
    return jnp.einsum("tkh,tk->th", y_TKH.astype(F32), weights_TK).astype(dtype)


def plain_fn(shape: MoEShape, score_function: str):
    """Jitted fwd+bwd of ``plain_layer``: (x, gate, w0, w1, wo, dy) -> gradients of <y, dy>,
    with the expert bias ``layer.layer_fn`` gives a sigmoid router."""
    bias = jnp.linspace(-0.1, 0.1, shape.experts) if score_function == "sigmoid" else None

    def loss(x, gate, w0, w1, wo, dy):
        y = plain_layer(
            x, gate, w0, w1, wo, top_k=shape.top_k, score_function=score_function, expert_bias=bias
        )
        return jnp.vdot(y.astype(F32), dy)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


# ----------------------------------------------------------------------------- layer rows


def variants(shape: MoEShape, dtype) -> list[tuple[str, str | None]]:
    """(variant, grouped-GEMM backend) of every row of a shape: dense, plain, auto (as it
    resolves here), then each other available backend."""
    auto = resolve_backend("auto", dtype, hidden=shape.hidden, ffn=shape.ffn)
    others = [b for b in available_backends(dtype, hidden=shape.hidden, ffn=shape.ffn) if b != auto]
    padded = [(PADDED, "megablox")] if "megablox" in (auto, *others) else []
    return [("dense", None), ("plain", None), ("auto", auto), *padded, *((b, b) for b in others)]


def _function(variant: str, shape: MoEShape, score_function: str):
    if variant == "dense":
        return dense_fn()
    if variant == "plain":
        return plain_fn(shape, score_function)
    if variant == PADDED:  # moe.tile_rows set to megablox's own row tile
        tile = megablox.default_row_tile(shape.tokens * shape.top_k, shape.experts)
        return layer_fn("megablox", shape, dict(score_function=score_function), tile_rows=tile)
    return layer_fn(variant, shape, dict(score_function=score_function))


def _expansion(variant: str, shape: MoEShape, dtype) -> str | None:
    """Why a ``lax.ragged_dot`` row is not run off TPU (XLA:CPU and XLA:GPU expand it densely
    over every expert), or None."""
    if variant not in ("plain", "ragged_dot") or jax.default_backend() == "tpu":
        return None
    return too_big("ragged_dot", shape, dtype)


def _prepare(fn, args) -> tuple[Any, Any, float] | str:
    """(compiled, args, compile seconds) after one trial call, or why the variant fails to
    compile or run (out of VMEM or HBM, a kernel refusing the shape): a row that says so."""
    try:
        compiled, _, secs = compile_jit(fn, *args)
        jax.block_until_ready(compiled(*args))
    except Exception as err:  # a row that says why, not the end of a one-shot device run
        return accel_step.failure(err)
    return compiled, args, secs


def _prepared(
    spec: Shape, shape: MoEShape, s: Sizes, deadline: float, ops, only=None
) -> dict[tuple, tuple | str]:
    """{(variant, backend): (compiled, args, compile seconds) or why it does not run}, in
    ``variants`` order (dense first: the others need it); ``only``: those variants (and dense)."""
    dtype = jnp.dtype(s.dtype)
    moe_ops, dense_ops, dy, dy_n = ops
    out: dict[tuple, tuple | str] = {}
    for variant, backend in _chosen(variants(shape, dtype), only):
        why = _expansion(variant, shape, dtype)
        if why is None and time.perf_counter() > deadline:
            why = "over the run's time budget"
        if why is None and variant != "dense" and isinstance(out[("dense", None)], str):
            why = "the dense reference did not run"
        args = (*dense_ops, dy_n) if variant == "dense" else (*moe_ops, dy)
        out[(variant, backend)] = why or _prepare(_function(variant, shape, spec.score_function), args)
    return out


def _timed(entries: dict[tuple, tuple | str], s: Sizes) -> tuple[dict[tuple, dict], dict[tuple, str]]:
    """(timings, why a variant failed) of the variants that compiled, timed side by side.
    Where running them all together fails (the device out of memory with one more variant's
    buffers), each is timed beside the dense reference alone, and one that still fails gets
    why instead of a timing."""
    ready = {key: e[:2] for key, e in entries.items() if not isinstance(e, str)}
    timed = lambda fns: time_rounds(fns, min_reps=s.min_reps, max_reps=s.max_reps, target_s=s.target_s)
    if not ready:
        return {}, {}
    try:
        return timed(ready), {}
    except Exception:  # each variant alone beside dense; the dense reference ran in _prepared
        dense = ("dense", None)
        timings: dict[tuple, dict] = {}
        failed: dict[tuple, str] = {}
        for key in ready.keys() - {dense}:
            try:
                timings |= timed({dense: ready[dense], key: ready[key]})
            except Exception as err:  # a row saying why
                failed[key] = accel_step.failure(err)
        if dense not in timings:
            failed[dense] = "the dense reference did not run beside any variant"
        return timings, failed


def _where(compiled, args) -> dict[str, Any]:
    """``profile.breakdown`` of a compiled layer function."""
    return profile.breakdown(lambda: jax.block_until_ready(compiled(*args)), compiled.as_text())


def _chosen(pairs: list[tuple[str, str | None]], only) -> list[tuple[str, str | None]]:
    return pairs if only is None else [p for p in pairs if p[0] in ("dense", *only)]


def shape_rows(
    spec: Shape, s: Sizes, limit: float | None, deadline: float, say: Say, only=None, note=None
) -> list[dict]:
    """Every variant of one expert shape (``only``: those and dense), timed side by side with
    the dense reference; ``note``: said on each row (why this shape was run)."""
    dtype = jnp.dtype(s.dtype)
    shape, fitted = fit(spec.shape, dtype, limit, s.memory_fraction, s.min_tokens)
    note = "; ".join(n for n in (fitted, note) if n) or None
    base = {"model": spec.name, "full_tokens": spec.shape.tokens, "router": spec.score_function, "note": note}
    if shape is None:
        return [base | dataclasses.asdict(spec.shape) | {"variant": "all", "backend": None, "skipped": note}]
    base |= dataclasses.asdict(shape)
    if time.perf_counter() > deadline:  # no operands drawn for nothing
        late = "over the run's time budget"
        pairs = _chosen(variants(shape, dtype), only)
        return [base | {"variant": v, "backend": b, "skipped": late} for v, b in pairs]
    moe_ops, dense_ops, dy, dy_n = operands(shape, dtype)
    ops = (moe_ops, dense_ops, dy.astype(dtype), dy_n.astype(dtype))
    entries = _prepared(spec, shape, s, deadline, ops, only)
    timings, failed = _timed(entries, s)
    rows = []
    for (variant, backend), entry in entries.items():
        label = f"{spec.name} {variant}{f' ({backend})' if variant == 'auto' else ''}"
        why = entry if isinstance(entry, str) else failed.get((variant, backend))
        if why is not None or isinstance(entry, str):
            rows.append(base | {"variant": variant, "backend": backend, "skipped": why})
            say(f"{label}: skipped: {why}")
            continue
        timing = timings[(variant, backend)]
        row = layer_row(shape, variant, spec.score_function, timing, timings[("dense", None)], {}, entry[2])
        row |= base | {"variant": variant, "backend": backend, "dtype": dtype.name}
        row["tflops"] = row["useful_flops"] / timing["median_s"] / 1e12
        if variant == "auto":  # where the layer's time goes, by pipeline step
            row["time_by_scope"] = _where(*entry[:2])
        rows.append(row)
        say(f"{label}: {fmt_ms(timing)[0]} ms, {row['ratio']:.2f}x dense, {_tflops(row['tflops'])} TFLOP/s")
    return rows


OUT_OF_HBM = ("RESOURCE_EXHAUSTED", "out of memory")  # a row's reason that says the device ran out


def halved_rows(spec: Shape, rows: list[dict], s: Sizes, limit, deadline: float, say: Say) -> list[dict]:
    """Where the plain layer ran out of device memory beside ``auto``, both again with dense at
    half the tokens (so that ``auto`` / plain is measured at one T; [] where nothing did or T
    would go below ``min_tokens``)."""
    by = {r["variant"]: r for r in rows}
    plain, auto = by.get("plain"), by.get("auto")
    why = (plain or {}).get("skipped") or ""
    if not (auto and not auto["skipped"] and any(w in why for w in OUT_OF_HBM)):
        return []
    half = auto["tokens"] // 2
    if half < s.min_tokens:
        return []
    smaller = dataclasses.replace(spec, shape=dataclasses.replace(spec.shape, tokens=half))
    note = f"plain out of device memory at T={auto['tokens']}"
    say(f"{spec.name}: {note}; plain and auto again at T={half}")
    return shape_rows(smaller, s, limit, deadline, say, only=("plain", "auto"), note=note)


def square_gemm(n: int, s: Sizes) -> dict[str, Any]:
    """TFLOP/s of one n x n x n GEMM in ``s.dtype`` (fp32 accumulation)."""
    dtype = jnp.dtype(s.dtype)
    a = jnp.ones((n, n), dtype)
    fn, _, secs = compile_jit(
        jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32).astype(dtype)), a, a
    )
    t = time_rounds({"gemm": (fn, (a, a))}, min_reps=s.min_reps, max_reps=s.max_reps, target_s=s.target_s)
    return {"n": n, "time": t["gemm"], "tflops": 2.0 * n**3 / t["gemm"]["median_s"] / 1e12, "compile_s": secs}


# ----------------------------------------------------------------------------- goals and report


def _goal(name: str, value: float | None, op: str, target: float, unit: str) -> dict[str, Any]:
    compare = {"<=": lambda a, b: a <= b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b}[op]
    met = None if value is None else bool(compare(value, target))
    return {"goal": name, "measured": value, "op": op, "target": target, "unit": unit, "met": met}


def _auto_and_plain(rows: list[dict], name: str) -> tuple[dict | None, tuple[dict, dict] | None]:
    """(``auto``'s row at the largest T it ran, (auto, plain) at the largest T both ran)."""
    ran = [r for r in rows if r["model"] == name and not r["skipped"]]
    autos = sorted((r for r in ran if r["variant"] == "auto"), key=lambda r: -r["tokens"])
    for a in autos:
        plain = [r for r in ran if r["variant"] == "plain" and r["tokens"] == a["tokens"]]
        if plain:
            return autos[0], (a, plain[0])
    return (autos[0] if autos else None), None


def goals(rows: list[dict], step: dict) -> list[dict]:
    """Issue 49's goals, each with what was measured (None: not measured) and met or not."""
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        auto, pair = _auto_and_plain(rows, name)
        at = f"{name} (T {auto['tokens']})" if auto else name
        over_dense = auto["ratio"] if auto else None
        out.append(_goal(f"{at}: MoE layer (auto) / dense", over_dense, "<=", LAYER_OVER_DENSE, "x"))
        at = f"{name} (T {pair[0]['tokens']})" if pair else at
        over_plain = pair[0]["time"]["median_s"] / pair[1]["time"]["median_s"] if pair else None
        out.append(_goal(f"{at}: MoE layer (auto) / plain ragged_dot layer", over_plain, "<", 1.0, "x"))
    moe = step["rows"]["moe"]
    out.append(
        _goal(
            "train step: MoE / dense twin TFLOP/s", step["moe_over_dense_tflops"], ">=", STEP_OVER_DENSE, "x"
        )
    )
    out.append(_goal("train step: MoE MFU", None if moe["skipped"] else moe.get("mfu"), ">=", MFU, "%"))
    return out


def _num(v: float | None, unit: str) -> str:
    if v is None:
        return "not measured"
    return f"{100 * v:.1f}%" if unit == "%" else f"{v:.2f}x"


def _tflops(v: float) -> str:
    return f"{v:.1f}" if v >= 1 else f"{v:.3f}"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def goals_md(items: list[dict]) -> str:
    met = {True: "met", False: "not met", None: "not measured"}
    rows = [
        [
            g["goal"],
            _num(g["measured"], g["unit"]),
            f"{g['op']} {_num(g['target'], g['unit'])}",
            met[g["met"]],
        ]
        for g in items
    ]
    return markdown_table(["goal", "measured", "target", "met / not met"], rows)


def _layer_cells(r: dict) -> list:
    dims = f"{r['tokens']}, {r['hidden']}, {r['ffn']}, {r['experts']}, {r['top_k']}"
    cells = [r["model"], dims, r["router"], r["variant"], r["backend"] or ""]
    if r["skipped"]:
        return [*cells, "", "", "", "skipped: " + r["skipped"]]
    return [*cells, fmt_ms(r["time"])[0], common.ratio_cell(r), _tflops(r["tflops"]), r["note"] or ""]


def layer_md(rows: list[dict]) -> str:
    header = [
        "model",
        "T, H, F, E, k",
        "router",
        "layer",
        "backend",
        "median ms",
        "/ dense",
        "TFLOP/s",
        "note",
    ]
    return markdown_table(header, [_layer_cells(r) for r in rows])


def _step_cells(name: str, r: dict) -> list:
    size = (
        f"{r['experts']} x {r['expert_ffn']}, top-{r['top_k']}"
        if r["experts"]
        else f"dense {r['expert_ffn']}"
    )
    cells = [name, size, f"{_count(r['params'])} ({_count(r['active_params'])})", r.get("backend", "")]
    if r["skipped"]:
        return [*cells, "", "", "", "", "", "skipped: " + r["skipped"]]
    mfu = "" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    speed = [f"{r['tokens_per_s']:,.0f}", _tflops(r["tflops_per_device"]), mfu]
    return [*cells, *speed, f"{r['back_to_back_s'] * 1e3:.1f}", fmt_ms(r["time"])[0], ""]


def step_md(step: dict) -> str:
    header = ["model", "MLP: experts x ffn, top-k", "params (active)", "backend", "tokens/s"]
    header += ["TFLOP/s per device", "MFU", "step ms", "step ms, each waited for", "note"]
    ratio = step["moe_over_dense_tflops"]
    moe = step["rows"]["moe"]
    tokens = f"{moe['batch_size']} x {moe['seq_len']} tokens a step"
    shape = f"{moe['layers']} layers of width {moe['hidden']}, {tokens}"
    shape += f" ({step['chosen']})" if step.get("chosen") else ""
    measured = "not measured" if ratio is None else f"{ratio:.2f}"
    return (
        markdown_table(header, [_step_cells(name, r) for name, r in step["rows"].items()])
        + f"\n\nModels: {shape}. MoE / dense twin TFLOP/s: {measured}"
    )


def markdown(sec: dict) -> str:
    """The section's Markdown: what ran where, the goals, the layer rows, the step rows."""
    mem = "unknown" if sec["memory_bytes"] is None else f"{sec['memory_bytes'] / 2**30:.2f} GiB"
    peak = "unknown" if sec["peak_flops"] is None else f"{sec['peak_flops'] / 1e12:.0f} TFLOP/s"
    sq = sec["square_gemm"]
    return (
        f"## {TITLE}\n\n{sec['device_kind']} ({sec['platform']}): memory {mem}, dense bf16 peak {peak}; "
        f"a {sq['n']}^3 bf16 GEMM runs at {_tflops(sq['tflops'])} TFLOP/s. Layer rows: forward+backward "
        "in bf16, TFLOP/s of the useful expert FLOPs (18*T*k*H*F); / dense = time over the dense SwiGLU "
        "of the same useful FLOPs (1.0 is the limit; the per-round range in brackets). Step rows: the "
        "trainer's step; TFLOP/s of its model FLOPs, MFU against the peak, of the steps dispatched "
        "back to back as the trainer's loop does (step ms; each step waited for beside it).\n\n"
        f"### Goals\n\n{goals_md(sec['goals'])}\n\n### MoE layer\n\n{layer_md(sec['layer_rows'])}\n\n"
        f"### Train step\n\n{step_md(sec['step'])}\n\n### Where the time goes\n\n{where_md(sec)}"
    )


def where_md(sec: dict) -> str:
    """ms per call by pipeline step (``bench.profile``) of the `auto` layers and the steps."""
    profiles = {
        f"{r['model']} layer (auto)": r["time_by_scope"] for r in sec["layer_rows"] if "time_by_scope" in r
    }
    profiles |= {
        f"step: {n}": r["time_by_scope"] for n, r in sec["step"]["rows"].items() if "time_by_scope" in r
    }
    if not profiles:
        return "nothing profiled"
    header, rows = profile.markdown_rows(profiles)
    return (
        "Device time per call (ms) of each op, by the named scope it was traced under (a trace of "
        "two more calls after the timed ones); unmatched ms: op events of no instruction of the "
        "program; module ms: the device's module executions (empty where the trace has none, as on "
        "a CPU). Traced ms well under module ms is ops not matched; module ms well under the "
        "measured time is a device waiting on its host.\n\n" + markdown_table(header, rows)
    )


def run(s: Sizes, say: Say = print) -> dict[str, Any]:
    """The section's results (JSON-ready) with its Markdown under ``markdown``."""
    t0 = time.perf_counter()
    deadline = t0 + s.budget_s
    dev = jax.devices()[0]
    limit, peak = device_memory(), peaks.peak_flops(dev.device_kind, s.dtype)
    square = square_gemm(s.square, s)
    say(f"{dev.device_kind}: {s.square}^3 bf16 GEMM {_tflops(square['tflops'])} TFLOP/s")
    rows = []
    for spec in s.shapes:
        found = shape_rows(spec, s, limit, deadline - s.step_reserve_s, say, only=s.variants)
        rows += found + halved_rows(spec, found, s, limit, deadline - s.step_reserve_s, say)
    cluster = accel_step.cluster_of(dev)
    model, chosen = accel_step.choose(s.step_models, limit, cluster, s.step_memory_fraction)
    if chosen:
        say(f"step model: {chosen}")
    step = accel_step.run(model, deadline, peak, say) | {"chosen": chosen}
    sec = {
        "title": TITLE,
        "sizes": dataclasses.asdict(s),
        "device": str(dev),
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "memory_bytes": limit,
        "peak_flops": peak,
        "square_gemm": square,
        "layer_rows": rows,
        "step": step,
        "goals": goals(rows, step),
    }
    sec["wall_s"] = time.perf_counter() - t0
    sec["markdown"] = markdown(sec)
    return sec
