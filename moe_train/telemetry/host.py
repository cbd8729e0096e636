"""Host readings for the telemetry sampler: CPU utilization, this process's memory, load.

Sampled in every process (on CPU runs they are the whole timeline). psutil (a dependency of
orbax-checkpoint) is used when importable; without it the process CPU share comes from
``os.times`` and RSS from ``/proc/self/statm`` where that exists.

Fields: ``host_cpu_pct`` (all CPUs, percent of the machine since the last sample),
``proc_cpu_pct`` (this process, percent of one CPU: 200 = two busy cores), ``rss_bytes``
(resident memory of this process), ``host_mem_pct`` (used memory of the machine), ``load1``
(one-minute load average).
"""

from __future__ import annotations

import os
import time
from typing import Any


class HostProbe:
    """Reads host and process figures; each ``read`` covers the time since the previous one."""

    def __init__(self):
        try:
            import psutil

            self._psutil = psutil
            self._proc = psutil.Process()
            self._proc.cpu_percent(None)  # the first call only sets the baseline
            psutil.cpu_percent(None)
        except Exception:
            self._psutil = None
        self._times = (os.times(), time.monotonic())

    def read(self) -> dict[str, Any]:
        """One sample; a figure the platform cannot give is left out."""
        out: dict[str, Any] = {}
        try:
            out["load1"] = os.getloadavg()[0]
        except OSError:
            pass
        if self._psutil is not None:
            ps = self._psutil
            out["host_cpu_pct"] = ps.cpu_percent(None)
            out["proc_cpu_pct"] = self._proc.cpu_percent(None)
            out["rss_bytes"] = self._proc.memory_info().rss
            out["host_mem_pct"] = ps.virtual_memory().percent
            return out
        times, wall = os.times(), time.monotonic()
        (t0, w0), self._times = self._times, (times, wall)
        if wall > w0:
            used = (times.user - t0.user) + (times.system - t0.system)
            out["proc_cpu_pct"] = 100.0 * used / (wall - w0)
        rss = _statm_rss()
        if rss is not None:
            out["rss_bytes"] = rss
        return out


def _statm_rss() -> int | None:
    """Resident bytes from /proc/self/statm (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
