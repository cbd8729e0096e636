"""The stop flag set by SIGTERM/SIGUSR2/SIGINT, and how a stopped run exits (0, or 130 after
a Ctrl-C). The exit codes themselves, and the error for an output that cannot be written,
are every command's: ``moe_train.base.exits``.

The stop flag is installed as early as possible (first thing in the CLI), so a signal that
arrives while the run starts (imports, compile, restore) also ends it cleanly: the trainer
checks the flag after the kernel self-test, before its first step and after every step.

A second SIGINT ends the process at once (``os._exit(130)``), even inside a long compile or
device wait: a thread counts the SIGINTs as they arrive (``signal.set_wakeup_fd``), not when
the main thread runs Python's handler. During the trainer's start-up (``begin_start_up`` to
``end_start_up``: until the first step is dispatched) there is no step to finish or save, so
that thread ends the process at the first SIGTERM or SIGINT, wherever the main thread is
stuck (a blocking read, a compile, a device wait): one line on stdout, "stopped by signal
... during start-up: nothing was trained or saved", exit 0 (SIGTERM) or 130 (SIGINT).

Nothing is left corrupt: a checkpoint is written to a temporary directory and renamed once
complete (``moe_train.checkpoints.checkpoint``), and ``metrics.jsonl`` drops a torn last line
at the next start. SIGINT that was ignored when the flag was installed (a background job of
a script) stays ignored.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from moe_train.base.exits import EXIT_INTERRUPTED, EXIT_OK
from moe_train.base.threads import start_daemon

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)
HINT = (
    "interrupted (Ctrl-C): stopping cleanly, the current step finishes and is saved; "
    "Ctrl-C again ends at once without saving\n"
)
# a supervisor's: its child may still be starting (then it stops at once and says so itself)
SUPERVISOR_HINT = (
    "interrupted (Ctrl-C): stopping cleanly (past start-up the current step finishes and is "
    "saved); Ctrl-C again ends at once without saving\n"
)


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    """Call each hook in turn before the process ends at once; one that raises is passed over
    (the process ends anyway)."""
    for hook in list(hooks):
        try:
            hook()
        except Exception:
            pass


class StopFlag:
    """Set by SIGTERM/SIGUSR2/SIGINT; the loop finishes the current step, saves and exits 0
    (130 for SIGINT). A second SIGINT ends the process at once (see the module doc)."""

    def __init__(self):
        self.signum: int | None = None
        self.resume = ""  # how to resume, set by the CLI: "run: <command>"; "": the same command
        self.before_abort: list[Callable[[], None]] = []  # run before a second SIGINT ends us
        self.at_start_up_exit: list[Callable[[], None]] = []  # run before a start-up stop ends us
        self._starting = False  # in start-up: the first SIGTERM/SIGINT ends the process at once
        self._said = False  # the start-up stop's one line is taken (by either thread)
        self._saying = threading.Lock()
        self._previous: dict = {}
        self._wakeup: tuple[int, int] | None = None  # (the wakeup fd replaced, our pipe's end)
        self._abort_on_second = True  # a second SIGINT ends the process (not in a supervised child)
        self.hint = HINT  # what the first SIGINT prints (a supervisor: SUPERVISOR_HINT)

    def install(self, abort_on_second: bool = True) -> bool:
        """Catch the stop signals (main thread only). True when this call installed them (and
        cleared the flag): that caller restores them; False when they were already in place.
        ``abort_on_second``: a second SIGINT ends the process (not in a supervised child: its
        supervisor counts them, and a terminal's Ctrl-C reaches both)."""
        if self._previous:
            return False
        self.signum, self._said = None, False
        for sig in STOP_SIGNALS:
            if sig != signal.SIGINT or signal.getsignal(sig) is not signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._handle)
        # Past ``ulimit -f`` a write fails with EFBIG (exit 5) instead of killing the process.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        # A thread sees each signal as it arrives: in start-up SIGTERM/SIGINT end the process
        # (a supervised child's too: its supervisor forwards them); SIGINTs are counted
        self._abort_on_second = abort_on_second
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._wakeup = (signal.set_wakeup_fd(write, warn_on_full_buffer=False), write)
        start_daemon(self._count_interrupts, "moe-train-interrupts", read)
        return True

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def _count_interrupts(self, read: int) -> None:
        """In start-up, the first SIGTERM or SIGINT: ``stop_start_up``. Else the first
        SIGINT: say what happens; the second: ``abort``. Ends when ``restore`` closes the pipe."""
        seen = 0
        try:
            while chunk := os.read(read, 64):  # one byte per signal caught, its number
                ending = next((s for s in chunk if s in (signal.SIGTERM, signal.SIGINT)), None)
                if self._starting and ending is not None:
                    self.stop_start_up(ending)  # returns when the main thread is ending already
                if not self._abort_on_second:  # a supervised child: its supervisor counts them
                    continue
                before, seen = seen, seen + chunk.count(signal.SIGINT)
                if seen >= 2:
                    self.abort()
                if seen and not before and not self._said:  # a start-up stop said its line
                    _say(1, self.hint)
        finally:
            os.close(read)

    def begin_start_up(self) -> None:
        """From now until ``end_start_up`` a SIGTERM or SIGINT ends the process at once (where
        ``install``'s thread sees the signals)."""
        self._starting = self._wakeup is not None
        early = self.signum
        if self._starting and early is not None and early in (signal.SIGTERM, signal.SIGINT):
            self.stop_start_up(early)  # it came before: e.g. forwarded as a child started

    def end_start_up(self) -> None:
        """The first step is dispatched (or the start-up is over): stop signals save again."""
        self._starting = False
        self.at_start_up_exit.clear()

    def say_start_up_stop(self) -> bool:
        """Whether the caller says how the start-up stopped (True once: the main thread at a
        check point, or the counting thread ending the process)."""
        with self._saying:
            said, self._said = self._said, True
        return not said

    def stop_start_up(self, signum: int) -> None:
        """End the process now, in start-up: ``at_start_up_exit``, one line, exit 0 or 130
        (nothing, when the main thread already said it stops: it returns on its own)."""
        if not self.say_start_up_stop():
            return
        _run_hooks(self.at_start_up_exit)
        _say(1, start_up_line(signum) + "\n")
        os._exit(exit_code(signum))

    def abort(self) -> None:
        """End the process now, without saving: ``before_abort``, one line, exit 130."""
        _run_hooks(self.before_abort)
        _say(
            2,
            f"error: interrupted twice (Ctrl-C): ended at once, without saving (complete "
            f"checkpoints are kept, a partial one is removed at the next start); "
            f"{resume_hint()}\n",
        )
        os._exit(EXIT_INTERRUPTED)

    def restore(self) -> None:
        """Put back the handlers ``install`` replaced (e.g. submitit's USR2 requeue)."""
        self.end_start_up()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._wakeup is not None:
            previous, write = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)  # the counting thread reads the end of the pipe and stops
            self._wakeup = None

    def agree(self, save_due: bool = False) -> tuple[int | None, bool]:
        """(The stop signal if any process got one, whether any process's checkpoint timer is
        due). Processes must stop, and save, after the same step (a checkpoint is a
        collective), so a multi-process run agrees on both every step, in one gather."""
        import jax

        if jax.process_count() == 1:
            return self.signum, save_due
        import numpy as np
        from jax.experimental import multihost_utils

        mine = np.array([self.signum or 0, int(save_due)], np.int32)
        got = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2).max(axis=0)
        return int(got[0]) or None, bool(got[1])

    def agreed(self) -> int | None:
        """The stop signal if any process got one (``agree``)."""
        return self.agree()[0]


STOP = StopFlag()  # the process's flag: the CLI installs it first thing, the trainer reads it


def name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_code(signum: int | None) -> int:
    """How a run that a stop signal (or nothing: None) ended exits: 130 for SIGINT, else 0."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_OK


def start_up_line(signum: int, where: str = "") -> str:
    """The one line of a stop during start-up (``where``: e.g. ", after the kernel self-test")."""
    return (
        f"stopped by signal {name(signum)} during start-up{where}: nothing was trained or saved; "
        f"to start again, {STOP.resume or 'rerun the same command'}"
    )


def resume_hint() -> str:
    """The line that says how to resume, e.g. "to resume, run: python -m moe_train ..."."""
    return f"to resume, {STOP.resume or 'rerun the same command'}"


def _say(fd: int, text: str) -> None:
    """Write to stdout (1) or stderr (2) without Python's buffers (any thread, any time)."""
    try:
        os.write(fd, text.encode())
    except OSError:
        pass
