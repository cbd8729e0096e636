"""Multi-process setup: decide single / explicit / Slurm, start JAX's distributed runtime, and
make sure a failed or stuck peer ends every process within a bounded time.

How a run becomes multi-process (``plan``):

* ``parallel.coordinator`` set ("explicit"): every process is started by hand with the same
  ``host:port`` of process 0 and its own ``parallel.process_id`` in ``0..num_processes-1``.
  Inside a Slurm step, ``num_processes`` / ``process_id`` left unset are taken from Slurm;
  values that are set always win over Slurm's.
* no coordinator, inside a Slurm step (``srun``) with more than one task ("slurm"): JAX finds
  the coordinator (first host of the step, port from the job id) and one device per task.
* otherwise one process; nothing is initialised.

Failures, all bounded (measured with jax 0.10.2 on CPU with gloo, 2 processes on a loaded
2-core machine, ``parallel.heartbeat_timeout_s=5``; tests/test_multiprocess.py). Every one
ends each surviving process with ``EXIT_DISTRIBUTED`` (4) and one line on stderr naming the
peer, the coordinator or the collective; no traceback, no SIGABRT (``moe_train.train.supervise``
turns the JAX runtime's own aborts into that line):

* the coordinator unreachable or a process missing at start: after ``parallel.init_timeout_s``
  every waiting process prints one line and exits;
* a process is killed (at any moment, also during an async checkpoint commit): a collective
  in flight with it fails at once (gloo "Connection reset by peer", ``peer_failure``); else
  the coordination service stops the job: within ~1 s when process 0 (which hosts it) died
  (measured 0.2-0.3 s), within ``heartbeat_timeout_s`` + ~1 s when another one died
  (measured 4.9-5.4 s with 5 s); the JAX runtime aborts the survivors, the supervisor turns
  that into the one line;
* a process freezes (SIGSTOP, a dead node): its heartbeats stop, so the same happens after
  ``heartbeat_timeout_s`` + ~1 s (process 0 frozen: measured 6.0 s with 5 s);
* a process hangs while alive (its heartbeats go on, the others wait in a collective forever):
  the step watchdog (``start_watchdog`` / ``beat``) exits when no step finished for
  ``watchdog_timeout_s(p)`` = 2 x ``heartbeat_timeout_s`` seconds
  (``together.startup_s(p)`` before the first step), not counting the time a process compiles
  and waits for its peers to compile (``together.compiled_together``: a barrier that fails
  when a peer died, or after ``startup_s(p)`` more than the process's own compile took);
* the processes finish compiling at different times: each compiled program first runs once
  every process compiled it (the same barrier), so no collective's set-up waits for a peer
  still compiling (on the CPU, Gloo gives up after 30 s).

So a peer failure ends the others within ``2 x heartbeat_timeout_s`` (plus process exit)
once training runs, and within ``init_timeout_s + 2 x heartbeat_timeout_s`` before it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping

from moe_train.base.exits import EXIT_DISTRIBUTED  # could not connect, or a peer failed
from moe_train.base.threads import start_daemon
from moe_train.base.waiting import Waiting
from moe_train.config import ConfigError, ParallelConfig
from moe_train.parallel import together

SOURCES = ("single", "explicit", "slurm")


class DistributedError(Exception):
    """A multi-process start-up failure: printed as one line, exit code ``EXIT_DISTRIBUTED``."""


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    process_index: int = 0
    process_count: int = 1
    coordinator: str = ""  # host:port; "" when single-process or left to JAX's Slurm detection
    source: str = "single"  # single | explicit | slurm

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    @property
    def multi(self) -> bool:
        return self.process_count > 1


# --------------------------------------------------------------------------- the decision


def _slurm_tasks(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(task count, this task's rank) inside a Slurm job step, else None.

    A batch script outside ``srun`` has SLURM_NTASKS but is a single process: it has no
    SLURM_STEP_NODELIST, which JAX's Slurm detection needs too, so it counts as no step.
    """
    if not env.get("SLURM_JOB_ID") or "SLURM_STEP_NODELIST" not in env:
        return None
    count = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    rank = env.get("SLURM_PROCID")
    if count is None or rank is None:
        return None
    try:
        return int(count), int(rank)
    except (TypeError, ValueError):
        return None


def _check_coordinator(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"parallel.coordinator={address!r} is not host:port "
            f"(e.g. 10.0.0.1:1234, the address of process 0)"
        )


def plan(p: ParallelConfig, env: Mapping[str, str]) -> tuple[str, dict]:
    """Decide how this process starts, from the config and the environment; no side effects.

    Returns ``(source, kwargs)``: source in ``SOURCES``; kwargs for
    ``jax.distributed.initialize`` (empty for "single"). Raises ConfigError naming the keys.
    """
    for key in ("init_timeout_s", "heartbeat_timeout_s"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}={getattr(p, key)} must be at least 1 (seconds)")
    slurm = _slurm_tasks(env)
    timeouts = dict(
        heartbeat_timeout_seconds=p.heartbeat_timeout_s,
        shutdown_timeout_seconds=watchdog_timeout_s(p),
        # our own guard (``initialize``) gives up at init_timeout_s with a clear
        # line; JAX's deadline only has to be later (it aborts the process).
        initialization_timeout=p.init_timeout_s + 10,
    )
    if p.coordinator:
        _check_coordinator(p.coordinator)
        n, pid = p.num_processes, p.process_id
        if slurm is not None:  # fill what is unset from Slurm; what is set wins
            n = n if n > 0 else slurm[0]
            pid = pid if pid >= 0 else slurm[1]
        missing = [
            k for k, v in (("parallel.num_processes", n > 0), ("parallel.process_id", pid >= 0)) if not v
        ]
        if missing:
            raise ConfigError(
                f"parallel.coordinator={p.coordinator} needs {' and '.join(missing)} "
                f"(processes in the job, and this process's rank 0..N-1)"
            )
        if not 0 <= pid < n:
            raise ConfigError(f"parallel.process_id={pid} is not in 0..{n - 1} (parallel.num_processes={n})")
        return "explicit", dict(
            coordinator_address=p.coordinator,
            num_processes=n,
            process_id=pid,
            cluster_detection_method="deactivate",
            **timeouts,
        )
    if slurm is not None and (slurm[0] > 1 or p.num_processes > 1):
        n = p.num_processes if p.num_processes > 0 else slurm[0]
        pid = p.process_id if p.process_id >= 0 else slurm[1]
        if not 0 <= pid < n:
            raise ConfigError(
                f"parallel.process_id={pid} is not in 0..{n - 1} "
                f"(parallel.num_processes={n}, from Slurm where unset)"
            )
        # coordinator and local device ids: JAX's Slurm detection
        return "slurm", dict(num_processes=n, process_id=pid, cluster_detection_method="slurm", **timeouts)
    if p.num_processes > 1 or p.process_id > 0:
        raise ConfigError(
            f"parallel.num_processes={p.num_processes} / parallel.process_id="
            f"{p.process_id} need parallel.coordinator (host:port of process 0) "
            f"outside a Slurm step"
        )
    return "single", {}


def watchdog_timeout_s(p: ParallelConfig) -> int:
    """Seconds without a finished step before a multi-process run gives up on its peers.

    Twice the heartbeat timeout, so a peer that died is reported by JAX's own (clearer)
    message first; the watchdog catches peers that hang while alive.
    """
    return 2 * p.heartbeat_timeout_s


# --------------------------------------------------------------------------- start and stop

_info = ProcessInfo()
_initialized = False


def _say(line: str) -> None:
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def exit_now(code: int) -> None:
    """End the process now, without cleanup (a peer may hold us in a collective); tests replace it."""
    os._exit(code)


def initialize(p: ParallelConfig, env: Mapping[str, str] | None = None) -> ProcessInfo:
    """Start JAX's distributed runtime when the run is multi-process; call before any JAX
    computation (or ``jax.devices()``). Idempotent per process.

    Raises ConfigError (bad/missing keys) or DistributedError (could not start the
    coordinator). When the processes do not come together within ``p.init_timeout_s``, prints
    one line on stderr and ends the process with ``EXIT_DISTRIBUTED`` (JAX itself would abort
    with a stack trace later).
    """
    global _info, _initialized
    if _initialized:
        return _info
    source, kwargs = plan(p, os.environ if env is None else env)
    if source == "single":
        _info, _initialized = ProcessInfo(), True
        return _info
    import jax

    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        # cross-process collectives on the CPU platform; ignored by GPU/TPU backends
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    n, pid = kwargs["num_processes"], kwargs["process_id"]
    where = kwargs.get("coordinator_address") or "the Slurm step's first host"
    guard = threading.Timer(p.init_timeout_s, _init_timed_out, args=(where, pid, n, p.init_timeout_s))
    guard.daemon = True
    guard.start()
    say = lambda line: print(line, flush=True)
    try:  # a line after 10 s, and every 10 s, while the job's processes come together
        with Waiting(say, f"process {pid} of {n}: waiting for the job's processes at {where}", after_s=10):
            jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as err:  # JaxRuntimeError is a RuntimeError
        detail = " ".join(str(err).split())
        raise DistributedError(
            f"process {pid} of {n}: could not start the JAX distributed "
            f"runtime with coordinator {where}: {detail}"
        ) from None
    finally:
        guard.cancel()
    coordinator = kwargs.get("coordinator_address") or _detected_coordinator()
    _info = ProcessInfo(process_index=pid, process_count=n, coordinator=coordinator, source=source)
    _initialized = True
    return _info


def _detected_coordinator() -> str:
    try:  # what JAX's Slurm detection chose (not public API: best effort, for messages only)
        from jax._src import distributed as jax_distributed

        return jax_distributed.global_state.coordinator_address or ""
    except (ImportError, AttributeError):
        return ""


def _init_timed_out(where: str, pid: int, n: int, timeout: int) -> None:
    role = "waiting for the other processes to connect" if pid == 0 else "is process 0 running and reachable?"
    _say(
        f"error: process {pid} of {n}: no connection to the JAX coordinator {where} with all "
        f"{n} processes within parallel.init_timeout_s={timeout} s ({role})"
    )
    exit_now(EXIT_DISTRIBUTED)


_PEER_FAILURE_MARKS = (
    "gloo",
    "nccl",
    "connection reset",
    "connection closed",
    "socket closed",
    "broken pipe",
    "coordination service",
    "heartbeat",
    "barrier failed",
)
# JAX raises collective failures as JaxRuntimeError (a RuntimeError), or, where it converts a
# result to numpy (e.g. ``multihost_utils.process_allgather``), as a ValueError; orbax wraps
# a failed barrier in a TimeoutError whose cause says why.
_PEER_FAILURE_TYPES = (RuntimeError, ValueError, TimeoutError, OSError)


def peer_failure(err: BaseException | None) -> str | None:
    """One line describing ``err`` when it (or an exception it came from) is a collective or
    runtime failure caused by another process going away (e.g. gloo's "Connection reset by
    peer"), else None."""
    seen = 0
    while err is not None and seen < 8:
        text = " ".join(str(err).split())
        if isinstance(err, _PEER_FAILURE_TYPES) and any(m in text.lower() for m in _PEER_FAILURE_MARKS):
            return (
                f"a collective with the other processes failed, most likely a peer died "
                f"(see its log): {text[:300]}"
            )
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def info() -> ProcessInfo:
    """This process's place in the job (single-process until ``initialize`` says otherwise)."""
    return _info


def shutdown() -> None:
    """Stop the watchdog, then leave JAX's distributed runtime (waits for the other processes
    up to ``watchdog_timeout_s``). No-op when single-process."""
    global _info, _initialized
    stop_watchdog()
    if _info.source != "single":
        import jax

        jax.distributed.shutdown()
    _info, _initialized = ProcessInfo(), False


# --------------------------------------------------------------------------- step watchdog


class Watchdog:
    """Ends the process when training stops making progress.

    ``beat(step)`` after every finished step. Before the first beat the deadline is
    ``startup_timeout_s`` after ``start`` (None: unarmed until the first beat); after it,
    ``timeout_s`` after the latest beat. Time spent compiling and waiting for the peers to
    compile (``together.compiled_together``) does not count: while it lasts there is no
    deadline, and after it the deadline is at least ``timeout_s`` away. On expiry: one line on
    stderr naming the last step, then ``os._exit(exit_code)`` (no cleanup: peers may be
    blocked in a collective for ever).
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        startup_timeout_s: float | None = None,
        label: str = "",
        exit_code: int = EXIT_DISTRIBUTED,
        clock: Callable[[], float] = time.monotonic,
        on_expire: Callable[[str], None] | None = None,
        poll_s: float = 1.0,
        quiet_until: Callable[[], float] = together.quiet_until,
    ):
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout_s={timeout_s} must be positive")
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.label, self.exit_code, self._clock, self._poll = label, exit_code, clock, poll_s
        self._on_expire = on_expire or self._default_expire
        self._quiet_until = quiet_until  # a clock() time; +inf while this process compiles
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._started = clock()
        self._last: float | None = None
        self.last_step: int | None = None
        self.fired = False
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        self._thread = start_daemon(self._run, "moe-train-watchdog")
        return self

    def beat(self, step: int | None = None) -> None:
        with self._lock:
            self._last = self._clock()
            if step is not None:
                self.last_step = int(step)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def deadline(self) -> float | None:
        quiet = self._quiet_until()
        with self._lock:
            if quiet == float("inf"):  # compiling, or waiting for the peers to compile
                return None
            if self._last is not None:
                return max(self._last, quiet) + self.timeout_s
            if self.startup_timeout_s is not None:
                return max(self._started + self.startup_timeout_s, quiet + self.timeout_s)
            return None

    def check(self) -> bool:
        """Fire if the deadline passed (the thread calls this every ``poll_s``)."""
        deadline = self.deadline()
        if self.fired or self._stopped.is_set() or deadline is None or self._clock() < deadline:
            return False
        self.fired = True
        self._on_expire(self.message())
        return True

    def message(self) -> str:
        who = f"{self.label}: " if self.label else ""
        if self._last is None:
            return (
                f"error: {who}no training step finished within {self.startup_timeout_s:g} s of "
                f"start-up; a peer process is stuck or died (limit: parallel.init_timeout_s "
                f"+ 2 x parallel.heartbeat_timeout_s); exiting"
            )
        after = f"step {self.last_step}" if self.last_step is not None else "the last progress"
        return (
            f"error: {who}no progress for {self.timeout_s:g} s after {after}; a peer process "
            f"is stuck or died (limit: 2 x parallel.heartbeat_timeout_s); exiting"
        )

    def _default_expire(self, message: str) -> None:
        _say(message)
        exit_now(self.exit_code)

    def _run(self) -> None:
        while not self._stopped.wait(self._poll):
            if self.check():
                return


_watchdog: Watchdog | None = None


def start_watchdog(timeout_s: float, *, startup_timeout_s: float | None = None, label: str = "") -> Watchdog:
    """Start the process-wide step watchdog (replacing a previous one) and return it."""
    global _watchdog
    stop_watchdog()
    _watchdog = Watchdog(timeout_s, startup_timeout_s=startup_timeout_s, label=label).start()
    return _watchdog


def beat(step: int | None = None) -> None:
    """Tell the watchdog a step finished (no-op when none is running: single-process)."""
    if _watchdog is not None:
        _watchdog.beat(step)


def stop_watchdog() -> None:
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
