"""The background sampler: one thread per training process, one JSON line per sample.

Lines of ``<out>/telemetry/rank<N>.jsonl`` (``kind`` says which; ``time`` is Unix seconds):

* ``start``: rank, process count, pid, host, interval, ``nvml`` ("ok" or why not, e.g.
  ``"unavailable: NVML Shared Library Not Found"``), the GPU's index/name/UUID, and the
  trainer's context (JAX platform, device kind).
* ``unsupported``: one per field NVML cannot give (``field``, ``error``), written once.
* ``sample``: ``step`` (the training step running, null before the first), the GPU fields of
  ``telemetry.nvml`` and the host fields of ``telemetry.host``, ``sample_ms`` (what taking
  the sample cost), and ``steps``: ``[[step, start time], ...]`` for the steps that began
  since the previous sample (``[null, time]`` marks the end of the last one).
* ``error``: sampling stopped after an unexpected error (logged once; training goes on).
* ``stop``: samples taken, mean and max ``sample_ms``.

A resumed run appends a new ``start`` line to the same file. The file is flushed after every
line, so a crash loses at most the line being written.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_train.base.threads import start_daemon
from moe_train.telemetry import nvml as nvml_probe
from moe_train.telemetry.host import HostProbe


@dataclass(frozen=True)
class Target:
    """What one process's sampler watches and where it writes."""

    path: Path  # <out>/telemetry/rank<N>.jsonl
    interval_s: float  # seconds between samples (> 0)
    rank: int  # this process's index in the job (jax.process_index())
    process_count: int  # processes in the job: the number of telemetry files to expect
    gpu_index: int | None = None  # NVML index of this process's GPU; None: it has none
    no_gpu_reason: str = ""  # why gpu_index is None (e.g. "JAX platform is cpu")
    context: Mapping[str, Any] = field(default_factory=dict)  # extra keys for the start line


class Sampler:
    """Samples in a daemon thread from ``start()`` to ``stop()``; never raises into training."""

    def __init__(
        self, target: Target, *, log: Callable[[str], None] = print, nvml: Any = None, hold: bool = False
    ):
        self.target = target
        # hold: keep lines in memory until ``release()`` (the trainer releases once its first
        # step ran: a start that fails its checks leaves the run directory as it was)
        self._held: list[dict[str, Any]] = []
        self._released = threading.Event()
        if not hold:
            self._released.set()
        self._log = log
        self._nvml = nvml  # a pynvml-like module (tests); None imports pynvml
        self._step: int | None = None
        self._marks: collections.deque = collections.deque()  # (step, time) from set_step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file = None
        self.sample_s: list[float] = []  # seconds each sample took
        self.error: str | None = None  # why sampling stopped early, if it did

    def start(self) -> Sampler:
        """Start the thread (returns at once; NVML is initialised in the thread)."""
        self._thread = start_daemon(self._run, "moe-train-telemetry")
        return self

    def set_step(self, step: int | None) -> None:
        """The training step now running (None: training is over). Cheap: one deque append."""
        self._step = step
        self._marks.append((step, time.time()))

    def release(self) -> None:
        """Write what was held, and from now on every line (see ``hold``)."""
        self._released.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Take a last sample, write the stop line and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        gpu, host = None, None
        try:
            opened = nvml_probe.open_gpu(self.target.gpu_index, self.target.no_gpu_reason, self._nvml)
            gpu, host = opened.gpu, HostProbe()
            self._write(self._start_line(opened))
            while True:
                tick = time.monotonic()
                self._sample(gpu, host)
                wait = self.target.interval_s - (time.monotonic() - tick)
                if self._stop.wait(max(wait, 0.0)):
                    break
            self._sample(gpu, host)
            self._write(self._stop_line())
        except Exception as err:  # telemetry never fails the run
            self._fail(err)
        finally:
            if gpu is not None:
                gpu.close()
            if self._file is not None:
                self._file.close()

    def _start_line(self, opened: nvml_probe.Opened) -> dict[str, Any]:
        t = self.target
        line = {
            "kind": "start",
            "time": time.time(),
            "rank": t.rank,
            "process_count": t.process_count,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "interval_s": t.interval_s,
            "nvml": opened.status,
            **dict(t.context),
        }
        if opened.gpu is not None:
            line.update(opened.gpu.describe())
        return line

    def _sample(self, gpu: nvml_probe.NvmlGpu | None, host: HostProbe) -> None:
        t0 = time.perf_counter()
        now = time.time()
        rec: dict[str, Any] = {"kind": "sample", "time": now, "step": self._step}
        if gpu is not None:
            values, unsupported = gpu.read(now)
            for name, error in unsupported.items():
                self._write({"kind": "unsupported", "time": now, "field": name, "error": error})
            rec.update(values)
        rec.update(host.read())
        marks = []
        while self._marks:
            marks.append(list(self._marks.popleft()))
        if marks:
            rec["steps"] = marks
        elapsed = time.perf_counter() - t0
        rec["sample_ms"] = elapsed * 1e3
        self.sample_s.append(elapsed)
        self._write(rec)

    def _stop_line(self) -> dict[str, Any]:
        ms = [s * 1e3 for s in self.sample_s]
        return {
            "kind": "stop",
            "time": time.time(),
            "samples": len(ms),
            "sample_ms_mean": sum(ms) / len(ms) if ms else None,
            "sample_ms_max": max(ms) if ms else None,
        }

    def _write(self, rec: dict[str, Any]) -> None:
        if not self._released.is_set():
            self._held.append(rec)
            return
        if self._file is None:
            self.target.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.target.path.open("a")
        for held in self._held + [rec]:
            self._file.write(json.dumps(held) + "\n")
        self._held = []
        self._file.flush()

    def _fail(self, err: BaseException) -> None:
        self.error = f"{type(err).__name__}: {err}"
        self._log(f"telemetry: sampling stopped after an error ({self.error}); training goes on")
        try:
            self._write({"kind": "error", "time": time.time(), "error": self.error})
        except Exception:
            pass


class NullSampler:
    """Stands in for a Sampler when telemetry is off or could not start."""

    error: str | None = None

    def release(self) -> None:
        """Nothing held."""

    def set_step(self, step: int | None) -> None:
        """Nothing to tell."""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Nothing to stop."""
