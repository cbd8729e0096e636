"""One trainer per run directory: an exclusive lock in ``<out>/run.lock``.

Two trainers on one ``--out`` would interleave ``metrics.jsonl``, delete each other's
temporary checkpoints and overwrite ``config.json``. ``acquire(out_dir)`` takes a POSIX record
lock (``fcntl.lockf``, non-blocking, write lock on the whole file) on ``out_dir/run.lock`` and
keeps its file descriptor open until ``RunLock.release()``; a second trainer gets
``RunDirLocked`` (a ``ConfigError``: exit code 2, one line) naming the holder.

The file's content is a JSON record of the holder (host, pid, Slurm job and step id, start
time in UTC, command line), rewritten by each new holder while it holds the lock, and marked
``released_at`` by a clean release. It is information for people and error messages only:
the lock itself is the kernel's, never the file's existence or content.

What is guaranteed
------------------
* Local file systems (ext4, xfs, btrfs, tmpfs, ...): at most one live process holds the lock.
  The kernel drops a process's record locks when it exits in any way (crash, SIGKILL, OOM
  kill), so a lock left by a dead trainer is taken over by the next ``acquire`` at once; there
  is no stale-lock heuristic and no pid guessing.
* NFSv4, and NFSv3 with the lock manager (lockd/statd) running: the lock excludes trainers on
  all client nodes. A trainer that dies on a live node releases at once. A crashed (or
  partitioned) client node holds its lock until the server expires that client's lease: about
  90 s by default (the server's NFSv4 lease time; NFSv3: until statd notices the reboot), after
  which ``acquire`` succeeds. Conversely, a node partitioned past its lease loses its lock
  silently while its trainer may still run; the kit cannot see that.
  NFS mounted with ``-o nolock`` (v3) or ``local_lock=posix``/``all`` keeps locks local to
  each node: trainers on the same node are excluded, trainers on different nodes are not.
* Lustre: only when mounted with ``-o flock`` (cluster-coherent locks). With ``-o localflock``
  locks are node-local: it excludes trainers on the same node only. With ``-o noflock`` (the
  default on some sites) ``lockf`` fails; ``acquire`` then does not fail but returns an
  unenforced ``RunLock`` whose ``warning`` the trainer logs.
* Other file systems that refuse locks (errno ENOLCK, EOPNOTSUPP, ENOSYS or EINVAL): the
  same unenforced lock with a warning.

POSIX record locks belong to the *process*: within one process a second ``lockf`` on the
same file would succeed, and closing *any* descriptor of ``run.lock`` in the holding process
drops its lock. So ``acquire`` refuses a directory this process already holds (without
opening the file), and nothing else in the trainer may open ``run.lock``; use
``read_holder`` (which knows about this process's own locks) to look at it. Locks are not
inherited across ``fork``; the descriptor is close-on-exec.

In a multi-process job one process (process 0, the one that writes metrics and config)
should hold the lock for the whole job.

Errors creating or writing the directory or the file (EACCES, EROFS, ENOSPC, ENOTDIR, a file
where the directory should be, ...) raise ``moe_train.base.exits.OutputError`` with one line
naming the path and the OS reason.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from moe_train.base.exits import OutputError
from moe_train.config import ConfigError

LOCK_NAME = "run.lock"
# lockf on a file system without (coherent) lock support fails with one of these.
UNSUPPORTED_ERRNOS = frozenset(
    e
    for e in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, getattr(errno, "ENOTSUP", None))
    if e is not None
)
# lockf(LOCK_NB) reports a lock held by another process with one of these.
HELD_ERRNOS = frozenset((errno.EACCES, errno.EAGAIN))

# Locks this process holds, by the lock file's resolved path and its (st_dev, st_ino). POSIX
# locks are per process, so this is the only way to see our own lock (see the docstring).
_HELD: dict[Any, RunLock] = {}
_HELD_GUARD = threading.Lock()


class RunDirLocked(ConfigError):
    """Another live trainer holds the run directory (exit code 2, one line)."""

    def __init__(self, message: str, path: Path, holder: dict[str, Any] | None):
        super().__init__(message)
        self.path = path
        self.holder = holder


def holder_info() -> dict[str, Any]:
    """The record this process writes into ``run.lock`` when it takes the lock."""
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
        "started_at": _utc_now(),
        "command": shlex.join(argv),
    }


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def describe(holder: dict[str, Any] | None) -> str:
    """``pid P on host H (Slurm job J step S) since T`` for an error or log line."""
    if not holder:
        return "another process (its record in run.lock is not written yet or unreadable)"
    text = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    if holder.get("slurm_job_id"):
        step = holder.get("slurm_step_id")
        text += f" (Slurm job {holder['slurm_job_id']}{f' step {step}' if step else ''})"
    return text + f" since {holder.get('started_at', '?')}"


class RunLock:
    """The lock on one run directory; ``release()`` (or leaving the ``with`` block) frees it.

    ``enforced`` is False where the file system refused the lock; ``warning`` then says so,
    for the trainer to log. ``previous`` is the record the last holder left in the file
    (None if there was none); ``previous_crashed`` is True when that holder ended without
    releasing (crash, kill) rather than cleanly.
    """

    def __init__(
        self,
        out_dir: Path,
        fd: int | None,
        holder: dict[str, Any],
        previous: dict[str, Any] | None,
        warning: str | None = None,
    ):
        self.out_dir = out_dir
        self.path = out_dir / LOCK_NAME
        self.holder = holder
        self.previous = previous
        self.warning = warning
        self._fd = fd
        self._pid = os.getpid()  # a forked child inherits the object and fd, not the lock
        self._keys: tuple = ()

    @property
    def enforced(self) -> bool:
        return self.warning is None

    @property
    def held(self) -> bool:
        return self._fd is not None and os.getpid() == self._pid

    @property
    def previous_crashed(self) -> bool:
        return bool(self.previous) and "released_at" not in self.previous

    def release(self) -> None:
        """Mark the record released, unlock and close (idempotent). The file stays: removing
        it would race with a process that opened it just before and locks the orphan."""
        fd, self._fd = self._fd, None
        with _HELD_GUARD:
            for key in self._keys:
                if _HELD.get(key) is self:
                    del _HELD[key]
        if fd is None:
            return
        if os.getpid() != self._pid:  # in a forked child: its copy of the fd, nothing to unlock
            os.close(fd)
            return
        try:
            _write_record(fd, {**self.holder, "released_at": _utc_now()})
        except OSError:
            pass  # best effort: the record is information only, the unlock below is what counts
        try:
            fcntl.lockf(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing drops the lock in any case

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"RunLock({str(self.path)!r}, {state}{'' if self.enforced else ', unenforced'})"


def acquire(out_dir: Path) -> RunLock:
    """Take ``out_dir/run.lock`` (creating ``out_dir``) or raise ``RunDirLocked``.

    Raises ``OutputError`` when the directory or file cannot be created or written. Where the
    file system does not support locks, returns an unenforced ``RunLock`` with a ``warning``.
    """
    out_dir = Path(out_dir)
    path = out_dir / LOCK_NAME
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot create run directory {out_dir}: {_reason(err)}") from None
    if not out_dir.is_dir():  # mkdir(exist_ok=True) already refuses a file; belt and braces
        raise OutputError(f"cannot create run directory {out_dir}: not a directory")

    mine = _held_here(path)
    if mine is not None:
        message = _locked_message(out_dir, mine.holder) + " (this process already holds it)"
        raise RunDirLocked(message, path, mine.holder)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as err:
        raise OutputError(f"cannot open {path}: {_reason(err)}") from None
    holder = holder_info()
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in HELD_ERRNOS:
            other = _read_record(fd, wait_s=1.0)
            os.close(fd)
            raise RunDirLocked(_locked_message(out_dir, other), path, other) from None
        if err.errno in UNSUPPORTED_ERRNOS:
            return _unenforced(out_dir, fd, holder, err)
        os.close(fd)
        raise OutputError(f"cannot lock {path}: {_reason(err)}") from None

    # Held: nobody else can be writing the record now.
    lock = RunLock(out_dir, fd, holder, previous=_read_record(fd))
    try:
        _write_record(fd, holder)
    except OSError as err:
        lock.release()
        raise OutputError(f"cannot write {path}: {_reason(err)}") from None
    keys = _keys(path, fd)
    with _HELD_GUARD:
        for key in keys:
            _HELD[key] = lock
    lock._keys = keys
    return lock


def read_holder(out_dir: Path) -> dict[str, Any] | None:
    """The record in ``out_dir/run.lock`` (None if absent or unreadable), safe to call from
    the holding process (it does not open the file there, which would drop the lock)."""
    path = Path(out_dir) / LOCK_NAME
    mine = _held_here(path)
    if mine is not None:
        return dict(mine.holder)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        return _read_record(fd)
    finally:
        os.close(fd)


def _unenforced(out_dir: Path, fd: int, holder: dict[str, Any], err: OSError) -> RunLock:
    """No lock support: record who we are (for people), close, and warn."""
    previous = _read_record(fd)
    try:
        _write_record(fd, {**holder, "unenforced": True})
    except OSError:
        pass
    finally:
        os.close(fd)
    warning = (
        f"file system of {out_dir} does not support locks (Lustre without -o flock?); "
        f"one trainer per directory is not enforced [{_reason(err)}]"
    )
    return RunLock(out_dir, None, holder, previous=previous, warning=warning)


def _locked_message(out_dir: Path, holder: dict[str, Any] | None) -> str:
    return (
        f"run directory {out_dir} is in use by {describe(holder)}; wait for it, stop it, or use another --out"
    )


def _write_record(fd: int, record: dict[str, Any]) -> None:
    data = (json.dumps(record, indent=1) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EROFS):  # file systems that cannot fsync
            raise


def _read_record(fd: int, wait_s: float = 0.0) -> dict[str, Any] | None:
    """The JSON record in ``fd``; waits up to ``wait_s`` for a new holder to write it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            size = os.fstat(fd).st_size
            record = json.loads(os.pread(fd, max(size, 1), 0).decode()) if size else None
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict) and record:
            return record
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _keys(path: Path, fd: int | None = None) -> tuple:
    """How this process's registry knows a lock file: resolved path and (dev, inode)."""
    keys: list = [("path", os.getpid(), str(path.resolve()))]
    try:
        st = os.fstat(fd) if fd is not None else os.stat(path)
        keys.append(("inode", os.getpid(), st.st_dev, st.st_ino))
    except OSError:
        pass
    return tuple(keys)


def _held_here(path: Path) -> RunLock | None:
    """This process's own live lock on ``path``, found without opening the file. Keys carry
    the pid, so a forked child (which does not inherit locks) does not see its parent's."""
    with _HELD_GUARD:
        for key in _keys(path):
            lock = _HELD.get(key)
            if lock is not None and lock.held:
                return lock
    return None


def _reason(err: OSError) -> str:
    name = errno.errorcode.get(err.errno, "") if err.errno else ""
    text = err.strerror or str(err)
    return f"{text} ({name})" if name else text
