"""A line for every wait of the trainer: compiles, the self-test, evaluations, saves.

``Waiting`` (``moe_train.base.waiting``, re-exported here) is a heartbeat thread around one
blocking call: once the call has taken ``after_s`` (or, for a compile, once the train step
starts tracing) it prints what it is waiting for, then ``still <what>: N s`` every
``every_s`` seconds, and when the call returns ``<what>: done in N s`` (only if it printed
anything: quick calls stay silent).

``WatchedStep`` wraps ``stepper.BucketedStep``: each ``submit``/``drain`` that traces the
train step (a compile) prints what is compiled and why (the first step; a capacity bucket
used for the first time; a step that overflowed its bucket and reruns on the next one),
heartbeats while XLA compiles, and the compile time when done. ``compile_s`` sums the
seconds of this start's compiles after the first (``metrics.eta_s`` spreads them over the
steps left).
"""

from __future__ import annotations

from moe_train.base.waiting import EVERY_S, POLL_S, Log, Waiting, waiting

__all__ = ["EVERY_S", "POLL_S", "Log", "Waiting", "WatchedStep", "waiting"]


class WatchedStep:
    """``BucketedStep`` plus a line for each compile (module docstring); other attributes
    pass through."""

    def __init__(self, step_fn, log: Log, first: int):
        self.step_fn, self.log = step_fn, log
        self.step = first  # the step the last submit dispatched
        self.compiles = 0  # compiles seen by this start
        self.compile_s = 0.0  # seconds of those after the first

    def __getattr__(self, name):
        return getattr(self.step_fn, name)

    def submit(self, state, batch):
        self.step += 1
        return self._watch(self.step_fn.submit, self.step, state, batch)

    def drain(self, state):
        return self._watch(self.step_fn.drain, self.step, state, confirming=self.step)

    def _watch(self, call, n: int, *args, confirming: int | None = None):
        """``call(*args)``; ``n``: the step it dispatches, ``confirming``: the step it confirms
        (default ``n - 1``, the one dispatched before)."""
        f, counter = self.step_fn, self.step_fn.counter
        before = (counter.traces, f.reruns, f.label())
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
            self.compiles += 1
            if self.compiles > 1:
                self.compile_s += took
            if watch.announced_at is None:  # traced and compiled within one poll
                self.log(f"compiling the train step for {self._why(before, n, confirming)}")
            new, label = counter.traces - before[0], f.label()
            times = "" if new == 1 else f" {new} times (each bucket it overflowed reran on the next)"
            now = "" if label is None else f"; capacity bucket now {label}"
            self.log(
                f"compiled the train step{times} in {took:.1f} s ({counter.traces} "
                f"compile(s) in this process so far{now})"
            )
        return out

    def _why(self, before: tuple, n: int, confirming: int) -> str:
        traces, reruns, label = before
        f = self.step_fn
        if traces == 0:
            return f"step {n}, the first step (XLA compiles it once; later steps reuse it)"
        if f.reruns != reruns:
            return (
                f"a rerun of step {confirming}: it overflowed its expert-parallel "
                f"receive buffers (capacity bucket {label}), so it reruns, dropless, on "
                f"the next bucket, {f.label()} (each bucket compiles once)"
            )
        return f"step {n} on capacity bucket {f.label()}, used for the first time (each bucket compiles once)"
