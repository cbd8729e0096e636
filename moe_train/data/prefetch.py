"""A small bounded prefetch thread for deterministic batch functions.

A source whose ``batch(step)`` is a pure function of the step can compute the next steps'
batches before they are asked for: ``Prefetcher.get(step, ...)`` returns that step's batch
(computed ahead if it was) and queues the ``depth`` steps after it on one background thread.
Results never depend on timing: a batch asked for out of order (a resumed run, a test
jumping around) is computed on the spot, and what was queued for other steps is dropped.

Why a thread and not Grain (``grain`` on PyPI): a prepared corpus is memory-mapped and a
batch is a few slice copies per row (``moe_train.data.packed``), so the time it can stall
the loop is page-cache misses on the shard files and the once-per-epoch shuffle, not Python
work that needs several worker processes. Each process builds only its own rows, so one
thread a few steps ahead covers it; Grain's samplers, worker processes and checkpointable
iterators would duplicate what ``batch(step)`` already gives (determinism, resumption from
the step number, per-process rows) and add a dependency. numpy releases the GIL while it
copies, so the thread overlaps with the loop's own Python work; the device is kept busy by
JAX's asynchronous dispatch in any case.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

DEPTH = 2  # steps computed ahead: the next step's batch plus one for a slow read


class Prefetcher:
    """``get(step, *key)`` = ``fn(step, *key)``, with steps ``step+1..step+depth`` of the same
    ``key`` (e.g. process index and count) computed ahead on one thread."""

    def __init__(self, fn: Callable[..., Any], depth: int = DEPTH):
        self.fn, self.depth = fn, depth
        self._lock = threading.Lock()
        self._ahead: dict[tuple, Future] = {}  # (step, *key) -> its batch, queued or done
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def get(self, step: int, *key) -> Any:
        """``fn(step, *key)``: taken from the queue when it was computed ahead."""
        with self._lock:
            future = self._ahead.pop((step, *key), None)
            self._queue_after(step, key)
        if future is None:
            return self.fn(step, *key)
        return future.result()  # an exception raised by fn is raised here

    def _queue_after(self, step: int, key: tuple) -> None:
        """Queue ``step+1..step+depth`` of ``key``; drop what is queued for other steps."""
        wanted = {(s, *key) for s in range(step + 1, step + 1 + self.depth)}
        for k in [k for k in self._ahead if k not in wanted]:
            self._ahead.pop(k).cancel()
        if self._closed or not self.depth:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="moe_train-prefetch")
        for k in sorted(wanted - set(self._ahead)):
            self._ahead[k] = self._pool.submit(self.fn, *k)

    def pending(self) -> int:
        """Batches queued or computed ahead (at most ``depth``)."""
        with self._lock:
            return len(self._ahead)

    def close(self) -> None:
        """Stop the thread; later ``get`` calls compute on the spot."""
        with self._lock:
            self._closed = True
            for future in self._ahead.values():
                future.cancel()
            self._ahead.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
