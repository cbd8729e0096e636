"""The chunked overlap (``moe.overlap_chunks``) and fp8 dispatch (``moe.dispatch_dtype``) of the EP
layer on 8 fake CPU devices: same results, time and bytes.

Shape letters (``moe_train.base.notation``): T tokens (global), H hidden, F expert width, E
experts, K top-k.

For each dispatcher, the layer's forward+backward runs with chunks 1, 2 and 4 and with fp8
dispatch (chunks 1 and 4); every row is timed side by side with the others of its dispatcher
(``time_rounds``), compared with chunks=1 in the activations' dtype (largest output and
gradient difference, relative to the tensor's largest magnitude) and its exchange bytes per
device are read from the lowered forward HLO. On CPU the collectives are memory copies that
XLA:CPU runs in order, so chunks cannot show the overlap they buy on a GPU (the times here
are the cost of more, smaller exchanges); the bytes and the equality hold anywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_train.bench import common
from moe_train.bench.common import collective_bytes, markdown_table, mib, row_done, time_rounds
from moe_train.moe import Routing, dropless_moe
from moe_train.parallel import sharding
from moe_train.parallel.jobplan import EPPlan

TITLE = "EP overlap chunks and fp8 dispatch (8 fake CPU devices)"
NUM_DEVICES = 8
VARIANTS = ((1, "activation"), (2, "activation"), (4, "activation"), (1, "fp8"), (4, "fp8"))
MESHES = {"allgather": (2, 4), "a2a": (2, 4), "hierarchical": (2, 4)}  # domains x shards each


@dataclasses.dataclass(frozen=True)
class Sizes:
    tokens: int  # T, split over the 8 devices
    hidden: int  # H
    ffn: int  # F
    experts: int  # E
    top_k: int  # K
    min_reps: int
    target_s: float  # timed seconds per dispatcher's round robin


FULL = Sizes(tokens=2048, hidden=128, ffn=256, experts=32, top_k=4, min_reps=3, target_s=2.0)
QUICK = Sizes(tokens=256, hidden=32, ffn=64, experts=16, top_k=2, min_reps=2, target_s=0.2)


def operands(s: Sizes, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((s.tokens, s.hidden))
    gate = rng.standard_normal((s.hidden, s.experts)) * 0.5
    w0, w1 = (rng.standard_normal((s.experts, s.hidden, s.ffn)) / np.sqrt(s.hidden) for _ in range(2))
    wo = rng.standard_normal((s.experts, s.ffn, s.hidden)) / np.sqrt(s.ffn)
    return tuple(a.astype(np.float32) for a in (x, gate, w0, w1, wo))


def step(plan: EPPlan, top_k: int):
    def loss(*ops):
        y, stats = dropless_moe(*ops, routing=Routing(top_k), plan=plan)
        return jnp.mean(jnp.square(y)) + 0.01 * stats.aux_loss, y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def dispatcher_rows(
    s: Sizes,
    dispatcher: str,
    ops,
    devices=None,
    domains: tuple[int, int] | None = None,
    variants=VARIANTS,
    profile_dir=None,
) -> list[dict[str, Any]]:
    """One row per (chunks, dispatch dtype) of ``variants``, the first being the reference:
    ``dispatcher`` over ``devices`` (default: 8 CPU devices) as domains x devices
    per domain (``domains``, default ``MESHES[dispatcher]``). With ``profile_dir``, a profiler
    trace of the reference and of the fastest variant goes there (``profile``)."""
    devices = jax.devices("cpu")[:NUM_DEVICES] if devices is None else devices
    G, D = domains or MESHES[dispatcher]
    mesh = sharding.make_mesh(devices, (len(devices) // (G * D), G, D))
    plans = {v: EPPlan(dispatcher, G * D, None, v[0], v[1]) for v in variants}
    with jax.set_mesh(mesh):
        fns = {str(v): (step(p, s.top_k), ops) for v, p in plans.items()}
        outputs: dict = {}
        timing = time_rounds(fns, min_reps=s.min_reps, target_s=s.target_s, outputs=outputs)
        hlo = {
            v: jax.jit(lambda *o, p=p: dropless_moe(*o, routing=Routing(s.top_k), plan=p)[0])
            .lower(*ops)
            .as_text(dialect="hlo")
            for v, p in plans.items()
        }
        if profile_dir is not None:
            fastest = min(variants, key=lambda v: timing[str(v)]["median_s"])
            profile({str(v): fns[str(v)] for v in dict.fromkeys((variants[0], fastest))}, profile_dir)
    (_, y_ref), g_ref = outputs[str(variants[0])]
    base_s = timing[str(variants[0])]["median_s"]
    rows = []
    for v in variants:
        (_, y), g = outputs[str(v)]
        moved = collective_bytes(hlo[v], lambda d: (d // D) % G)
        rows.append(
            {
                "dispatcher": dispatcher,
                "mesh": f"G{G}xD{D}",
                "chunks": v[0],
                "dispatch_dtype": v[1],
                "time": timing[str(v)],
                "time_ratio": timing[str(v)]["median_s"] / base_s,
                "y_rel_diff": _rel(y, y_ref),
                "grad_rel_diff": max(_rel(a, b) for a, b in zip(g, g_ref)),
                "fwd_bytes_per_device": moved["total"],
                "fwd_cross_domain_bytes": moved["cross_domain"],
            }
        )
    return rows


def profile(fns: dict[str, tuple[Any, Any]], out_dir, reps: int = 3) -> None:
    """A ``jax.profiler`` trace of ``reps`` calls of each compiled (fn, args), each call under
    a trace annotation named ``moe.overlap_chunks/<variant>`` (TensorBoard's profile plugin
    or Perfetto show each exchange beside or under the GEMMs)."""
    with jax.profiler.trace(str(out_dir)):
        for name, (fn, args) in fns.items():
            for _ in range(reps):
                with jax.profiler.TraceAnnotation(f"moe.overlap_chunks/{name}"):
                    jax.block_until_ready(fn(*args))


HEADER = [
    "dispatcher",
    "mesh",
    "chunks",
    "dispatch",
    "fwd+bwd ms",
    "x chunks=1",
    "max |dy|",
    "max |dgrad|",
    "fwd exchange MiB/device",
    "cross-domain MiB",
]


def cells(r: dict[str, Any]) -> list[Any]:
    """One row of the section's table."""
    return [
        r["dispatcher"],
        r["mesh"],
        r["chunks"],
        r["dispatch_dtype"],
        f"{r['time']['median_s'] * 1e3:.2f}",
        f"{r['time_ratio']:.2f}",
        f"{r['y_rel_diff']:.1e}",
        f"{r['grad_rel_diff']:.1e}",
        mib(r["fwd_bytes_per_device"]),
        mib(r["fwd_cross_domain_bytes"]),
    ]


def run(s: Sizes) -> dict[str, Any]:
    ops = operands(s)
    rows = []
    for dispatcher in MESHES:  # each row printed as its dispatcher's rows finish
        rows += dispatcher_rows(s, dispatcher, ops)
        for r in rows[-len(VARIANTS) :]:
            row_done("overlap", ", ".join(f"{h} {c}" for h, c in zip(HEADER, cells(r))))
    table = markdown_table(HEADER, [cells(r) for r in rows])
    md = (
        f"## {TITLE}\n\nT={s.tokens} tokens, H={s.hidden}, F={s.ffn}, E={s.experts}, "
        f"top-{s.top_k}, fp32 activations; differences are relative to the tensor's largest "
        f"magnitude, against chunks=1 in the activations' dtype. Chunked exchanges equal the "
        f"unchunked ones to fp32 rounding; fp8 rows (e4m3 + a per-row scale) carry "
        f"(H + 4) bytes per row instead of 4H here (bf16 on a GPU: 2H).\n\n{table}\n"
    )
    return common.section_result(TITLE, s, rows=rows, markdown=md)
