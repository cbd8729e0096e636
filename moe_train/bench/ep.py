"""Expert-parallel benchmark on 8 fake CPU devices: dispatchers, routings, capacity buckets.

Every EP row runs ``dropless_moe`` with an EP plan forward+backward under ``jit`` on a mesh
(data, expert_x, expert) = (dp, domains, shards per domain) of the process's 8 CPU devices; the
reference row runs the single-device ``dropless_moe`` on the same global batch. Data is
fp32 and the grouped GEMM uses the ``tiled`` backend (the CPU default), which multiplies
only the rows routed to local experts: empty buffer slots cost copies (exchange, permute,
zero-filled outputs), not GEMMs, so on CPU a dispatcher's time follows its buffer sizes less
than its rows.

Routing (``moe_train.moe.routings``). Each token's router logits are ``pref[e] + Gumbel noise``,
so its top-k experts are
a draw without replacement from ``p_e ~ pref`` (the Gumbel-top-k trick); ``uniform`` has
``pref = 0``, ``zipf`` has ``p_e ~ 1 / rank_e ** s`` with the ranks shuffled over the experts
(a fixed permutation; hot experts land on random EP ranks) and ``zipf-sorted`` puts the
hottest experts on EP rank 0 (the adversarial placement). The logits are made exactly by
the gate kernel: ``x = x0 + (logits - x0 @ gate) @ pinv(gate)`` gives ``x @ gate = logits``
for random ``x0`` and a random full-column-rank gate (needs H >= E). No expert_bias is used.
``balanced`` is the forced-balance router of ``study.router=balanced`` (benchmarks only: token t
of each device takes experts (t*K + j) mod E, whatever its scores) on the ``uniform`` tokens:
the load published forced-balance tables are measured at, timed beside the dropless rows.

Capacity buckets follow the trainer's ``moe_train.parallel.jobplan.BucketPolicy``: over ``steps``
routing batches the step starts at the smallest bucket (the factors of
``moe.capacity_buckets`` times the balanced load, then the worst case), reruns on the next
bucket whenever an exchange overflows, and keeps the bucket for the next batch (stepping down
after ``moe.bucket_step_down_after`` = 20 quiet batches, more than are run here).
Receive-buffer fill = recv_rows / recv_slots. The bucket rows (``EPBench.mesh_rows``): the stepper
emulation over real exchanges, receive buffer fill against the worst case, hierarchical's
cross-domain stage and chunked rows.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_train.bench.common import collective_bytes, compile_jit, fmt_ms, time_compiled
from moe_train.bench.ep_report import beside_balanced, buffer_ratios, markdown, skew_summary
from moe_train.config import MoEConfig
from moe_train.moe import Routing, dropless_moe, route, router_logits
from moe_train.moe.routings import (
    ZIPF_S,
    MoEShape,
    expert_weights,
    gumbel_logits,
    tokens_for_logits,
)
from moe_train.parallel import sharding
from moe_train.parallel.jobplan import BucketPolicy, EPPlan, bucket_factors, hierarchical_stages

TITLE = "Expert parallel (8 fake CPU devices)"
BUCKETS = MoEConfig().capacity_buckets  # the trainer's default (sorted); then worst
DTYPE = jnp.float32
BACKEND = "tiled"
NUM_DEVICES = 8
TARGET_RATIO = 1.3  # the issue: mean receive buffer <= 1.3x the rows actually received
BALANCED = "balanced"  # the forced-balance routing (study.router=balanced), on uniform tokens


def router(top_k: int, routing: str) -> Routing:
    """The router of a bench routing: forced balance for ``balanced``, else top-k of the scores."""
    return Routing(top_k, balanced=routing == BALANCED)


def log(msg: str) -> None:
    print(f"[bench ep] {msg}", file=sys.stderr, flush=True)


def host_stats(out) -> dict[str, Any]:
    (_, stats), _ = out
    return {k: np.asarray(v) for k, v in dataclasses.asdict(jax.device_get(stats)).items()}


def factor_label(f: float | None) -> str:
    return "worst" if f is None else f"{f:g}"


@dataclasses.dataclass(frozen=True)
class MeshCfg:
    dp: int
    domains: int  # G: mesh axis expert_x
    domain_size: int  # D: mesh axis expert
    dispatchers: tuple[str, ...]

    @property
    def ep(self) -> int:
        return self.domains * self.domain_size

    @property
    def label(self) -> str:
        return f"EP{self.ep} dp{self.dp} G{self.domains}xD{self.domain_size}"

    def domain_of(self, device_id: int) -> int:
        """Fast-link domain of a position in the mesh's device order."""
        return (device_id // self.domain_size) % self.domains


ALL = ("allgather", "a2a", "hierarchical")
EP8_D4 = MeshCfg(1, 2, 4, ALL)  # EP=8 as 2 domains of 4
EP8_D2 = MeshCfg(1, 4, 2, ("a2a", "hierarchical"))  # EP=8 as 4 domains of 2
EP4_DP2 = MeshCfg(2, 2, 2, ALL)  # EP=4 (2 domains of 2) x DP=2


@dataclasses.dataclass(frozen=True)
class Sizes(MoEShape):
    """tokens: the global batch, split over all 8 devices."""

    steps: int  # routing batches of the stepper emulation
    min_reps: int
    target_s: float  # timed seconds per row (reps = target / step time, at least min_reps)
    meshes: tuple[MeshCfg, ...]
    routings: tuple[str, ...]  # routings of the timing rows
    bucket_routings: tuple[str, ...]  # routings of the capacity-bucket rows (a superset)
    buckets: tuple[float, ...] = BUCKETS  # capacity factors tried before the worst case
    step_down_after: int = MoEConfig().bucket_step_down_after  # quiet batches, then a smaller bucket
    chunk_rows: bool = True  # chunks=2 rows on the first mesh


# One mesh in `make bench` (each bucket of each dispatcher is a compilation; the 10-minute
# budget of 2 cores); EP8_D2 and EP4_DP2 are kept for runs that can afford them.
FULL = Sizes(
    tokens=2048,
    hidden=128,
    ffn=256,
    experts=32,
    top_k=4,
    steps=2,
    min_reps=3,
    target_s=1.0,
    meshes=(EP8_D4,),
    routings=("uniform", "zipf", BALANCED),
    bucket_routings=("uniform", "zipf", "zipf-sorted", BALANCED),
    chunk_rows=False,
)
# quick: every dispatcher once, fewer buckets (each bucket is a compilation, ~4 s on 2 cores)
QUICK = dataclasses.replace(
    FULL,
    tokens=256,
    hidden=32,
    ffn=64,
    experts=16,
    top_k=2,
    target_s=0.1,
    bucket_routings=("uniform", "zipf", BALANCED),
    buckets=(2.0,),
)


# ----------------------------------------------------------------------------- operands


def tokens(s: Sizes, gate_HE: np.ndarray, routing: str, step: int) -> np.ndarray:
    """x [T, H] whose router logits x @ gate are log p + Gumbel noise (see module doc)."""
    pref = "uniform" if routing == BALANCED else routing
    logits = gumbel_logits(s.tokens, s.experts, pref, seed=step)  # same noise per routing
    return tokens_for_logits(logits, gate_HE, seed=step)


# ----------------------------------------------------------------------------- functions


def _loss(y_TH, stats):
    return jnp.mean(jnp.sum(jnp.square(y_TH.astype(jnp.float32)), axis=-1)) + 0.01 * stats.aux_loss


def ep_step(plan: EPPlan, routing: Routing):
    def loss(x, gate, w0, w1, wo):
        y, stats = dropless_moe(x, gate, w0, w1, wo, routing, plan=plan, backend=BACKEND)
        return _loss(y, stats), stats

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def ep_forward(plan: EPPlan, routing: Routing):
    return jax.jit(lambda *ops: dropless_moe(*ops, routing=routing, plan=plan, backend=BACKEND))


def dense_step(routing: Routing):
    def loss(x, gate, w0, w1, wo):
        y, stats = dropless_moe(x, gate, w0, w1, wo, routing, backend=BACKEND)
        return _loss(y, stats), stats

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


# ----------------------------------------------------------------------------- the bench


def _made_once(store: dict[tuple, Any], key: tuple, mesh, make: Callable[[], Any]) -> Any:
    """``store[key]``, made by ``make`` under ``mesh`` the first time it is asked for."""
    if key not in store:
        with jax.set_mesh(mesh):
            store[key] = make()
    return store[key]


class EPBench:
    """Compiled EP steps per (mesh, plan), their timing rows and the operands they share."""

    def __init__(self, s: Sizes):
        self.s = s
        self.devices = jax.devices("cpu")[:NUM_DEVICES]
        if len(self.devices) < NUM_DEVICES:
            raise RuntimeError(
                f"needs {NUM_DEVICES} CPU devices, found {len(self.devices)}: set "
                f"jax.config.update('jax_num_cpu_devices', 8) before using JAX"
            )
        w = expert_weights(s.hidden, s.ffn, s.experts)
        self.weights = {k: v.astype(np.float32) for k, v in w.items()}
        self.gate64 = w["gate"]
        self._x: dict[tuple, np.ndarray] = {}  # token batches and their routed experts
        self._compiled: dict[tuple, Any] = {}
        self._bytes: dict[tuple, dict] = {}
        self.factors = bucket_factors("a2a", s.buckets)  # the buckets, then the worst case
        self.compile_s: dict[str, float] = {}

    # operands -----------------------------------------------------------------
    def x(self, routing: str, step: int) -> np.ndarray:
        key = (routing, step)
        if key not in self._x:
            self._x[key] = tokens(self.s, self.gate64, routing, step).astype(np.float32)
        return self._x[key]

    def placed(self, mc: MeshCfg, mesh, routing: str, step: int):
        tok = NamedSharding(mesh, P(sharding.TOKEN_AXES, None))
        rep = NamedSharding(mesh, P())
        exp = NamedSharding(mesh, P(sharding.EP_AXES, None, None))
        w = self.weights
        return (
            jax.device_put(self.x(routing, step), tok),
            jax.device_put(w["gate"], rep),
            jax.device_put(w["w0"], exp),
            jax.device_put(w["w1"], exp),
            jax.device_put(w["wo"], exp),
        )

    def mesh(self, mc: MeshCfg):
        return sharding.make_mesh(self.devices, (mc.dp, mc.domains, mc.domain_size))

    # compiled steps -----------------------------------------------------------
    def step_fn(self, mc: MeshCfg, mesh, plan: EPPlan, args, routing: str) -> Callable:
        """The compiled fwd+bwd step of a (mesh, plan, router), compiled once and cached."""
        r = router(self.s.top_k, routing)

        def compiled() -> Callable:
            fn, _, secs = compile_jit(ep_step(plan, r), *args)
            self.compile_s[
                f"{mc.label} {plan.dispatcher} {factor_label(plan.capacity_factor)} "
                f"chunks={plan.chunks}{' balanced' if r.balanced else ''}"
            ] = secs
            return fn

        return _made_once(self._compiled, (mc, plan, r), mesh, compiled)

    def precompile(self, mc: MeshCfg, mesh, plans: list[EPPlan], args, routing: str) -> None:
        """Compile plans not compiled yet, two at a time (XLA compiles outside the GIL).

        The stepper emulation touches most buckets of a dispatcher anyway; compiling them
        side by side halves the compile-bound part of this section on 2 cores. Compile
        seconds of such plans are measured while another compile runs.
        """
        r = router(self.s.top_k, routing)
        todo = [p for p in dict.fromkeys(plans) if (mc, p, r) not in self._compiled]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as ex:
            list(ex.map(lambda p: self.step_fn(mc, mesh, p, args, routing), todo))

    def fwd_bytes(self, mc, mesh, plan, args, routing: str) -> dict[str, Any]:
        """Collective bytes per device of the forward pass (from its lowered HLO)."""
        r = router(self.s.top_k, routing)

        def measured() -> dict[str, Any]:
            return collective_bytes(ep_forward(plan, r).lower(*args).as_text(dialect="hlo"), mc.domain_of)

        return _made_once(self._bytes, (mc, plan, r), mesh, measured)

    def run(self, mc, mesh, plan, args, routing: str):
        with jax.set_mesh(mesh):
            return self.step_fn(mc, mesh, plan, args, routing)(*args)

    def time_row(self, mc, mesh, plan, routing, args) -> dict[str, Any]:
        """One timed EP row: fwd+bwd time, exchange stats and bytes moved."""
        fn = self.step_fn(mc, mesh, plan, args, routing)
        with jax.set_mesh(mesh):
            timing, out = time_compiled(fn, args, min_reps=self.s.min_reps, target_s=self.s.target_s)
        st = host_stats(out)
        H, n = self.s.hidden, NUM_DEVICES
        item = jnp.dtype(DTYPE).itemsize
        return {
            "kind": "ep",
            "mesh": mc.label,
            "dp": mc.dp,
            "ep": mc.ep,
            "domains": mc.domains,
            "domain_size": mc.domain_size,
            "dispatcher": plan.dispatcher,
            "routing": routing,
            "bucket": factor_label(plan.capacity_factor) if plan.dispatcher != "allgather" else None,
            "chunks": plan.chunks,
            "time": timing,
            "recv_rows": float(st["recv_rows"]),
            "recv_slots": float(st["recv_slots"]),
            "fill": float(st["recv_rows"] / st["recv_slots"]),
            "max_pair_load": float(st["max_pair_load"]),
            "overflow": bool(st["overflow"]),
            "fwd_bytes_per_device": self.fwd_bytes(mc, mesh, plan, args, routing),
            # slow_rows is summed over all shards, one way; x2: dispatch and combine
            "slow_link_bytes_per_device": float(st["slow_rows"]) / n * H * item * 2,
        }

    # rows ---------------------------------------------------------------------
    def dense_rows(self) -> list[dict]:
        """Single-device dropless_moe rows (the reference) per timed routing."""
        rows = []
        dev = self.devices[0]
        fns: dict[Routing, Callable] = {}
        for routing in self.s.routings:
            args = [jax.device_put(a, dev) for a in (self.x(routing, 0), *self.weights.values())]
            r = router(self.s.top_k, routing)
            if r not in fns:
                fns[r], _, secs = compile_jit(dense_step(r), *args)
                self.compile_s["dense" + (" balanced" if r.balanced else "")] = secs
            fn = fns[r]
            timing, out = time_compiled(fn, args, min_reps=self.s.min_reps, target_s=self.s.target_s)
            loads = host_stats(out)["tokens_per_expert"].astype(float)
            rows.append(
                {
                    "kind": "dense",
                    "mesh": "1 device",
                    "dispatcher": "dense (dropless_moe)",
                    "routing": routing,
                    "time": timing,
                    "chunks": 1,
                    "tokens_per_expert": loads.tolist(),
                }
            )
            log(f"dense {routing}: {fmt_ms(timing)[0]} ms")
        return rows

    # capacity buckets ---------------------------------------------------------
    def stepper(
        self, mc, mesh, dispatcher, routing, start: int = 0, chunks: int = 1, steps: int | None = None
    ) -> dict[str, Any]:
        """Buckets as the trainer's ``jobplan.BucketPolicy`` picks them over ``steps`` batches,
        from bucket ``start`` on; "held" is the bucket the last batch ran on."""
        policy = BucketPolicy(self.factors, self.s.step_down_after)
        policy.bucket = held = start
        per_step = []
        for step in range(steps or self.s.steps):
            args = self.placed(mc, mesh, routing, step)
            while True:
                plan = EPPlan(dispatcher, mc.ep, policy.factor, chunks)
                st = host_stats(self.run(mc, mesh, plan, args, routing))
                if not st["overflow"]:
                    break
                try:
                    policy.overflowed()
                except RuntimeError as err:
                    raise RuntimeError(f"{mc.label} {dispatcher}: {err}") from None
            held = policy.bucket
            per_step.append(
                {
                    "bucket": factor_label(policy.factor),
                    "factor": policy.factor,
                    "recv_rows": float(st["recv_rows"]),
                    "recv_slots": float(st["recv_slots"]),
                    "max_pair_load": float(st["max_pair_load"]),
                }
            )
            policy.finished(float(st["max_pair_load"]))
        return {"held_index": held, "held": self.factors[held], "reruns": policy.reruns, "steps": per_step}

    def worst_fill(self, mc, mesh, dispatcher, routing) -> list[dict]:
        out = []
        for step in range(self.s.steps):
            st = host_stats(
                self.run(
                    mc, mesh, EPPlan(dispatcher, mc.ep, None), self.placed(mc, mesh, routing, step), routing
                )
            )
            out.append(
                {"factor": None, "recv_rows": float(st["recv_rows"]), "recv_slots": float(st["recv_slots"])}
            )
        return out

    def experts(self, routing: str, step: int) -> np.ndarray:
        """experts_TK of a batch, routed as dropless_moe routes it (softmax top-k; forced balance
        per device's tokens)."""
        key = ("experts", routing, step)
        if key not in self._x:
            r = router(self.s.top_k, routing)
            fn = jax.jit(lambda x, g: route(router_logits(x, g), r)[1])
            x = self.x(routing, step).reshape(NUM_DEVICES, -1, self.s.hidden)  # one per device
            self._x[key] = np.concatenate([np.asarray(fn(xd, self.weights["gate"])) for xd in x])
        return self._x[key]

    def stage1(self, mc: MeshCfg, routing: str, step: int, factor: float | None) -> tuple[int, int]:
        """(rows received, buffer rows) of hierarchical's cross-domain stage, summed over devices.

        Not in dropless_moe's stats (recv_rows/recv_slots cover the in-domain stage): a token
        sends one row to every domain holding one of its experts, its own included, into
        G * C1 slots per device; C1 as ``jobplan.hierarchical_stages`` sizes it.
        """
        G, L = mc.domains, self.s.experts // mc.ep
        dom_TK = self.experts(routing, step) // (L * mc.domain_size)
        rows = int(np.sum(np.any(dom_TK[:, :, None] == np.arange(G), axis=1)))
        one, _ = hierarchical_stages(self.s.tokens // NUM_DEVICES, self.s.top_k, L, G, mc.domain_size, factor)
        return rows, NUM_DEVICES * one.peers * one.slots

    def mesh_rows(self, mc: MeshCfg) -> tuple[list[dict], list[dict], dict]:
        """Timing and bucket rows of one mesh: per dispatcher and routing, the stepper emulation,
        the worst-case fill and the timed plans."""
        mesh = self.mesh(mc)
        timing_rows, bucket_rows, held_uniform = [], [], {}
        for dispatcher in mc.dispatchers:
            for routing in self.s.bucket_routings:
                timed = routing in self.s.routings
                args0 = self.placed(mc, mesh, routing, 0)
                if dispatcher == "allgather":
                    if timed:
                        row = self.time_row(mc, mesh, EPPlan(dispatcher, mc.ep), routing, args0)
                        timing_rows.append(row)
                        log(f"{mc.label} allgather {routing}: {fmt_ms(row['time'])[0]} ms")
                    continue
                t0 = time.perf_counter()
                if routing == self.s.bucket_routings[0]:  # every bucket, side by side
                    self.precompile(
                        mc, mesh, [EPPlan(dispatcher, mc.ep, f) for f in self.factors], args0, routing
                    )
                emu = self.stepper(mc, mesh, dispatcher, routing)
                worst = self.worst_fill(mc, mesh, dispatcher, routing)
                if routing == "uniform":
                    held_uniform[dispatcher] = emu["held_index"]
                if dispatcher == "hierarchical":  # add the cross-domain stage's buffer
                    for steps in (emu["steps"], worst):
                        for i, r in enumerate(steps):
                            r["stage1_rows"], r["stage1_slots"] = self.stage1(mc, routing, i, r["factor"])
                bound = float(np.mean([r["max_pair_load"] for r in emu["steps"]]))
                row = {
                    "mesh": mc.label,
                    "ep": mc.ep,
                    "dp": mc.dp,
                    "dispatcher": dispatcher,
                    "routing": routing,
                    "held_bucket": factor_label(emu["held"]),
                    "reruns": emu["reruns"],
                    "steps": emu["steps"],
                    "worst_steps": worst,
                    "pair_load_bound": bound,
                }
                row.update(buffer_ratios(emu["steps"]))
                row.update({f"worst_{k}": v for k, v in buffer_ratios(worst).items()})
                row["target_met"] = bool(row["buffer_over_received"] <= TARGET_RATIO)
                bucket_rows.append(row)
                log(
                    f"{mc.label} {dispatcher} {routing}: bucket {row['held_bucket']} after "
                    f"{emu['reruns']} reruns, buffer/received {row['buffer_over_received']:.2f} "
                    f"(worst {row['worst_buffer_over_received']:.2f}, bound {bound:.2f}) "
                    f"[{time.perf_counter() - t0:.0f} s]"
                )
                if not timed:
                    continue
                plans = [EPPlan(dispatcher, mc.ep, emu["held"])]
                if emu["held"] is not None:
                    plans.append(EPPlan(dispatcher, mc.ep, None))
                for plan in plans:
                    row = self.time_row(mc, mesh, plan, routing, args0)
                    timing_rows.append(row)
                    log(
                        f"{mc.label} {dispatcher} {routing} bucket "
                        f"{factor_label(plan.capacity_factor)}: {fmt_ms(row['time'])[0]} ms"
                    )
        return timing_rows, bucket_rows, held_uniform

    def chunk_rows(self, mc: MeshCfg, held_uniform: dict[str, int]) -> list[dict]:
        """chunks=2 on uniform routing, at the bucket that held for chunks=1 (or the next
        one that holds for the chunked exchange)."""
        mesh, rows = self.mesh(mc), []
        args0 = self.placed(mc, mesh, "uniform", 0)
        for dispatcher in mc.dispatchers:
            factor = None
            if dispatcher != "allgather":
                emu = self.stepper(
                    mc, mesh, dispatcher, "uniform", start=held_uniform[dispatcher], chunks=2, steps=1
                )
                factor = emu["held"]
            row = self.time_row(mc, mesh, EPPlan(dispatcher, mc.ep, factor, chunks=2), "uniform", args0)
            rows.append(row)
            log(f"{mc.label} {dispatcher} chunks=2: {fmt_ms(row['time'])[0]} ms")
        return rows


def run(s: Sizes) -> dict[str, Any]:
    """The section's results (JSON-ready) and its Markdown."""
    t0 = time.perf_counter()
    bench = EPBench(s)
    timing = bench.dense_rows()
    buckets: list[dict] = []
    for i, mc in enumerate(s.meshes):
        t_rows, b_rows, held = bench.mesh_rows(mc)
        timing += t_rows
        buckets += b_rows
        if i == 0 and s.chunk_rows:
            timing += bench.chunk_rows(mc, held)
    skew = skew_summary(s, [r for r in timing if r["kind"] == "dense"])
    section = {
        "title": TITLE,
        "sizes": {k: v for k, v in dataclasses.asdict(s).items() if k != "meshes"},
        "meshes": [mc.label for mc in s.meshes],
        "dtype": jnp.dtype(DTYPE).name,
        "backend": BACKEND,
        "cpu_count": os.cpu_count(),
        "zipf_exponent": ZIPF_S,
        "capacity_buckets": list(s.buckets),
        "target_ratio": TARGET_RATIO,
        "realized_skew": skew,
        "timing": timing,
        "buckets": buckets,
        "compile_s": bench.compile_s,
        "wall_s": time.perf_counter() - t0,
    }
    section["beside_balanced"] = beside_balanced(section)
    section["markdown"] = markdown(section)
    return section
