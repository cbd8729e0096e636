"""The first run of a jitted function in a multi-process job: compile, then wait for every process.

JAX compiles a jitted function on its first call and runs it at once. The processes of a job
finish compiling at different times (other hosts, other loads), and the first run of each
collective sets up its communicator, which waits for the peers only so long: on the CPU a
Gloo context waits 30 s (jax 0.10.2, not configurable), so a process that compiled 30 s
longer than another failed the whole job ("Gloo context initialization failed ...
GetKeyValue() timed out": seen in CI with two processes on two loaded cores).

``compiled_together(fn, args, ...)`` compiles ``fn`` for ``args`` ahead of the call (the call
then reuses that executable: no second trace or compile), then waits at a barrier of JAX's
coordination service, which is no device collective, so every process starts the program's
collectives within moments of the others. Single-process runs skip both.

A process compiling or waiting here makes no step progress by design; ``quiet_until()`` tells
the step watchdog (``moe_train.train.distributed``) to count its timeout from when the last
such wait ended, so a long compile (a new capacity bucket in the middle of a run) is not
taken for a hung peer. A peer that died makes the barrier fail within the coordination
service's heartbeat timeout; one that hangs alive, after the barrier's timeout.

May import: ``moe_train.config`` (and ``moe_train.base``). JAX's coordination client is
reached through ``jax._src`` (``jax.distributed`` has no public barrier; orbax reaches it the
same way); JAX is imported where used, as in ``moe_train.train.distributed``.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import Any

from moe_train.config import ParallelConfig

_lock = threading.Lock()
_busy = 0  # compiles-and-waits in progress in this process
_quiet_until = float("-inf")  # time.monotonic() when the last one ended
_ids = itertools.count()  # barrier ids must be unique within a job; every process counts alike
_done: weakref.WeakSet = weakref.WeakSet()  # functions compiled together already


def startup_s(p: ParallelConfig) -> int:
    """Seconds a start-up may take: connecting (``init_timeout_s``) and two heartbeat timeouts.
    Also how much longer than this process a peer may take to compile the same program."""
    return p.init_timeout_s + 2 * p.heartbeat_timeout_s


def quiet_until() -> float:
    """``time.monotonic()`` until which the step watchdog must not count: +inf while this
    process compiles or waits in ``compiled_together``, else when the last one ended."""
    with _lock:
        return float("inf") if _busy else _quiet_until


def barrier(name: str, timeout_s: float) -> None:
    """Wait until every process of the job reaches the barrier ``name`` (a no-op in a
    single-process run). Raises RuntimeError("barrier failed: ...") when a peer died or did
    not arrive within ``timeout_s``."""
    import jax
    from jax._src import distributed

    if jax.process_count() == 1:
        return

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(f"barrier failed: {name}: jax.distributed is not initialized")
    barrier_id = f"moe_train/{next(_ids)}/{name}"
    try:
        client.wait_at_barrier(barrier_id, max(1, int(timeout_s * 1000)))
    except Exception as err:  # JAX's runtime error: a timeout or a peer's failure
        raise RuntimeError(f"barrier failed: {name} (waited up to {timeout_s:.0f} s): {err}") from err


def compiled_together(fn: Any, args: tuple, name: str, p: ParallelConfig) -> None:
    """Before the first call of ``fn`` (a jitted function, or anything with ``lower``):
    compile it for ``args``, then wait until every process has compiled it, up to
    ``startup_s(p)`` seconds plus as long as this process's own compile took. A no-op after
    the first call and in a single-process run (there the call compiles)."""
    global _busy, _quiet_until
    import jax

    if jax.process_count() == 1 or fn in _done:
        return
    with _lock:
        _busy += 1
    try:
        t0 = time.monotonic()
        fn.lower(*args).compile()
        barrier(name, startup_s(p) + (time.monotonic() - t0))
        _done.add(fn)
    finally:
        with _lock:
            _busy -= 1
            _quiet_until = time.monotonic()
