"""The compiled train step per expert-parallel plan, with capacity buckets, pipelined.

The ``a2a`` and ``hierarchical`` dispatchers' receive buffers are static. Instead of
reserving the worst case (every token of a shard sent to one destination), a step runs with
the smallest bucket (``moe.capacity_buckets`` x the balanced load) that has held recently;
``jobplan.BucketPolicy`` decides. If an exchange overflows, the step returns its input state
unchanged and runs again on the next bucket (each bucket compiles once); after
``moe.bucket_step_down_after`` steps whose largest pair load (relative to the balanced load)
would have fit the next smaller bucket, it steps down. The worst-case bucket can never
overflow, so every step ends dropless, bitwise equal to the worst-case path.

The host never waits for a step before the next one is queued: step n+1 is dispatched with
step n's overflow flag as a device input (``hold``) and step n's flags are read after that
(``BucketedStep.submit``); on overflow the held step n+1 is discarded and n reruns.

In a multi-process job each bucket's step is compiled ahead of its first run and every process
waits for the others to compile it (``together.compiled_together``) before any runs it.

``BucketedStep`` is the one wrapper around the jitted step: given a ``log``, each
``submit``/``drain`` that traces the step (a compile) prints what is compiled and why (the
first step; a capacity bucket used for the first time; a step that overflowed its bucket and
reruns on the next one), heartbeats while XLA compiles (``progress.Waiting``), and the compile
time when done. A step XLA cannot fit in device memory ends the run in one line
(``fits.step_out_of_memory``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from moe_train.base import exits
from moe_train.config import Config
from moe_train.parallel import jobplan, sharding, together
from moe_train.parallel.jobplan import EPPlan
from moe_train.train import fits
from moe_train.train.progress import Log, Waiting
from moe_train.train.step import (
    CompiledMemory,
    StepCounter,
    TrainState,
    compiled_memory,
)


class Confirmed(NamedTuple):
    """A step whose overflow checks all passed: the state it returned is its committed update."""

    raw: dict[str, Any]  # its metrics on the host, plus ep_bucket and ep_overflow_reruns
    seconds: float  # from its dispatch (or the step before's confirmation, if later) to its own
    traces: int  # StepCounter.traces once it (and any rerun of it) was dispatched
    compiled: bool  # whether dispatching it or a rerun of it traced the step


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose overflow flag the host has not read yet."""

    batch: Any  # kept for a rerun: the data loader is never asked for it again
    raw: dict[str, Any]  # its metrics, on the device
    bucket: int  # the bucket it ran on
    t0: float  # when it was first dispatched
    traces: int  # StepCounter.traces after its latest dispatch
    traced: int  # traces its own dispatches caused


class BucketedStep:
    """Optimizer steps on the smallest capacity bucket that holds the routing, pipelined.

    ``submit`` dispatches a step, then reads the flags of the step before it, so the host
    never waits for a step before the next one is queued. The new step gets the earlier
    one's overflow flag as its ``hold`` input (on the device, no host read): if the earlier
    step overflowed, the new one returned its input state unchanged; its metrics are
    dropped, the earlier step reruns on the next bucket and the new one is dispatched again.
    Every committed update is therefore the same computation on the same state and batch as
    in a synchronous loop, bitwise. The state is donated: each call takes the state the
    previous call returned, and no earlier state may be read again.

    At most one step is in flight between calls; ``drain`` confirms it. The bucket follows
    ``jobplan.BucketPolicy``; a step-down applies one step later than in a synchronous
    loop (the next step was already dispatched), which changes buffers, never results.
    With a ``log``, every compile is announced and timed (module docstring).
    """

    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        counter: StepCounter,
        step_for: Callable[[EPPlan | None], Any],
        log: Log | None = None,
        first: int = 0,
    ):
        """``step_for(plan)`` jits one bucket's step, counting its traces in ``counter`` (the
        loop passes ``train.make_train_step`` bound to the run's config, mesh, counter and
        state sharding; the compile benchmark its EP layer step). ``log``: where the compile
        lines go (None: no lines); ``first``: the step before the first ``submit``."""
        self.cfg, self.mesh, self.counter = cfg, mesh, counter
        self.step_for = step_for
        self.log = log
        self.step = first  # the step the latest submit dispatched (for the compile lines)
        self.plans = sharding.ep_plans(cfg, mesh)
        self.policy = jobplan.BucketPolicy(
            [None if p is None else p.capacity_factor for p in self.plans], cfg.moe.bucket_step_down_after
        )
        self._compiled: dict[int, Any] = {}
        self._pending: _InFlight | None = None
        self._confirmed_at = float("-inf")
        # Made here, not in a step: its (tiny) compilation falls outside any timed step.
        self._false = jax.jit(lambda: jnp.zeros((), jnp.bool_), out_shardings=sharding.replicated(mesh))()

    @property
    def bucket(self) -> int:
        """Index into ``plans`` of the bucket the next dispatched step runs on."""
        return self.policy.bucket

    @property
    def reruns(self) -> int:
        """Steps rerun on a larger bucket because they overflowed, so far."""
        return self.policy.reruns

    def _fn(self, bucket: int):
        if bucket not in self._compiled:
            self._compiled[bucket] = self.step_for(self.plans[bucket])
        return self._compiled[bucket]

    def _holds(self, bucket: int) -> bool:
        """Whether the bucket's step can overflow, and so takes a ``hold`` input."""
        plan = self.plans[bucket]
        return plan is not None and plan.capacity_factor is not None

    def compiled_memory(self, state: TrainState, batch) -> CompiledMemory | None:
        """XLA's memory analysis of the current bucket's step (reuses its executable)."""
        hold = (self._false,) if self._holds(self.bucket) else ()
        return compiled_memory(self._fn(self.bucket), state, batch, *hold)

    def label(self, bucket: int | None = None) -> str | float | None:
        """The capacity factor of ``bucket`` (default: the current one), "worst" or None."""
        plan = self.plans[self.bucket if bucket is None else bucket]
        if plan is None or plan.dispatcher not in ("a2a", "hierarchical"):
            return None
        return "worst" if plan.capacity_factor is None else plan.capacity_factor

    def submit(self, state: TrainState, batch) -> tuple[TrainState, Confirmed | None]:
        """Dispatches the step of ``batch`` on ``state``, then confirms the step in flight
        before it (rerunning it while it overflows). Returns the newest state, whose step is
        in flight, and the confirmed earlier step, or None when none was in flight."""
        self.step += 1
        return self._watched(self._submit, self.step, state, batch)

    def drain(self, state: TrainState) -> tuple[TrainState, Confirmed | None]:
        """Confirms the step in flight, if any. Afterwards nothing is in flight and the
        returned state holds every committed update (safe to save or inspect)."""
        return self._watched(self._drain, self.step, state, confirming=self.step)

    def _submit(self, state: TrainState, batch) -> tuple[TrainState, Confirmed | None]:
        prev = self._pending
        hold = self._false if prev is None else prev.raw["overflow"]
        state, self._pending = self._dispatch(state, batch, hold)
        if prev is None:
            return state, None
        return self._confirm(state, prev, self._pending)

    def _drain(self, state: TrainState) -> tuple[TrainState, Confirmed | None]:
        if self._pending is None:
            return state, None
        return self._confirm(state, self._pending, None)

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One step, confirmed before it returns: (state, host metrics)."""
        if self._pending is not None:
            raise RuntimeError("BucketedStep: a step is in flight; drain() it first")
        state, _ = self.submit(state, batch)
        state, done = self.drain(state)
        assert done is not None, "the step submitted above"
        return state, done.raw

    def _dispatch(
        self, state: TrainState, batch, hold, again: _InFlight | None = None
    ) -> tuple[TrainState, _InFlight]:
        """Queues the step of ``batch`` on the current bucket (``again``: a step dispatched
        before, whose start time and traces carry over)."""
        bucket, before = self.policy.bucket, self.counter.traces
        args = (state, batch, hold) if self._holds(bucket) else (state, batch)
        t0 = time.perf_counter() if again is None else again.t0
        fn = self._fn(bucket)
        with self._out_of_memory():
            together.compiled_together(fn, args, f"train step, bucket {bucket}", self.cfg.parallel)
            state, raw = fn(*args)
        traced = self.counter.traces - before + (0 if again is None else again.traced)
        return state, _InFlight(batch, raw, bucket, t0, self.counter.traces, traced)

    def _read(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The host copy of a step's metrics: the only point where the host waits (where a
        step that ran out of device memory as it ran raises)."""
        with self._out_of_memory():
            return jax.device_get(raw)

    def _out_of_memory(self) -> exits.RaisedAs:
        """Around a step's dispatch or read: XLA could not fit the step in device memory is
        one line, exit 2 (``fits.step_out_of_memory``); any other error goes on as it was."""
        return exits.RaisedAs(lambda err: fits.step_out_of_memory(err, self.cfg), cause=False)

    def _confirm(
        self, state: TrainState, prev: _InFlight, nxt: _InFlight | None
    ) -> tuple[TrainState, Confirmed]:
        """Reads ``prev``'s flags. While it overflowed, ``nxt`` (held by that flag: it
        changed nothing) is dropped, ``prev`` reruns on the next bucket and ``nxt`` is
        dispatched again after it."""
        raw = self._read(prev.raw)
        while raw["overflow"]:
            self.policy.overflowed()
            state, prev = self._dispatch(state, prev.batch, self._false, again=prev)
            if nxt is not None:
                state, nxt = self._dispatch(state, nxt.batch, prev.raw["overflow"], again=nxt)
            raw = self._read(prev.raw)
        self._pending = nxt
        now = time.perf_counter()
        seconds, self._confirmed_at = now - max(prev.t0, self._confirmed_at), now
        raw["ep_bucket"], raw["ep_overflow_reruns"] = self.label(prev.bucket), self.reruns
        self.policy.finished(float(raw["max_pair_load"]))
        return state, Confirmed(raw, seconds, prev.traces, prev.traced > 0)

    def _watched(self, call: Callable[..., Any], n: int, *args, confirming: int | None = None):
        """``call(*args)``, with a line for a compile it causes (module docstring); ``n``: the
        step it dispatches, ``confirming``: the step it confirms (default ``n - 1``, the one
        dispatched before)."""
        if self.log is None:
            return call(*args)
        counter, before = self.counter, (self.counter.traces, self.reruns, self.label())
        confirming = n - 1 if confirming is None else confirming
        watch = Waiting(
            self.log,
            "compiling the train step",
            started=lambda: counter.traces != before[0],
            describe=lambda: "compiling the train step for " + self._why(before, n, confirming),
            done=False,
        )
        with watch:
            out = call(*args)
        if counter.traces != before[0]:
            # from the trace's start (seen within POLL_S) to the end of the call
            took = watch.seconds - ((watch.announced_at or watch.t0) - watch.t0)
            if watch.announced_at is None:  # traced and compiled within one poll
                self.log(f"compiling the train step for {self._why(before, n, confirming)}")
            new, label = counter.traces - before[0], self.label()
            times = "" if new == 1 else f" {new} times (each bucket it overflowed reran on the next)"
            now = "" if label is None else f"; capacity bucket now {label}"
            self.log(
                f"compiled the train step{times} in {took:.1f} s ({counter.traces} "
                f"compile(s) in this process so far{now})"
            )
        return out

    def _why(self, before: tuple, n: int, confirming: int) -> str:
        """Why the step compiles: ``before`` holds (traces, reruns, label) before the call."""
        traces, reruns, label = before
        if traces == 0:
            return f"step {n}, the first step (XLA compiles it once; later steps reuse it)"
        if self.reruns != reruns:
            return (
                f"a rerun of step {confirming}: it overflowed its expert-parallel "
                f"receive buffers (capacity bucket {label}), so it reruns, dropless, on "
                f"the next bucket, {self.label()} (each bucket compiles once)"
            )
        return (
            f"step {n} on capacity bucket {self.label()}, used for the first time (each bucket compiles once)"
        )
