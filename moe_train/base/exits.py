"""Exit codes of every command of the kit (``python -m moe_train``, ``.data``, ``.convert``,
``.eval``, ``.score``) and which errors are the file system refusing a write
(``output_error``: exit 5).

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
130   interrupted (Ctrl-C, SIGINT): stopped like SIGTERM, after saving, the command that
      resumes printed last; or a second Ctrl-C: ended at once without saving (one line)
====  ==================================================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable

EXIT_OK, EXIT_BUG, EXIT_CONFIG, EXIT_DIVERGED, EXIT_DISTRIBUTED, EXIT_OUTPUT = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process a Ctrl-C ended


class OutputError(Exception):
    """The run directory cannot be written (permissions, full disk, ``ulimit -f``): printed
    as one line, exit code ``EXIT_OUTPUT``."""


def output_error(err: BaseException, what: str | os.PathLike) -> OutputError | None:
    """``err`` as an OutputError when it (or its cause) is the file system refusing a write."""
    seen = err
    while seen is not None:
        text = str(seen)
        if isinstance(seen, OSError) and seen.errno in OUTPUT_ERRNOS:
            return OutputError(
                f"cannot write {what}: {seen.strerror or text} "
                f"({getattr(seen, 'filename', None) or 'the run directory'})"
            )
        hit = next((m for m in OUTPUT_MARKS if m in text), None)
        if hit:
            return OutputError(f"cannot write {what}: {hit} ({' '.join(text.split())[:200]})")
        seen = seen.__cause__ or seen.__context__
    return None


class RaisedAs:
    """``with RaisedAs(translate):`` an exception of type ``catch`` raised in the block is
    raised as ``translate(err)`` (from ``err``; with ``cause=False`` from None) when that is
    not None (e.g. ``output_error``: an OutputError, one line); otherwise it goes on as it
    was, its traceback untouched."""

    def __init__(
        self,
        translate: Callable[[BaseException], BaseException | None],
        catch: type[BaseException] = Exception,
        cause: bool = True,
    ):
        self.translate, self.catch, self.cause = translate, catch, cause

    def __enter__(self) -> RaisedAs:
        return self

    def __exit__(self, kind, err, tb) -> None:
        if not isinstance(err, self.catch) or (out := self.translate(err)) is None:
            return  # not suppressed: the exception goes on
        raise out from (err if self.cause else None)


OUTPUT_ERRNOS = {13, 28, 27, 30, 122, 1, 20, 21}  # EACCES ENOSPC EFBIG EROFS EDQUOT EPERM ENOTDIR EISDIR
OUTPUT_MARKS = (
    "No space left on device",
    "File too large",
    "Disk quota exceeded",
    "Read-only file system",
    "Permission denied",
)
