"""Exit codes of ``python -m moe_train``, the stop flag set by SIGTERM/SIGUSR2, and which errors are
the file system refusing a write (``output_error``: exit 5).

Every way a run ends has its own code (the README's exit-code table lists the same):

====  ==================================================================================
0     finished, or stopped by SIGTERM/SIGUSR2 after saving (rerun the same command)
1     a bug: an unexpected exception (traceback printed)
2     bad configuration or input, or the run directory is held by another trainer;
      nothing in the run directory is changed
3     training diverged: non-finite loss, gradients or parameters (``train.on_nonfinite``);
      nothing past the last good checkpoint is saved
4     multi-process failure: a peer died, hung, or could not connect
5     the run directory cannot be written (permissions, full disk, file size limit); the
      previous checkpoint is intact, a partial one is removed at the next start
====  ==================================================================================

The stop flag is installed as early as possible (first thing in the CLI), so a signal that
arrives while the run starts (imports, compile, restore) also ends it cleanly: the trainer
checks the flag before its first step and after every step.
"""

from __future__ import annotations

import signal

EXIT_OK, EXIT_BUG, EXIT_CONFIG, EXIT_DIVERGED, EXIT_DISTRIBUTED, EXIT_OUTPUT = 0, 1, 2, 3, 4, 5
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


class StopFlag:
    """Set by SIGTERM/SIGUSR2; the loop finishes the current step, saves and exits 0."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def install(self) -> bool:
        """Catch the stop signals (main thread only). True when this call installed them (and
        cleared the flag): that caller restores them; False when they were already in place."""
        if self._previous:
            return False
        self.signum = None
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        # Past ``ulimit -f`` a write fails with EFBIG (exit 5) instead of killing the process.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        return True

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def restore(self) -> None:
        """Put back the handlers ``install`` replaced (e.g. submitit's USR2 requeue)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def agreed(self) -> int | None:
        """The stop signal if any process got one. Processes must stop after the same step
        (a checkpoint is a collective), so a multi-process run agrees every step."""
        import jax

        if jax.process_count() == 1:
            return self.signum
        import numpy as np
        from jax.experimental import multihost_utils

        signums = multihost_utils.process_allgather(np.int32(self.signum or 0))
        return int(np.max(signums)) or None


STOP = StopFlag()  # the process's flag: the CLI installs it first thing, the trainer reads it


def name(signum: int) -> str:
    return signal.Signals(signum).name


class OutputError(Exception):
    """The run directory cannot be written (permissions, full disk, ``ulimit -f``): printed
    as one line, exit code ``EXIT_OUTPUT``."""


def output_error(err: BaseException, what: str) -> OutputError | None:
    """``err`` as an OutputError when it (or its cause) is the file system refusing a write."""
    seen = err
    while seen is not None:
        text = str(seen)
        if isinstance(seen, OSError) and seen.errno in OUTPUT_ERRNOS:
            return OutputError(f"cannot write {what}: {seen.strerror or text} "
                               f"({getattr(seen, 'filename', None) or 'the run directory'})")
        hit = next((m for m in OUTPUT_MARKS if m in text), None)
        if hit:
            return OutputError(f"cannot write {what}: {hit} ({' '.join(text.split())[:200]})")
        seen = seen.__cause__ or seen.__context__
    return None


OUTPUT_ERRNOS = {13, 28, 27, 30, 122, 1, 20, 21}  # EACCES ENOSPC EFBIG EROFS EDQUOT EPERM ENOTDIR EISDIR
OUTPUT_MARKS = ("No space left on device", "File too large", "Disk quota exceeded",
                "Read-only file system", "Permission denied")
