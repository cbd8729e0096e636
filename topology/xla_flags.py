"""Check a preset's XLA_FLAGS against the XLA that will run them.

XLA flags come and go between versions, and XLA aborts the whole process on the first flag it
does not know ("Unknown flag in XLA_FLAGS: ..."), which on a cluster means every rank of a job
dies at start-up. ``unknown_flags`` starts a throw-away Python with the flags set, lets XLA
parse them, and reports every flag it refuses (one at a time: XLA stops at the first).

Every XLA build registers the flags of all its backends, so a CPU-only jaxlib checks GPU flags
by name too; values are checked only as far as XLA's parser does. The container's preflight
runs the same check against the container's own XLA.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (\S+)")
_PROBE = "import jax; jax.devices()"


def split(flags: str) -> list[str]:
    """The individual flags of an XLA_FLAGS string."""
    return shlex.split(flags)


def _refused(flags: list[str], python: str, timeout_s: float) -> tuple[str | None, str]:
    """(the first flag XLA refuses or None, XLA's message)."""
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    proc = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode == 0:
        return None, ""
    match = _UNKNOWN.search(proc.stderr)
    if match is None:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise RuntimeError(f"XLA failed for another reason than an unknown flag: {tail[0]}")
    bad = match.group(1)
    return next((f for f in flags if f == bad or f.split("=")[0] == bad.split("=")[0]), bad), match.group(0)


def unknown_flags(flags: str, python: str = sys.executable, timeout_s: float = 120) -> list[str]:
    """Every flag of ``flags`` that the XLA behind ``python``'s jax refuses, in order."""
    remaining, bad = split(flags), []
    while remaining:
        flag, _ = _refused(remaining, python, timeout_s)
        if flag is None:
            break
        bad.append(flag)
        if flag not in remaining:  # XLA named a flag we cannot find: stop rather than loop
            break
        remaining = [f for f in remaining if f != flag]
    return bad
