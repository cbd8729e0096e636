"""The compiled train step per expert-parallel plan, with capacity buckets for ``a2a``.

The ``a2a`` and ``hierarchical`` dispatchers' receive buffers are static. Instead of reserving the worst case
(every token of a shard sent to one destination), a step runs with the smallest bucket
(``moe.capacity_buckets`` x the balanced load) that has held recently. If an exchange
overflows, the step returns its input state unchanged and runs again on the next bucket
(each bucket compiles once); after ``moe.bucket_step_down_after`` steps whose largest pair
load (relative to the balanced load) would have fit the next smaller bucket, it steps down. The worst-case bucket can never
overflow, so every step ends dropless, bitwise equal to the worst-case path.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from moe_train.config import Config, ConfigError, parse_buckets
from moe_train.moe.ep import EPPlan
from moe_train.train import (CompiledMemory, StepCounter, TrainState, compiled_memory,
                             make_train_step)


def ep_plans(cfg: Config, mesh: Mesh) -> list[EPPlan | None]:
    """The plans a run may use, smallest buffers first; [None] on a single device."""
    ep = mesh.shape["expert_x"] * mesh.shape["expert"]
    if mesh.devices.size == 1:
        return [None]
    if ep == 1:
        return [EPPlan("local", 1, chunks=cfg.moe.chunks)]
    name = cfg.moe.dispatcher
    if name == "auto":  # two-stage once an EP group spans several domains
        name = "hierarchical" if mesh.shape["expert_x"] > 1 else "a2a"
    if name == "hierarchical" and mesh.shape["expert_x"] == 1:
        raise ConfigError(f"moe.dispatcher=hierarchical needs an EP group spanning several "
                          f"domains: parallel.ep={ep} fits one domain of {mesh.shape['expert']}; "
                          f"lower parallel.domain_size or use a2a")
    if name == "allgather":
        return [EPPlan("allgather", ep, chunks=cfg.moe.chunks)]
    factors = parse_buckets(cfg.moe.capacity_buckets) + [None]
    return [EPPlan(name, ep, f, cfg.moe.chunks) for f in factors]


class BucketedStep:
    """Runs one optimizer step on the smallest capacity bucket that holds the routing."""

    def __init__(self, cfg: Config, mesh: Mesh, counter: StepCounter, state_sharding: TrainState):
        self.cfg, self.mesh, self.counter, self.state_sharding = cfg, mesh, counter, state_sharding
        self.plans = ep_plans(cfg, mesh)
        self._compiled: dict[int, Any] = {}
        self.bucket, self.reruns, self._fits_smaller = 0, 0, 0

    def _fn(self, bucket: int):
        if bucket not in self._compiled:
            self._compiled[bucket] = make_train_step(self.cfg, self.mesh, self.counter,
                                                     self.state_sharding, self.plans[bucket])
        return self._compiled[bucket]

    def compiled_memory(self, state: TrainState, batch) -> CompiledMemory | None:
        """XLA's memory analysis of the current bucket's step (reuses its executable)."""
        return compiled_memory(self._fn(self.bucket), state, batch)

    def label(self) -> str | float | None:
        plan = self.plans[self.bucket]
        if plan is None or plan.dispatcher not in ("a2a", "hierarchical"):
            return None
        return "worst" if plan.capacity_factor is None else plan.capacity_factor

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        while True:
            state, raw = self._fn(self.bucket)(state, batch)
            raw = jax.device_get(raw)
            if not raw["overflow"]:
                break
            self.reruns += 1
            self.bucket += 1
            self._fits_smaller = 0
        raw["ep_bucket"], raw["ep_overflow_reruns"] = self.label(), self.reruns
        self._maybe_step_down(float(raw["max_pair_load"]))
        return state, raw

    def _maybe_step_down(self, max_pair_load: float) -> None:
        if self.bucket == 0:
            return
        smaller = self.plans[self.bucket - 1].capacity_factor
        self._fits_smaller = self._fits_smaller + 1 if max_pair_load <= smaller else 0
        if self._fits_smaller >= self.cfg.moe.bucket_step_down_after:
            self.bucket -= 1
            self._fits_smaller = 0
