"""The megablox tile sweep (``python -m moe_train.bench --accel --tune [--write-tiles]``).

For each GEMM the ``megablox`` backend runs at the expert shapes of Mixtral, Qwen3 and
DeepSeek-V3 (``moe_train.moe.megablox``: the forward's ``x @ wi_0`` (and ``wi_1``) and
``h @ wo``, the rows' gradients through the transposed weights, the weights' gradients by
``tgmm``; and, for comparison, the one GEMM of ``[wi_0|wi_1]`` the forward does not run), on
rows sorted by expert with the loads of a uniform random top-k routing (``routed_loads``: group
boundaries fall inside row tiles, as a router's do, and megablox runs such a tile once per
group in it; the sweeps up to 2026-12-07 had balanced loads, aligned to every tile) in bf16,
every candidate tile (tm, tk, tn) is compiled and timed
side by side with a dense matmul of the same FLOPs. A tile that does not compile (Mosaic
runs out of VMEM) is listed with its error's first line. The fastest tile of each (GEMM
kind, k, n) is the result; ``--write-tiles`` writes those into the table the backend reads
(``megablox.TILE_FILE``, under this device's kind, other kinds kept) with the date, jax
version, commit and command. Off a TPU the kernels run in Pallas interpret mode (``--tiny``:
toy sizes, the code path's test on CPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_train.bench.common import ACCEL_SHAPES, markdown_table, time_rounds
from moe_train.moe import megablox
from moe_train.moe.routings import MoEShape

TITLE = "megablox tiles: each GEMM's candidates against a dense matmul of the same FLOPs"
Say = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Sizes:
    shapes: tuple[tuple[str, MoEShape], ...]  # (model, expert shape): rows = T * top-k
    candidates: tuple[megablox.Tile, ...]  # tiles tried for every GEMM
    min_reps: int = 3  # timed rounds at least
    max_reps: int = 10  # timed rounds at most
    target_s: float = 1.0  # rounds are added up to about this many seconds per GEMM
    budget_s: float = 420.0  # GEMMs that would start after this are listed as skipped
    dtype: str = "bfloat16"  # operands' dtype


FULL = Sizes(
    shapes=(
        *((name, shape) for name, shape, _ in ACCEL_SHAPES),
        # the step section's MoE model (accel_step.FULL: 8 x 2048 tokens, hidden 1024, 32 x 512, top-4)
        ("accel-step-moe", MoEShape(16384, 1024, 512, 32, 4)),
    ),
    candidates=(
        (512, 512, 512),
        (512, 1024, 1024),
        (512, 512, 1024),
        (512, 1024, 512),
        (256, 1024, 1024),
        (256, 512, 1024),
        (1024, 512, 512),
        (1024, 512, 1024),
        (512, 256, 2048),
        (512, 2048, 256),
        (256, 2048, 512),
        (128, 1024, 2048),
        # tk over any k: the whole contraction in one block (clamp_tile), so consecutive row tiles
        # of one group keep the same weight block, which Pallas then does not fetch again
        (256, 8192, 512),
        (512, 8192, 256),
        (128, 8192, 1024),
    ),
)
TINY = Sizes(
    shapes=(("tiny", MoEShape(64, 128, 256, 4, 2)),),
    candidates=((128, 128, 128), (64, 128, 256)),
    min_reps=1,
    max_reps=1,
    target_s=0.0,
    budget_s=120.0,
    dtype="float32",
)


@dataclasses.dataclass(frozen=True)
class Gemm:
    name: str  # which of the backend's GEMMs
    kind: str  # megablox.KINDS: the table's key with (k, n)
    k: int  # contraction
    n: int  # output columns
    transpose_rhs: bool = False  # the rows' gradients multiply by the transposed weights
    out_f32: bool = False  # fp32 output, as the backend asks of it (``dy @ wo^T``; else x's dtype)
    runs: bool = True  # the backend runs it (False: a comparison the sweep times beside it)


# Names of the comparison row and of the two-GEMM forward it is against.
FUSED_GATE, GATE = "x @ [wi_0|wi_1] (fused: not run)", "x @ wi_0 (and wi_1)"


def gemms(shape: MoEShape) -> tuple[Gemm, ...]:
    """The GEMMs of the backend's SwiGLU and its backward at one expert shape (``x @ wi_0`` and
    ``x^T da0`` also stand for their twins of ``wi_1``, same shape), and the one GEMM of
    ``[wi_0|wi_1]`` the forward would run in place of two (its time against twice
    ``x @ wi_0``'s says what fusing would save at this shape, before concatenating the
    weights)."""
    H, F = shape.hidden, shape.ffn
    return (
        Gemm(GATE, "fwd", H, F),
        Gemm("h @ wo", "fwd", F, H),
        Gemm("dy @ wo^T", "dlhs", H, F, True, out_f32=True),
        Gemm("da @ [wi_0|wi_1]^T", "dlhs", 2 * F, H, True),
        Gemm("x^T da0 (and da1)", "drhs", H, F),
        Gemm("(h s)^T dy", "drhs", F, H),
        Gemm(FUSED_GATE, "fwd", H, 2 * F, runs=False),  # last: a deadline cuts it first
    )


def routed_loads(shape: MoEShape, seed: int = 0) -> np.ndarray:
    """Rows per expert [E] (summing to T * k) of ``shape``'s tokens each choosing ``top_k``
    distinct experts uniformly at random."""
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((shape.tokens, shape.experts)), axis=1)[:, : shape.top_k]
    return np.bincount(picks.ravel(), minlength=shape.experts)


def _operands(g: Gemm, shape: MoEShape, dtype):
    """(lhs [T * k, k], rhs, the group sizes [E] of ``routed_loads``) drawn on the device."""
    rows, experts = shape.tokens * shape.top_k, shape.experts
    keys = jax.random.split(jax.random.key(0), 2)
    lhs = jax.random.normal(keys[0], (rows, g.k), dtype)
    if g.kind == "drhs":
        rhs = jax.random.normal(keys[1], (rows, g.n), dtype)
    else:
        dims = (experts, g.n, g.k) if g.transpose_rhs else (experts, g.k, g.n)
        rhs = jax.random.normal(keys[1], dims, dtype) * g.k**-0.5
    return lhs, rhs, jnp.asarray(routed_loads(shape), jnp.int32)


def _out_dtype(g: Gemm, dtype):
    return jnp.dtype(jnp.float32) if g.out_f32 else jnp.dtype(dtype)


def _kernel_fn(g: Gemm, tile: megablox.Tile):
    kernels, interpret = megablox._kernels(), jax.default_backend() != "tpu"
    if g.kind == "drhs":
        return jax.jit(lambda a, b, gs: kernels.tgmm(a.T, b, gs, b.dtype, tiling=tile, interpret=interpret))
    return jax.jit(
        lambda a, b, gs: kernels.gmm(
            a, b, gs, _out_dtype(g, a.dtype), tiling=tile, transpose_rhs=g.transpose_rhs, interpret=interpret
        )
    )


def _dense_fn():
    return jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))


def _compile(fn, args) -> tuple[Any, str | None]:
    try:
        return fn.lower(*args).compile(), None
    except Exception as err:  # Mosaic's VMEM exhaustion, or a tile the kernel refuses
        return None, (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def gemm_rows(model: str, shape: MoEShape, g: Gemm, s: Sizes) -> list[dict[str, Any]]:
    """Every candidate tile of one GEMM, fitted as the backend fits it (``clamp_tile``: tm at
    most the layer's row tile, and its VMEM at this GEMM's dtypes), timed beside the dense
    matmul of its FLOPs."""
    rows, dtype = shape.tokens * shape.top_k, jnp.dtype(s.dtype)
    row_tile = megablox.default_row_tile(rows, shape.experts)
    lhs, rhs, sizes_E = _operands(g, shape, dtype)
    dense_b = jnp.ones((g.k, g.n), dtype)
    fns: dict[Any, tuple] = {"dense": (_dense_fn(), (lhs, dense_b))}
    base = dict(
        model=model, gemm=g.name, kind=g.kind, m=rows, k=g.k, n=g.n, experts=shape.experts, runs=g.runs
    )
    out = []
    in_bytes, out_bytes = dtype.itemsize, _out_dtype(g, dtype).itemsize
    fitted = (
        megablox.clamp_tile(t, row_tile, g.k, g.n, kind=g.kind, in_bytes=in_bytes, out_bytes=out_bytes)
        for t in s.candidates
    )
    for tile in dict.fromkeys(fitted):
        compiled, error = _compile(_kernel_fn(g, tile), (lhs, rhs, sizes_E))
        if error:
            out.append(dict(base, tile=list(tile), error=error))
        else:
            fns[tile] = (compiled, (lhs, rhs, sizes_E))
    timings = time_rounds(fns, min_reps=s.min_reps, max_reps=s.max_reps, target_s=s.target_s)
    dense_s = timings.pop("dense")["median_s"]
    for tile, t in timings.items():
        out.append(dict(base, tile=list(tile), median_s=t["median_s"], ratio=t["median_s"] / dense_s))
    return out


def best(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """{kind: {"KxN": fastest tile}} over the rows that ran of GEMMs the backend runs (summed
    over models sharing k, n)."""
    total: dict[tuple[str, str, tuple], float] = {}
    for r in rows:
        if "median_s" in r and r.get("runs", True):
            key = (r["kind"], f"{r['k']}x{r['n']}", tuple(r["tile"]))
            total[key] = total.get(key, 0.0) + r["median_s"]
    out: dict[str, dict[str, list[int]]] = {}
    for (kind, kn, tile), _secs in sorted(total.items(), key=lambda kv: kv[1]):
        out.setdefault(kind, {}).setdefault(kn, list(tile))
    return out


def write_table(path: Path, device_kind: str, tiles: dict, provenance: dict[str, Any]) -> None:
    """Put ``tiles`` under ``device_kind`` in the table at ``path``: each (kind, KxN) swept
    replaces its entry; other shapes and device kinds are kept, and so is the provenance of
    earlier sweeps that still own an entry."""
    table = json.loads(path.read_text()) if path.is_file() else {}
    mine = table.setdefault("tiles", {}).setdefault(device_kind, {})
    for kind, by_shape in tiles.items():
        mine.setdefault(kind, {}).update(by_shape)
    swept = sorted(f"{kind}:{kn}" for kind, by_shape in tiles.items() for kn in by_shape)
    table["measured"] = [
        dict(m, shapes=left)
        for m in table.get("measured", [])
        if (left := [x for x in m.get("shapes", []) if m.get("device_kind") != device_kind or x not in swept])
    ]
    table["measured"].append(dict(provenance, device_kind=device_kind, shapes=swept))
    table.setdefault("written_by", "python -m moe_train.bench --accel --tune --write-tiles")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    megablox.load_table.cache_clear()


def markdown(rows: list[dict[str, Any]]) -> str:
    header = ("model", "GEMM", "m", "k", "n", "tile", "ms", "/ dense")
    body = [
        (r["model"], r["gemm"], r["m"], r["k"], r["n"], "x".join(map(str, r["tile"])))
        + ((f"{r['median_s'] * 1e3:.2f}", f"{r['ratio']:.2f}") if "median_s" in r else ("-", r["error"]))
        for r in rows
    ]
    return f"## {TITLE}\n\n" + markdown_table(header, body)


def measured(g: Gemm, device_kind: str) -> bool:
    """Whether the shipped table has a tile for this GEMM's (kind, k, n) on ``device_kind``."""
    return f"{g.k}x{g.n}" in megablox.load_table().get(device_kind, {}).get(g.kind, {})


def run(
    s: Sizes,
    say: Say = print,
    write: Path | None = None,
    provenance: dict | None = None,
    missing_only: bool = False,
) -> dict:
    """Sweep every GEMM of every shape; with ``write``, put the fastest tiles in that table;
    ``missing_only``: only the GEMMs the table has no tile for on this device (a sweep that an
    earlier deadline cut short goes on where it stopped)."""
    t0, rows, device_kind = time.perf_counter(), [], jax.devices()[0].device_kind
    for model, shape in s.shapes:
        for g in gemms(shape):
            base = dict(model=model, gemm=g.name, kind=g.kind, k=g.k, n=g.n)
            if missing_only and (measured(g, device_kind) or not g.runs):
                rows.append(
                    dict(base, skipped="in the table already" if g.runs else "not run by the backend")
                )
                continue
            if time.perf_counter() - t0 > s.budget_s:
                rows.append(dict(base, skipped="budget"))
                continue
            got = gemm_rows(model, shape, g, s)
            rows += got
            ran = [r for r in got if "ratio" in r]
            fastest = min(ran, key=lambda r: r["ratio"]) if ran else None
            say(
                f"{model} {g.name}: "
                + (
                    f"best {fastest['tile']} at {fastest['ratio']:.2f}x dense"
                    if fastest
                    else "no tile compiled"
                )
            )
    tiles, kind = best(rows), device_kind
    if write is not None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        write_table(write, kind, tiles, dict(provenance or {}, date=stamp, jax=jax.__version__))
        say(f"wrote the fastest tiles for {kind!r} to {write}")
    ran = [r for r in rows if "gemm" in r and "skipped" not in r]
    return {"title": TITLE, "device_kind": kind, "rows": rows, "best": tiles, "markdown": markdown(ran)}
