"""Capacity-bucket rows of the expert-parallel benchmark: the stepper emulation (the
trainer's ``jobplan.BucketPolicy`` over real exchanges), receive buffer fill against the worst
case, hierarchical's cross-domain stage and chunked rows.

``BucketRows`` is a mixin of ``ep.EPBench`` (it uses the bench's operands, compiled steps and
timing rows); see ``moe_train.bench.ep`` for the setup.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from moe_train.bench.common import fmt_ms
from moe_train.bench.ep_report import buffer_ratios
from moe_train.moe import Routing, route, router_logits
from moe_train.parallel.jobplan import BucketPolicy, EPPlan, hierarchical_stages

if TYPE_CHECKING:  # ep.py imports this module
    from moe_train.bench.ep import MeshCfg, Sizes

NUM_DEVICES = 8
TARGET_RATIO = 1.3  # the issue: mean receive buffer <= 1.3x the rows actually received
BALANCED = "balanced"  # the forced-balance routing (moe.router=balanced), on uniform tokens


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


class BucketRows:
    """Stepper emulation and bucket rows (mixed into ``ep.EPBench``)."""

    # what ``ep.EPBench`` provides (declared here for the type checker)
    s: Sizes
    factors: tuple[float | None, ...]
    weights: dict[str, np.ndarray]
    _x: dict[tuple, np.ndarray]
    x: Callable[..., np.ndarray]
    mesh: Callable[..., Any]
    placed: Callable[..., Any]
    run: Callable[..., Any]
    precompile: Callable[..., None]
    time_row: Callable[..., dict[str, Any]]

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
        """experts_TK of a batch, routed as ep_moe routes it (softmax top-k; forced balance
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

        Not in ep_moe's stats (recv_rows/recv_slots cover the in-domain stage): a token
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
