"""The permutation alone: what routing and moving rows cost, without the experts.

Rows per shape (T tokens, H hidden, F expert ffn, E experts, top-K): the dispatch plan
(``permute.make_dispatch``: each assignment's sorted position, one scatter of the rows'
tokens) by counting sort and by argsort, and the whole permutation forward+backward by each
(router, top-k, plan, row gather, each row scaled by its combine weight in place of the
experts, gather back and sum over K as the layer does: by row DMAs on a TPU; gradients with
respect to x and the gate), all timed side
by side with a dense SwiGLU forward+backward on the T*K useful rows (the experts' FLOPs: the
limit the layer is measured against). The issue's bar: the permutation at most 0.25x of that
dense time at Qwen3's shape on the chip.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp

from moe_train.base.platform import Platform
from moe_train.bench import common
from moe_train.bench.common import ACCEL_SHAPES, compile_jit, markdown_table, ratio_stats, time_rounds
from moe_train.bench.layer import dense_fn, operands
from moe_train.moe import Routing, dma_rows
from moe_train.moe.permute import (
    COUNTING_MAX_EXPERTS,
    make_dispatch,
    permute,
    row_values,
    sum_gathered,
    unpermute_sum,
)
from moe_train.moe.router import route_tokens
from moe_train.moe.routings import MoEShape

TITLE = "Permutation alone: counting sort vs argsort, against the dense limit"
METHODS = ("counting", "argsort")


@dataclasses.dataclass(frozen=True)
class Sizes:
    shapes: tuple[MoEShape, ...]  # layer problems; E spans the counting/argsort switch
    min_reps: int  # timed rounds at least
    max_reps: int  # timed rounds at most
    target_s: float  # rounds are added up to about this many seconds
    dtype: str = "float32"  # activations' dtype


FULL = Sizes(
    shapes=(
        MoEShape(2048, 256, 512, 8, 2),
        MoEShape(2048, 512, 256, 32, 8),
        MoEShape(4096, 256, 128, 128, 8),
    ),
    min_reps=3,
    max_reps=10,
    target_s=3.0,
)
ACCEL = dataclasses.replace(  # on the accelerator, beside the layer rows of ``--accel``: the shapes
    FULL, shapes=tuple(shape for _, shape, _ in ACCEL_SHAPES), target_s=2.0, dtype="bfloat16"
)
GOAL_OVER_DENSE = 0.25  # the permutation (auto's method) at most this of the dense time at E = 128
QUICK = dataclasses.replace(
    FULL, shapes=(MoEShape(256, 32, 64, 8, 2), MoEShape(256, 32, 32, 128, 8)), **common.QUICK_TIMING
)


def log(msg: str) -> None:
    print(f"[bench permute] {msg}", file=sys.stderr, flush=True)


def plan_fn(num_experts: int, method: str):
    """jit of ids [T, K] -> the dispatch plan on sorted rows."""
    return jax.jit(lambda ids: make_dispatch(ids, num_experts, None, 1, method))


def permutation_fn(shape: MoEShape, method: str):
    """jit of (x, gate, dy) -> gradients of <y, dy> w.r.t. x and the gate, where y is the MoE
    layer's pipeline with each expert replaced by its row's combine weight."""
    routing, E, K = Routing(shape.top_k), shape.experts, shape.top_k

    def loss(x, gate, dy):
        dma = dma_rows.for_target(Platform.here(), x)
        weights_TK, experts_TK, _ = route_tokens(x, gate, routing)
        plan = make_dispatch(experts_TK, E, None, 1, method)
        x_RH = permute(x, plan, dma)
        w_R = row_values(weights_TK.reshape(-1), plan)
        y_TH = unpermute_sum((x_RH * w_R[:, None]).astype(x.dtype), plan, K, x.dtype, dma)
        return jnp.vdot(y_TH.astype(jnp.float32), dy)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def row_moves(x_TH: jax.Array, ids_TK: jax.Array, num_experts: int) -> dict[str, tuple]:
    """The permutation's row movements alone, forward only, each {name: (compiled, args)}:
    the permute's gather from the tokens [T, H] and the unpermute's sum over K of the rows
    [T*K, H] by XLA's gather, and on a TPU by row DMAs (``moe_train.moe.dma_rows``, both of
    its kernels; the relayout of the rows included). A scatter of the rows into assignment order, timed here
    until 2026-12-07, was slower than the gather at every shape on a TPU v5e."""
    plan = jax.jit(lambda ids: make_dispatch(ids, num_experts))(ids_TK)
    y_RH = jax.jit(lambda x, i: x[i])(x_TH, plan.token_R)  # the rows as the experts get them, [T*K, H]
    row_TK = plan.row_M.reshape(ids_TK.shape)
    moves = {
        "rows: gather from x [T, H]": (lambda x, i: x[i], (x_TH, plan.token_R)),
        "rows: sum over K of y [T*K, H], XLA gather": (
            lambda y, i: sum_gathered(y, i, y.dtype),
            (y_RH, row_TK),
        ),
    }
    dma = dma_rows.for_target(Platform.here(), x_TH)
    if dma is not None and not dma.interpret:
        ahead = dataclasses.replace(dma, prefetch=True)
        moves["rows: sum over K of y [T*K, H], row DMAs"] = (
            lambda y, i: sum_gathered(y, i, y.dtype, dma),
            (y_RH, row_TK),
        )
        moves["rows: sum over K of y [T*K, H], row DMAs, next block prefetched"] = (
            lambda y, i: sum_gathered(y, i, y.dtype, ahead),
            (y_RH, row_TK),
        )
    return {name: (compile_jit(jax.jit(fn), *args)[0], args) for name, (fn, args) in moves.items()}


def route_fn(shape: MoEShape):
    """jit of (x, gate, dy) -> gradients of the routing alone (router logits, top-k, the
    combine weights and the balance statistics) w.r.t. x and the gate: what the permutation
    rows spend before any row moves."""
    routing = Routing(shape.top_k)

    def loss(x, gate, dy):
        weights_TK, _, stats = route_tokens(x, gate, routing)
        return jnp.vdot(weights_TK, dy[:, : shape.top_k].astype(jnp.float32)) + stats.aux_loss

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def shape_rows(shape: MoEShape, s: Sizes) -> list[dict[str, Any]]:
    """Plans and permutations by each method and the row movements alone, next to the dense
    SwiGLU, timed side by side."""
    dtype = jnp.dtype(s.dtype)
    (x, gate, *_), dense_ops, dy, dy_n = operands(shape, dtype)
    _, ids = jax.lax.top_k(x.astype(jnp.float32) @ gate, shape.top_k)
    fns: dict[str, tuple] = {"dense": (compile_jit(dense_fn(), *dense_ops, dy_n)[0], (*dense_ops, dy_n))}
    for method in METHODS:
        fns[f"plan {method}"] = (compile_jit(plan_fn(shape.experts, method), ids)[0], (ids,))
        fns[f"permutation {method}"] = (
            compile_jit(permutation_fn(shape, method), x, gate, dy)[0],
            (x, gate, dy),
        )
    fns["route (router, top-k) fwd+bwd"] = (compile_jit(route_fn(shape), x, gate, dy)[0], (x, gate, dy))
    fns |= row_moves(x, ids.astype(jnp.int32), shape.experts)
    timings = time_rounds(fns, min_reps=s.min_reps, max_reps=s.max_reps, target_s=s.target_s)
    rows = []
    for name, timing in timings.items():
        row = {**dataclasses.asdict(shape), "what": name, "median_s": timing["median_s"], "dtype": dtype.name}
        rows.append(dict(row, **ratio_stats(timing, timings["dense"])))
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    header = ("T", "H", "F", "E", "K", "what", "ms", "/ dense")
    body = [
        (r["tokens"], r["hidden"], r["ffn"], r["experts"], r["top_k"], r["what"])
        + (f"{r['median_s'] * 1e3:.2f}", f"{r['ratio']:.2f}")
        for r in rows
    ]
    return f"## {TITLE}\n\n" + markdown_table(header, body)


def goal(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The issue's bar on the permutation ``auto`` runs, at the shape with the most experts."""
    if not rows:
        return None
    E = max(r["experts"] for r in rows)
    method = "counting" if E <= COUNTING_MAX_EXPERTS else "argsort"
    row = next(r for r in rows if r["experts"] == E and r["what"] == f"permutation {method}")
    return {
        "goal": f"permutation ({method}) / dense at T {row['tokens']}, E {E}, top-{row['top_k']}",
        "measured": row["ratio"],
        "target": GOAL_OVER_DENSE,
        "met": row["ratio"] <= GOAL_OVER_DENSE,
    }


def run(s: Sizes, with_goal: bool = False) -> dict[str, Any]:
    """Every shape's rows; ``with_goal``: the issue's bar on the chip, met or not."""
    rows = []
    for shape in s.shapes:
        got = shape_rows(shape, s)
        rows += got
        log(
            f"T={shape.tokens} E={shape.experts} K={shape.top_k}: "
            + ", ".join(f"{r['what']} {r['ratio']:.2f}x" for r in got if r["what"] != "dense")
        )
    bar = goal(rows) if with_goal else None
    md = markdown(rows)
    if bar:
        verdict = "met" if bar["met"] else "not met"
        md += f"\n\nGoal: {bar['goal']} {bar['measured']:.2f}x, target <= {bar['target']:.2f}x: {verdict}."
    return common.section_result(TITLE, s, rows=rows, goal=bar, markdown=md)
