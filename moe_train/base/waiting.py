"""A heartbeat around a blocking call: no wait of the kit is silent for more than 10 s.

``Waiting`` is a thread beside one blocking call: once the call has taken ``after_s`` (or once
``started()`` holds) it prints what it is waiting for, then ``still <what>: N s`` every
``every_s`` seconds, and when the call returns ``<what>: done in N s`` (only if it printed
anything: quick calls stay silent). ``moe_train.train.progress`` builds the trainer's compile
lines on it; evaluation, the compile tool, gpu-check and the benchmarks use it directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Log = Callable[[str], None]
EVERY_S = 10.0  # heartbeat interval: no silence longer than this
POLL_S = 0.1


class Waiting:
    """``with Waiting(log, "saving checkpoint 5"):`` see the module docstring. ``started``
    (optional): a predicate; the first line is printed as soon as it holds (instead of
    after ``after_s``), with the text ``describe()`` returns then."""

    def __init__(
        self,
        log: Log,
        what: str,
        after_s: float = 1.0,
        every_s: float = EVERY_S,
        started: Callable[[], bool] | None = None,
        describe: Callable[[], str] | None = None,
        done: bool = True,
    ):
        self.log, self.what, self.after_s, self.every_s = log, what, after_s, every_s
        self.started, self.describe, self.done = started, describe, done
        self.announced_at: float | None = None  # when the first line was printed
        self.seconds = 0.0  # the call's duration, once it returned
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="moe_train-progress", daemon=True)

    def __enter__(self) -> Waiting:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self.t0
        if self.announced_at is not None and self.done and exc[0] is None:
            self.log(f"{self.what}: done in {self.seconds:.1f} s")

    def _due(self) -> bool:
        if self.started is not None:
            return self.started()
        return time.perf_counter() - self.t0 >= self.after_s

    def _beat(self) -> None:
        while not self._stop.wait(POLL_S):
            if self._due():
                break
        else:
            return
        self.announced_at = time.perf_counter()
        self.log(f"{self.what if self.describe is None else self.describe()} ...")
        while not self._stop.wait(self.every_s):
            self.log(f"  still {self.what}: {time.perf_counter() - self.t0:.0f} s")


def waiting(log: Log, what: str, after_s: float = 1.0, done: bool = True) -> Waiting:
    """``Waiting`` for a plain wait (evaluation, a checkpoint save, the self-test)."""
    return Waiting(log, what, after_s=after_s, done=done)
