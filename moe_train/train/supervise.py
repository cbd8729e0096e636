"""A thin supervisor for multi-process runs: every way a peer failure ends this process becomes
exit code 4 (``exits.EXIT_DISTRIBUTED``) and one line on stderr.

Why a supervisor process. With jax 0.10.2 a failed peer reaches a surviving process in one of
three ways (measured on CPU with gloo, 2 processes, ``parallel.heartbeat_timeout_s=5``):

* a collective in flight with the dead peer raises in Python (gloo: "Connection reset by
  peer", as a JaxRuntimeError or a ValueError): the CLI catches it (``distributed.peer_failure``);
* the coordination service notices the missing heartbeats (process 1 killed: after ~5 s) or
  the service itself is gone (process 0 killed: after ~0.3 s), and the coordination client's
  error callback ends the process with ``LOG(FATAL)`` in a C++ thread: "Terminating process
  because the JAX distributed service detected fatal errors", a C++ stack dump and SIGABRT
  (exit 134). Python cannot catch that;
* orbax's async checkpoint commit fails its barrier in a background thread and prints a
  traceback just before the abort above.

Alternatives looked at: the C++ client takes a ``missed_heartbeat_callback`` (it is what
aborts), but ``jax.distributed.initialize`` does not expose it; passing one means building
the client and service by hand in JAX's private ``global_state``, and it still would not
cover other aborts (CHECK failures in gloo/NCCL, orbax threads). ``jax_enable_recoverability``
only stops the service from propagating a task's failure, so survivors would wait in
collectives instead of ending. Neither is robust; a parent process is.

How it works. In multi-process mode (``distributed.plan`` is not "single") the CLI runs
``python -m moe_train`` with the same arguments as a child (``MARKER`` set in its environment)
and only supervises it: SIGTERM/SIGUSR2/SIGINT are forwarded (blocked in the child until its
stop flag is installed, so an early signal is never fatal), the child is killed when the
supervisor dies (``PR_SET_PDEATHSIG`` on Linux, and the child polls its parent). A terminal's
Ctrl-C, or Slurm signalling every process of the step, reaches the child twice (directly and
forwarded), so the child takes every SIGINT as one stop request; the supervisor counts them
(``signals.StopFlag``): at the second it kills the child and exits 130 with one line.
Its stdout passes through line by line. Its stderr passes through too, except runtime noise:
C++ log records (``E0101 12:00:00.000 123 file.cc:1] ...`` and their continuation lines),
Python logging and thread tracebacks ("ERROR:absl:", "Exception in thread", an unprefixed
"Traceback") and fatal dumps. Those are held back ``HOLD_S`` seconds; if the child is still
fine by then they are passed through (late), if it fails they go to
``OUT/logs/process-<I>.stderr.log`` instead.

How the child ends: 0/1/2/3/5/130 pass through unchanged (1 is a bug: its traceback was shown),
unless a fatal C++ record was seen; 4 (the child already printed its one line) passes through;
a fatal C++ record or a death by any signal becomes 4 and one line naming the peer or the
coordinator. Single-process runs do not start a supervisor.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from moe_train.base import exits
from moe_train.base.threads import start_daemon
from moe_train.train import signals

MARKER = "MOE_TRAIN_SUPERVISED"  # set in the child's environment: "run the trainer here"
HOLD_S = 5.0  # runtime noise waits this long on stderr before it is shown (or filed away)
FORWARDED = signals.STOP_SIGNALS  # SIGTERM, SIGUSR2, SIGINT
_GLOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] ")
_FATAL_STARTS = (
    "*** Check failure stack trace",
    "Fatal Python error",
    "*** SIG",
    "*** Begin stack trace",
    "terminate called",
)
_NOISE_STARTS = ("ERROR:absl:", "WARNING:absl:", "Exception in thread", "Traceback (most recent")
_OURS = ("error:", "[process ")  # lines of the trainer itself: never held


@dataclasses.dataclass(frozen=True)
class Job:
    """What the supervisor needs to know to name things in its one line."""

    process_id: int
    num_processes: int
    coordinator: str  # host:port, "" when JAX's Slurm detection picks it
    heartbeat_timeout_s: int
    out_dir: Path

    @property
    def label(self) -> str:
        return f"process {self.process_id} of {self.num_processes}"

    @property
    def log_path(self) -> Path:
        return self.out_dir / "logs" / f"process-{self.process_id}.stderr.log"


def is_child() -> bool:
    return os.environ.get(MARKER) == "1"


# --------------------------------------------------------------------------- the child side


def child_ready() -> None:
    """In the child, once ``signals.STOP`` is installed: take the stop signals the supervisor
    forwarded meanwhile (they were blocked at exec), and end when the supervisor is gone."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(exits.EXIT_DISTRIBUTED)  # orphaned: the supervisor was killed

    start_daemon(watch, "moe-train-parent-watch")


def _in_child(parent: int) -> None:
    """preexec_fn: block the stop signals until the trainer's flag is installed; die with
    the supervisor (Linux)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(exits.EXIT_DISTRIBUTED)


# --------------------------------------------------------------------------- stderr filter


class StderrFilter:
    """Passes the child's stderr through, holding runtime noise back (see the module doc)."""

    def __init__(self, write=None, clock=time.monotonic, hold_s: float = HOLD_S):
        self._write = write or _write_stderr
        self._clock, self._hold = clock, hold_s
        self._lock = threading.Lock()
        self._queue: list[tuple[float, str, bool]] = []  # (arrival, line, noise)
        self._noisy = False  # inside a C++ record / traceback block
        self.fatal: list[str] = []  # the fatal C++ record and its continuation lines
        self.fatal_seen = self._collecting = False
        self.said_error = False  # an "error:" line of the child's has been shown

    def feed(self, line: str) -> None:
        with self._lock:
            self._queue.append((self._clock(), line, self._classify(line)))
            self._release()

    def _classify(self, line: str) -> bool:
        record = _GLOG.match(line)
        if self.fatal_seen:  # keep the fatal record's continuation lines, up to the next block
            self._collecting = self._collecting and not (
                record or line.startswith(_FATAL_STARTS + _NOISE_STARTS) or len(self.fatal) > 40
            )
            if self._collecting:
                self.fatal.append(line)
            return True
        if record and record.group(1) == "F" or line.startswith(_FATAL_STARTS):
            self.fatal_seen, self._collecting, self.fatal = True, True, [line]
            return True
        if record or line.startswith(_NOISE_STARTS):
            self._noisy = True
        elif line.startswith(_OURS):
            self._noisy = False
        return self._noisy

    def tick(self) -> None:
        with self._lock:
            self._release()

    def _release(self) -> None:
        now = self._clock()
        while self._queue:
            t, line, noise = self._queue[0]
            if noise and (self.fatal_seen or now - t < self._hold):
                return
            self._queue.pop(0)
            self._show(line)

    def _show(self, line: str) -> None:
        self.said_error = self.said_error or line.startswith("error:")
        self._write(line)

    def flush(self) -> None:
        """The child ended normally: show everything still held."""
        with self._lock:
            for _, line, _ in self._queue:
                self._show(line)
            self._queue.clear()

    def take(self) -> tuple[str | None, list[str]]:
        """The child failed: (its first held "error:" line or None, every other held line)."""
        with self._lock:
            lines = [line for _, line, _ in self._queue]
            self._queue.clear()
        first = next((ln for ln in lines if ln.startswith("error:")), None)
        return first, [ln for ln in lines if ln is not first]


def _write_stderr(line: str) -> None:
    sys.stderr.write(line if line.endswith("\n") else line + "\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- the one line


def describe(fatal: list[str], signum: int | None, job: Job) -> str:
    """One line: what the runtime's fatal record (or the signal) says about the peers."""
    text = " ".join(" ".join(fatal).split())
    where = f" at {job.coordinator}" if job.coordinator else ""
    hb = f"parallel.heartbeat_timeout_s={job.heartbeat_timeout_s}"
    unhealthy = re.search(r"stopped sending heartbeats\):\s*([\d ,]+?)\s*The tasks", text)
    task = re.search(r"Task (\d+) heartbeat timeout", text)
    if found := unhealthy or task:
        peers = ", ".join(found.group(1).replace(",", " ").split())
        what = (
            f"peer process {peers} stopped sending heartbeats for {hb} s (it died, hung or "
            f"was preempted; see its log)"
        )
    elif re.search(r"DEADLINE_EXCEEDED.*CoordinationService/Heartbeat", text):
        what = (
            f"the JAX coordinator (process 0{where}) stopped answering heartbeats for {hb} s "
            f"(it hung, died or is unreachable; see its log)"
        )
    elif re.search(r"leader task|Failed to send RPC to coordination service|Socket closed", text):
        what = f"lost the JAX coordinator (process 0{where}): it died or is unreachable (see its log)"
    elif text:
        status = text.split("absl::Status: ", 1)[-1]
        what = f"the JAX distributed runtime failed: {status[:240]}"
    else:
        name = signals.name(signum) if signum else "an unknown cause"
        what = f"the trainer died of {name} (a crash in the runtime; see its log)"
    how = f" ({signals.name(signum)})" if signum else ""
    return f"error: {job.label}: {what}; the runtime ended this process{how}"


def _file_away(lines: list[str], job: Job) -> str:
    """Append the held lines to the process's stderr log; " (log: PATH)" or "" if it failed."""
    if not lines:
        return ""
    try:
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(job.log_path, "a") as f:
            f.writelines(ln if ln.endswith("\n") else ln + "\n" for ln in lines)
    except OSError:
        return ""
    return f"; runtime log: {job.log_path}"


def outcome(returncode: int, filt: StderrFilter, job: Job) -> int:
    """Print what has to be printed for a finished child and return the exit code."""
    signum = -returncode if returncode < 0 else None
    failed = signum is not None or returncode == exits.EXIT_DISTRIBUTED or filt.fatal_seen
    if not failed:
        filt.flush()
        return returncode
    first, rest = filt.take()
    where = _file_away(rest, job)
    if first is not None:
        _write_stderr(first.rstrip("\n") + where)
    elif not filt.said_error:
        _write_stderr(describe(filt.fatal, signum, job) + where)
    return exits.EXIT_DISTRIBUTED


# --------------------------------------------------------------------------- running it


def _pump(stream, sink) -> None:
    """Copy lines until EOF; keep draining if our own output fails (the child must never
    block on a full pipe)."""
    for raw in iter(stream.readline, b""):
        try:
            sink(raw.decode("utf-8", "replace"))
        except (OSError, ValueError):
            pass
    stream.close()


def _stdout(line: str) -> None:
    sys.stdout.write(line)
    sys.stdout.flush()


def run(argv: list[str], job: Job, command: list[str] | None = None) -> int:
    """Run ``python -m moe_train *argv`` (or ``command``: tests) as a supervised child; return
    this process's exit code."""
    parent = os.getpid()
    child = subprocess.Popen(
        command or [sys.executable, "-m", "moe_train", *argv],
        env=dict(os.environ, **{MARKER: "1"}),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: _in_child(parent),
    )
    pending = signals.STOP.signum  # a stop signal that came before the child existed
    previous = {
        sig: signal.signal(sig, lambda signum, frame: _forward(child, signum))
        for sig in FORWARDED
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    signals.STOP.before_abort.append(child.kill)  # a second Ctrl-C: the child goes first
    signals.STOP.hint = signals.SUPERVISOR_HINT
    if pending:
        _forward(child, pending)
    try:
        return _supervise(child, job)
    finally:  # e.g. submitit's USR2 handler, which requeues the job once we return
        signals.STOP.before_abort.remove(child.kill)
        signals.STOP.hint = signals.HINT
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(child: subprocess.Popen, job: Job) -> int:
    """Pass the child's output through until it ends; its exit code as ours (``outcome``)."""
    filt = StderrFilter()
    pumps = [
        threading.Thread(target=_pump, args=(child.stdout, _stdout), daemon=True),
        threading.Thread(target=_pump, args=(child.stderr, filt.feed), daemon=True),
    ]
    for t in pumps:
        t.start()
    while True:
        try:
            returncode = child.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            filt.tick()
    for t in pumps:  # a grandchild could keep a pipe open: do not wait for ever
        t.join(timeout=5)
    return outcome(returncode, filt, job)


def _forward(child: subprocess.Popen, signum: int) -> None:
    if child.poll() is None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass
