"""``--wait``: follow a submitted job to its end, streaming rank 0's output.

The job's state comes from ``sacct`` (the allocation line, ``-X``), falling back to
``squeue`` where accounting is not available. A requeued job (preemption, timeout, hung
step) goes back to PENDING and is followed on. When it ends, the exit status is 0 for
COMPLETED and non-zero otherwise; the message names the state, the exit code and the first
rank whose log has an ``error:`` line (the trainer prints one on every failure path).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

ACTIVE = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "COMPLETING",
    "CONFIGURING",
    "STAGE_OUT",
    "SIGNALING",
    "RESV_DEL_HOLD",
    "PREEMPTED",
}  # PREEMPTED: a requeueing job passes through it
POLL_S = 2.0


@dataclass(frozen=True)
class JobState:
    """One sacct/squeue reading of the job."""

    state: str  # Slurm state, e.g. RUNNING, COMPLETED, FAILED ("" when not known yet)
    exit_code: str  # "code:signal" from sacct; "" when unknown

    @property
    def done(self) -> bool:
        return bool(self.state) and self.state not in ACTIVE


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def query(job_id: str) -> JobState:
    """The job's current state (sacct, else squeue; empty while neither knows it)."""
    out = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"])
    if out and out.strip():
        state, _, code = out.strip().splitlines()[-1].partition("|")
        return JobState(state.split()[0] if state else "", code)
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if out and out.strip():
        return JobState(out.strip().splitlines()[0], "")
    return JobState("", "")


class LogTail:
    """New complete lines of a file that may not exist yet."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, ""

    def read(self) -> list[str]:
        try:
            with self.path.open("r", errors="replace") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        text = self.partial + data
        lines = text.split("\n")
        self.partial = lines.pop()
        return lines

    def flush(self) -> list[str]:
        lines = self.read()
        if self.partial:
            lines, self.partial = lines + [self.partial], ""
        return lines


_RANK_LOG = re.compile(r"_(\d+)_log\.(?:err|out)$")
_SRUN_TASK = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)")


def _srun_failure(folder: Path, job_id: str) -> str:
    """srun's first "task N: <reason>" line (the batch script shares rank 0's stderr log)."""
    try:
        text = (folder / f"{job_id}_0_log.err").read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        m = _SRUN_TASK.search(line)
        if m:
            return f"rank {m.group(2)} on {m.group(1)}: {m.group(3).strip()}"
    return ""


def _error_lines(folder: Path, job_id: str) -> list[tuple[int, str]]:
    """(rank, first ``error:`` line) for every rank whose log has one."""
    found: list[tuple[int, str]] = []
    for path in sorted(folder.glob(f"{job_id}_*_log.*")):
        m = _RANK_LOG.search(path.name)
        if not m:
            continue
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("error:") or re.match(r"\[process \d+ of \d+\] error", line):
                found.append((int(m.group(1)), line))
                break
    return found


def failing_rank(folder: Path, job_id: str) -> str:
    """Which rank failed first and why: srun's report and/or the rank's own error line."""
    found = _error_lines(folder, job_id)
    # a rank that reports a peer's failure is a victim; prefer one that does not
    found.sort(key=lambda r: (any(w in r[1] for w in ("peer", "watchdog", "no progress")), r[0]))
    own = f"rank {found[0][0]}: {found[0][1][:400]}" if found else ""
    srun = _srun_failure(folder, job_id)
    return "; ".join(x for x in (srun, own) if x)


def follow(
    job_id: str,
    folder: Path,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    poll_s: float = POLL_S,
    state_of: Callable[[str], JobState] = query,
    timeout_s: float | None = None,
) -> int:
    """Stream rank 0's stdout until the job ends; return 0 for COMPLETED, else non-zero."""
    tail = LogTail(folder / f"{job_id}_0_log.out")
    last, start = "", time.monotonic()
    while True:
        for line in tail.read():
            print(line, file=out, flush=True)
        st = state_of(job_id)
        if st.state and st.state != last:
            print(f"job {job_id}: {st.state}", file=err, flush=True)
            last = st.state
        if st.done:
            break
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            print(
                f"error: job {job_id} still {st.state or 'unknown'} after {timeout_s:g} s; "
                f"stopped following (it keeps running; scancel {job_id} to stop it)",
                file=err,
            )
            return 1
        time.sleep(poll_s)
    time.sleep(min(poll_s, 1.0))  # let the file system catch up with the last lines
    for line in tail.flush():
        print(line, file=out, flush=True)
    return report(job_id, folder, st, err)


def report(job_id: str, folder: Path, st: JobState, err: TextIO) -> int:
    """Print how the job ended; its exit status for the launcher."""
    if st.state == "COMPLETED":
        print(f"job {job_id} COMPLETED; OUT={folder.parent}", file=err, flush=True)
        return 0
    code = st.exit_code.partition(":")[0]
    where = failing_rank(folder, job_id)
    detail = f"; {where}" if where else f"; logs: {folder}/{job_id}_<rank>_log.{{out,err}}"
    print(f"error: job {job_id} ended {st.state} (exit {st.exit_code or '?'}){detail}", file=err, flush=True)
    return int(code) if code.isdigit() and int(code) > 0 else 1
