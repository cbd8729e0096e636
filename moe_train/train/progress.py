"""A line for every wait of the trainer: compiles, the self-test, evaluations, saves.

``Waiting`` (``moe_train.base.waiting``, re-exported here) is a heartbeat thread around one
blocking call: once the call has taken ``after_s`` (or, for a compile, once the train step
starts tracing) it prints what it is waiting for, then ``still <what>: N s`` every
``every_s`` seconds, and when the call returns ``<what>: done in N s`` (only if it printed
anything: quick calls stay silent).

``stepper.BucketedStep`` builds the train step's compile lines on it: each ``submit``/``drain``
that traces the train step (a compile) prints what is compiled and why (the first step; a
capacity bucket used for the first time; a step that overflowed its bucket and reruns on the
next one), heartbeats while XLA compiles, and the compile time when done.
"""

from __future__ import annotations

from moe_train.base.waiting import EVERY_S, POLL_S, Log, Waiting, waiting

__all__ = ["EVERY_S", "POLL_S", "Log", "Waiting", "waiting"]
