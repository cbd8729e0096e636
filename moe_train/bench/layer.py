"""The whole MoE layer and the whole train step.

Layer rows: ``dropless_moe`` forward+backward (gradients of <y, dy> with respect to x, the
gate and the expert weights) per grouped-GEMM backend and router type, next to the
token-dropping ``capacity_moe`` at capacity factor 1.25 and a dense SwiGLU on the T*K useful
rows (the same useful expert FLOPs), all timed side by side (``common.time_rounds``).
Router types: ``softmax`` top-k (Mixtral, Qwen3) and ``sigmoid-groups`` (DeepSeek-V3:
sigmoid scores, group-limited top-k, routed scaling, an expert bias). Tokens are random, the
gate random, so routing is close to uniform.

Train step rows (``train_step``): the jitted optimizer step of a preset on one device,
tokens/s, and the fraction of step time spent in the MoE layers, measured by ablation: the
same step compiled with every MoE block's routed experts (``MoEBlock.routed``) replaced by a
stub that returns zeros, through ``flax.linen.intercept_methods`` (no routing, dispatch,
expert GEMMs or combine, and no backward through them; shared experts, the rest of the
model, the loss and the optimizer update of every parameter are unchanged). fraction =
1 - stub time / full time; both steps run interleaved on their own copies of the state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moe_train import config
from moe_train.bench import common
from moe_train.bench import experts as X
from moe_train.bench.common import compile_jit, min_time, ratio_stats, summarize, time_rounds
from moe_train.model.transformer import MoEBlock
from moe_train.moe import MoEStats, Routing, capacity_moe, dropless_moe, swiglu_mlp
from moe_train.moe.gemm import ragged_dot_expansion_bytes, resolve_backend
from moe_train.moe.routings import MoEShape
from moe_train.moe.stats import exchange_stats
from moe_train.parallel import sharding
from moe_train.train.step import StepCounter, init_state, make_train_step

TITLE = "MoE layer and train step"
ROUTERS = {
    "softmax": dict(score_function="softmax"),
    "sigmoid-groups": dict(score_function="sigmoid", num_groups=4, group_top_k=2, routed_scaling=2.5),
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    shapes: tuple[MoEShape, ...]
    backends: tuple[str, ...]
    routers: tuple[str, ...]
    min_reps: int
    max_reps: int
    target_s: float
    budget_s: float  # skip ragged_dot where its estimated timing exceeds this (E x dense on CPU)
    preset: str  # train-step preset
    step_reps: int
    dtype: str = "float32"
    capacity_factor: float = 1.25


# The two target shapes: 1.5x-dense at the first, 5x-ragged_dot at the second.
FULL = Sizes(
    shapes=(MoEShape(8192, 512, 1024, 32, 2), MoEShape(2048, 256, 256, 32, 2)),
    backends=("tiled", "ragged_dot", "mgpu", "te"),
    routers=tuple(ROUTERS),
    min_reps=3,
    max_reps=5,
    target_s=6.0,
    budget_s=30.0,
    preset="small",
    step_reps=3,
)
QUICK = dataclasses.replace(
    FULL,
    shapes=(MoEShape(256, 32, 64, 8, 2),),
    backends=("tiled", "ragged_dot", "mgpu"),
    routers=("sigmoid-groups",),
    **common.QUICK_TIMING,
    budget_s=5.0,
    preset="tiny",
)


def log(msg: str) -> None:
    print(f"[bench layer] {msg}", file=sys.stderr, flush=True)


def operands(shape: MoEShape, dtype, seed: int = 0):
    """(x, gate, w0, w1, wo), the dense reference's (x_M, w0, w1, wo) and the cotangents dy
    [T, H] and dy_M [T*K, H]. Drawn on the device (DeepSeek-sized weights are large)."""
    T, H, F, E, K = shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k
    keys = iter(jax.random.split(jax.random.key(seed), 8))

    def n(*s, scale=1.0, dt=jnp.float32):
        return (jax.random.normal(next(keys), s, jnp.dtype(dt)) * jnp.asarray(scale, dt)).astype(dt)

    moe = (
        n(T, H, dt=dtype),
        n(H, E, scale=H**-0.5),
        n(E, H, F, scale=H**-0.5, dt=dtype),
        n(E, H, F, scale=H**-0.5, dt=dtype),
        n(E, F, H, scale=F**-0.5, dt=dtype),
    )
    dense = (n(T * K, H, dt=dtype), moe[2][0], moe[3][0], moe[4][0])
    return moe, dense, n(T, H), n(T * K, H)


def layer_fn(kind: str, shape: MoEShape, router_kw: dict, capacity_factor: float = 1.25, tile_rows=None):
    """Jitted fwd+bwd of one layer variant: (x, gate, w0, w1, wo, dy) -> (grads, stats).

    ``kind`` is a grouped-GEMM backend or ``capacity``; a sigmoid router gets an expert bias;
    ``tile_rows``: ``dropless_moe``'s (``moe.tile_rows``).
    """
    routing = Routing(shape.top_k, **router_kw)
    kw = {}
    if routing.score_function == "sigmoid":
        kw["expert_bias"] = jnp.linspace(-0.1, 0.1, shape.experts)
    if kind == "capacity":
        layer = lambda *ops: capacity_moe(*ops, routing=routing, capacity_factor=capacity_factor, **kw)
    else:
        layer = lambda *ops: dropless_moe(*ops, routing=routing, backend=kind, tile_rows=tile_rows, **kw)

    def loss(x, gate, w0, w1, wo, dy):
        y, stats = layer(x, gate, w0, w1, wo)
        return jnp.vdot(y.astype(jnp.float32), dy), stats

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def dense_fn():
    def loss(x, w0, w1, wo, dy):
        return jnp.vdot(swiglu_mlp(x, w0, w1, wo), dy)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


RAGGED_DOT_MAX_BYTES = 32 * 2**30  # ragged_dot's dense expansion is not timed beyond this


def unavailable(kind: str, shape: MoEShape, dtype) -> str | None:
    """Why grouped-GEMM backend ``kind`` cannot run this shape here (None: it can)."""
    return X.unavailable(kind, dtype, shape.hidden, shape.ffn)


def too_big(kind: str, shape: MoEShape, dtype) -> str | None:
    """Why ``kind`` is not run at this shape for its memory (None: it fits)."""
    if kind != "ragged_dot":
        return None
    need = ragged_dot_expansion_bytes(
        shape.tokens * shape.top_k, shape.experts, shape.hidden, shape.ffn, dtype
    )
    if need <= RAGGED_DOT_MAX_BYTES:
        return None
    return (
        f"XLA runs ragged_dot as a dense dot over all {shape.experts} experts: "
        f"~{need / 2**30:.0f} GiB of masked operands"
    )


def _skip(kind: str, shape: MoEShape, dense_s: float, s: Sizes) -> str | None:
    if kind in ("capacity",):
        return None
    if reason := unavailable(kind, shape, s.dtype):
        return reason
    if kind != "ragged_dot":
        return None
    if reason := too_big(kind, shape, s.dtype):
        return reason
    est = shape.experts * dense_s * (s.min_reps + 1)
    if est > s.budget_s:
        return f"estimated {est:.0f} s to time (~E x dense), over the {s.budget_s:.0f} s budget"
    return None


def shape_rows(shape: MoEShape, s: Sizes) -> list[dict]:
    """Every backend x router of one shape, plus capacity and dense, timed side by side."""
    dtype = jnp.dtype(s.dtype)
    moe_ops, dense_ops, dy, dy_n = operands(shape, dtype)
    dense, _, dense_secs = compile_jit(dense_fn(), *dense_ops, dy_n)
    dense_s = min_time(dense, (*dense_ops, dy_n))
    fns: dict[tuple[str, str], tuple[Callable, tuple]] = {("dense", "-"): (dense, (*dense_ops, dy_n))}
    compile_s, rows = {("dense", "-"): dense_secs}, []
    for kind in (*s.backends, "capacity"):
        reason = _skip(kind, shape, dense_s, s)
        if reason:
            rows.append({**dataclasses.asdict(shape), "backend": kind, "skipped": reason})
            continue
        # every dropless backend with every router; the capacity baseline with the first
        for router in s.routers[:1] if kind == "capacity" else s.routers:
            fn, _, compile_s[(kind, router)] = compile_jit(
                layer_fn(kind, shape, ROUTERS[router], s.capacity_factor), *moe_ops, dy
            )
            fns[(kind, router)] = (fn, (*moe_ops, dy))
    outs: dict = {}
    timings = time_rounds(fns, min_reps=s.min_reps, max_reps=s.max_reps, target_s=s.target_s, outputs=outs)
    ref = timings[("dense", "-")]
    for (kind, router), timing in timings.items():
        stats = {}
        if kind != "dense":
            stats = dataclasses.asdict(jax.device_get(outs[(kind, router)][1]))
        rows.append(layer_row(shape, kind, router, timing, ref, stats, compile_s[(kind, router)]))
    return rows


def layer_row(shape, kind, router, timing, ref, stats, secs) -> dict[str, Any]:
    """One JSON row of the layer table (times, tokens/s, ratios, drop rate, load skew)."""
    loads = stats.get("tokens_per_expert")
    n = shape.tokens * shape.top_k
    row = {
        **dataclasses.asdict(shape),
        "backend": kind,
        "router": router,
        "time": timing,
        "dense_time": ref,
        "tokens_per_s": shape.tokens / timing["median_s"],
        "useful_flops": 18.0 * n * shape.hidden * shape.ffn,
        "compile_s": secs,
        "drop_rate": float(stats.get("dropped_tokens", 0)) / n,
        "max_over_mean_load": None if loads is None else float(loads.max() / loads.mean()),
        "skipped": None,
    }
    row.update(ratio_stats(timing, ref))
    return row


def _without_routed_experts(next_fun, args, kwargs, context):
    """A flax method interceptor: ``MoEBlock.routed`` does no work at all (zeros, zero stats
    of the right shapes); every other module method runs as written."""
    if not (isinstance(context.module, MoEBlock) and context.method_name == "routed"):
        return next_fun(*args, **kwargs)
    x_TH, gate_HE = args[:2]
    E = gate_HE.shape[1]
    zero = jnp.zeros((), jnp.float32)
    stats = MoEStats(
        tokens_per_expert=jnp.zeros((E,), jnp.int32),
        aux_loss=zero,
        seq_aux_loss=zero,
        z_loss=zero,
        router_entropy=zero,
        dropped_tokens=jnp.zeros((), jnp.int32),
        **exchange_stats(0),
    )
    return jnp.zeros_like(x_TH), stats


def train_step(s: Sizes) -> dict[str, Any]:
    """The preset's train step with and without its MoE layers' work (see module doc)."""
    cfg = config.build(s.preset, ["parallel.devices=1"])
    mesh = sharding.make_mesh(jax.devices()[:1])
    t = cfg.train
    batch = jax.device_put(
        np.random.default_rng(0).integers(
            0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), dtype=np.int32
        ),
        sharding.batch_sharding(mesh),
    )
    steps, states, compile_s = {}, {}, {}
    with sharding.activate(mesh):
        for name in ("full", "moe removed"):
            state = init_state(cfg, mesh)
            fn = make_train_step(cfg, mesh, StepCounter(), jax.tree.map(lambda a: a.sharding, state))
            patch = (
                nn.intercept_methods(_without_routed_experts) if name != "full" else contextlib.nullcontext()
            )
            with patch:
                steps[name], _, compile_s[name] = compile_jit(fn, state, batch)
            states[name], _ = steps[name](state, batch)  # warm-up
        times = {name: [] for name in steps}
        for _ in range(s.step_reps):
            for name, fn in steps.items():
                t0 = time.perf_counter()
                states[name], metrics = fn(states[name], batch)
                jax.block_until_ready(states[name])
                times[name].append(time.perf_counter() - t0)
    full, stub = summarize(times["full"]), summarize(times["moe removed"])
    tokens = t.batch_size * t.seq_len
    return {
        "preset": s.preset,
        "backend": resolve_backend(cfg.moe.backend),
        "tokens_per_step": tokens,
        "experts": cfg.moe.num_experts,
        "top_k": cfg.moe.top_k,
        "layers": cfg.model.num_layers,
        "hidden": cfg.model.hidden,
        "ffn": cfg.moe.expert_ffn,
        "time": full,
        "time_moe_removed": stub,
        "tokens_per_s": tokens / full["median_s"],
        "moe_fraction": 1.0 - stub["median_s"] / full["median_s"],
        "compile_s": compile_s,
    }


def run(s: Sizes) -> dict[str, Any]:
    """The section's results (JSON-ready; the Markdown is added by the caller)."""
    t0 = time.perf_counter()
    rows = []
    for shape in s.shapes:
        t1 = time.perf_counter()
        rows += shape_rows(shape, s)
        log(
            f"{shape}: "
            + ", ".join(
                f"{r['backend']}/{r['router']} {r['ratio']:.2f}x dense"
                for r in rows
                if not r["skipped"] and r["tokens"] == shape.tokens and r["backend"] != "dense"
            )
            + f" [{time.perf_counter() - t1:.0f} s]"
        )
    step = train_step(s)
    log(f"train step {s.preset}: {step['tokens_per_s']:.0f} tokens/s, MoE {step['moe_fraction']:.0%}")
    return common.section_result(TITLE, s, rows=rows, train_step=step, wall_s=time.perf_counter() - t0)
