"""Compile count and compile time over many steps with drifting routing.

The routing of step t draws each token's experts from log p = alpha(t) * (Zipf, hottest
experts first) (``bench.routing``): uniform for the first fifth of the steps, ramping to full
Zipf skew, holding, ramping back and ending uniform, so capacity buckets go up and (after
``moe.bucket_step_down_after`` quiet steps) down again. Fresh tokens every step.

- ``dropless``: the single-device ``dropless_moe`` layer, forward+backward, jitted once.
  Routing only changes values, so it must compile exactly once.
- ``ep``: ``dropless_moe`` with an EP plan (``a2a`` dispatcher) on 8 fake CPU devices, driven
  by the trainer's own ``stepper.BucketedStep`` (its bucket choice, overflow reruns and step-down),
  with the train step replaced by the layer's forward+backward. It must compile once per
  capacity bucket it touches, never more.

Compilations are counted twice: traces of the step function, and XLA backend compilations
reported by ``jax.monitoring`` while the steps run. Compile time is the backend compile time.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_train.bench import common
from moe_train.config import Config, MoEConfig
from moe_train.moe import Routing, dropless_moe
from moe_train.moe.routings import (
    MoEShape,
    expert_weights,
    gumbel_logits,
    log_preference,
    tokens_for_logits,
)
from moe_train.parallel import sharding
from moe_train.train import stepper
from moe_train.train.step import StepCounter

TITLE = "Compilations over drifting routing"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: list[float] | None = None  # durations recorded while a count is active


def _listener(event: str, duration_secs: float, **_) -> None:
    if _compiles is not None and event == _COMPILE_EVENT:
        _compiles.append(duration_secs)


jax.monitoring.register_event_duration_secs_listener(_listener)


@dataclasses.dataclass(frozen=True)
class Sizes(MoEShape):
    """tokens: the global batch of the EP run (the dropless run uses the same)."""

    steps: int
    mesh: tuple[int, int, int] = (1, 2, 4)  # (data, expert_x, expert): EP = 8
    buckets: tuple[float, ...] = MoEConfig().capacity_buckets  # capacity factors, smallest first
    step_down_after: int = MoEConfig().bucket_step_down_after


FULL = Sizes(steps=100, tokens=1024, hidden=64, ffn=128, experts=32, top_k=2)
QUICK = Sizes(
    steps=24, tokens=256, hidden=32, ffn=32, experts=16, top_k=2, buckets=(1.25, 2.0), step_down_after=4
)


def log(msg: str) -> None:
    print(f"[bench compiles] {msg}", file=sys.stderr, flush=True)


def drift(step: int, steps: int) -> float:
    """Skew alpha(t) in [0, 1]: 0, ramp up, 1, ramp down, 0 (fifths of the run)."""
    f = step / max(steps - 1, 1)
    return float(np.clip(min((f - 0.2) / 0.25, (0.8 - f) / 0.2), 0.0, 1.0))


class Batches:
    """Token batches whose router logits realise the drifting routing."""

    def __init__(self, s: Sizes):
        self.s = s
        w = expert_weights(s.hidden, s.ffn, s.experts)
        self.gate64 = w["gate"]
        self.weights = tuple(jnp.asarray(w[k], jnp.float32) for k in ("gate", "w0", "w1", "wo"))
        self.zipf = log_preference(s.experts, "zipf-sorted")

    def x(self, step: int) -> np.ndarray:
        s = self.s
        logits = gumbel_logits(s.tokens, s.experts, drift(step, s.steps) * self.zipf, seed=step)
        return tokens_for_logits(logits, self.gate64, seed=step).astype(np.float32)


def _loss(y, stats):
    return jnp.mean(jnp.square(y.astype(jnp.float32))) + 0.01 * stats.aux_loss


def _counting(fn):
    """Run fn while counting backend compilations; returns (result, [durations])."""
    global _compiles
    _compiles = []
    try:
        out = fn()
        return out, list(_compiles)
    finally:
        _compiles = None


def dropless_run(s: Sizes, batches: Batches) -> dict[str, Any]:
    """The single-device layer over the drifting steps: traces and XLA compilations."""
    traces = []

    def step(x, gate, w0, w1, wo):
        traces.append(1)
        y, stats = dropless_moe(x, gate, w0, w1, wo, Routing(s.top_k), backend="tiled")
        return _loss(y, stats), stats.tokens_per_expert

    fn = jax.jit(jax.value_and_grad(step, argnums=(0, 1, 2, 3, 4), has_aux=True))
    device = jax.devices()[0]

    def loop():
        loads = []
        for t in range(s.steps):
            (_, load), _ = fn(jax.device_put(batches.x(t), device), *batches.weights)
            loads.append(np.asarray(load))
        return loads

    t0 = time.perf_counter()
    loads, compiles = _counting(loop)
    skew = [float(l.max() / l.mean()) for l in loads]
    return {
        "steps": s.steps,
        "traces": len(traces),
        "compilations": len(compiles),
        "compile_s": sum(compiles),
        "wall_s": time.perf_counter() - t0,
        "distinct_routings": len({l.tobytes() for l in loads}),
        "max_over_mean_load": [min(skew), max(skew)],
        "expected": 1,
        "ok": len(traces) == len(compiles) == 1,
    }


def _layer_step(s: Sizes, batches: Batches, counter: StepCounter):
    """BucketedStep's ``step_for`` for this section: the EP layer's fwd+bwd as the bucketed
    step (the optimizer and the rest of the model left out)."""

    def make(plan):
        """The jitted bucketed layer step of ``plan``."""

        def step(state, x, hold=None):  # the state never changes, so a held step is the same
            counter.traces += 1

            def loss(*ops):
                y, stats = dropless_moe(*ops, routing=Routing(s.top_k), plan=plan, backend="tiled")
                return _loss(y, stats), stats

            (_, stats), _ = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, *state)
            return state, {"overflow": stats.overflow, "max_pair_load": stats.max_pair_load}

        return jax.jit(step)

    return make


def ep_run(s: Sizes, batches: Batches) -> dict[str, Any]:
    """The EP layer under BucketedStep over the drifting steps: compilations vs buckets."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = sharding.make_mesh(jax.devices("cpu")[: int(np.prod(s.mesh))], s.mesh)
    cfg = dataclasses.replace(
        Config(),
        moe=dataclasses.replace(
            MoEConfig(),
            num_experts=s.experts,
            top_k=s.top_k,
            dispatcher="a2a",
            capacity_buckets=s.buckets,
            bucket_step_down_after=s.step_down_after,
        ),
    )
    counter = StepCounter()
    tok = NamedSharding(mesh, P(sharding.TOKEN_AXES, None))
    exp = NamedSharding(mesh, P(sharding.EP_AXES, None, None))
    gate, *experts = batches.weights
    # the layer step's state is its weights, not a TrainState (BucketedStep only passes it on)
    state: Any = (jax.device_put(gate, NamedSharding(mesh, P())), *(jax.device_put(w, exp) for w in experts))
    bucketed = stepper.BucketedStep(cfg, mesh, counter, _layer_step(s, batches, counter))

    def loop():
        per_step = []
        with jax.set_mesh(mesh):
            for t in range(s.steps):
                t0, before = time.perf_counter(), counter.traces
                _, raw = bucketed(state, jax.device_put(batches.x(t), tok))
                per_step.append(
                    {
                        "bucket": raw["ep_bucket"],
                        "reruns": raw["ep_overflow_reruns"],
                        "compiled": counter.traces > before,
                        "wall_s": time.perf_counter() - t0,
                    }
                )
        return per_step

    t0 = time.perf_counter()
    per_step, compiles = _counting(loop)
    touched = sorted(bucketed._compiled)
    labels = []
    for i in touched:
        plan = bucketed.plans[i]
        assert plan is not None, "an EP step: every bucket has a plan"
        labels.append(plan.capacity_factor)
    return {
        "steps": s.steps,
        "traces": counter.traces,
        "compilations": len(compiles),
        "compile_s": sum(compiles),
        "wall_s": time.perf_counter() - t0,
        "buckets_touched": ["worst" if f is None else f for f in labels],
        "reruns": bucketed.reruns,
        "expected": len(touched),
        "bucket_by_step": [p["bucket"] for p in per_step],
        "steady_step_s": float(
            np.median([p["wall_s"] for p in per_step if not p["compiled"]] or [float("nan")])
        ),
        "ok": counter.traces == len(compiles) == len(touched),
    }


def run(s: Sizes) -> dict[str, Any]:
    """The section's results (JSON-ready)."""
    t0 = time.perf_counter()
    batches = Batches(s)
    dropless = dropless_run(s, batches)
    log(f"dropless: {dropless['compilations']} compilation(s) over {s.steps} steps")
    ep = ep_run(s, batches)
    log(
        f"ep a2a: {ep['compilations']} compilations, buckets touched {ep['buckets_touched']}, "
        f"{ep['reruns']} reruns"
    )
    return common.section_result(TITLE, s, dropless=dropless, ep=ep, wall_s=time.perf_counter() - t0)
