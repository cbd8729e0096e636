"""XLA:GPU's own warnings during a compile, read and said in one line each.

XLA logs from C++ straight to file descriptor 2. Two of its warnings come with every big
deviceless compile and read, beside the report, like a verdict of their own:

* ``hlo_rematerialization.cc] Can't reduce memory use below 60.53GiB (... bytes) by
  rematerialization; only reduced to 70.52GiB (...), down from 72.14GiB (...) originally``:
  the rematerialization pass recomputes values to bring *its own estimate* of the program's
  live memory under *its own limit* (a share of the target GPU's memory); it says when it
  could not. The memory the step allocates is the buffer assignment's, made after it
  (``CompiledMemory.peak``), and that is what the verdict compares with the usable memory.
* ``sort_rewriter.cc] Missing deviceless CUB scratch size data for sort. Using fallback sort
  algorithm ...`` (and its second line): without a GPU, XLA cannot size CUB's sort, so it
  compiles XLA's own sort where a GPU's compile would call CUB.

``captured()`` takes those lines off file descriptor 2 while a compile runs (every other
line passes through) and ``remat_note`` / ``sort_note`` say what they mean in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator

from moe_train.planner.compile import plugin
from moe_train.planner.memory import GIB

REMAT = re.compile(
    rb"Can't reduce memory use below \S+ \((\d+) bytes\) by rematerialization; only reduced to "
    rb"\S+ \((\d+) bytes\), down from \S+ \((\d+) bytes\) originally"
)
SORT = re.compile(rb"Missing deviceless CUB scratch size data for sort")
SORT_TAIL = re.compile(rb"^To avoid this, compile with a GPU present, or add the deviceless CUB data")


@dataclasses.dataclass
class Remat:
    """One rematerialization warning: XLA's limit, where it got to, where it started (bytes)."""

    limit: int
    reduced_to: int
    before: int


@dataclasses.dataclass
class Warnings:
    """What ``captured`` took off stderr."""

    remat: list[Remat] = dataclasses.field(default_factory=list)
    sorts: int = 0  # sorts compiled without CUB

    def take(self, line: bytes) -> bool:
        """Whether ``line`` is one of the warnings (then it is recorded, not printed)."""
        found = REMAT.search(line)
        if found:
            self.remat.append(Remat(*(int(g) for g in found.groups())))
            return True
        if SORT.search(line):
            self.sorts += 1
            return True
        return bool(SORT_TAIL.match(line))


@contextlib.contextmanager
def captured() -> Iterator[Warnings]:
    """While inside: file descriptor 2 without XLA's rematerialization and CUB-sort warnings,
    which the yielded ``Warnings`` collects (complete once the block has ended)."""
    seen = Warnings()
    with plugin.filtered_stderr(seen.take):
        yield seen


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def remat_note(seen: Warnings, peak: int, usable: int) -> str:
    """One line on XLA's rematerialization warning(s) and the verdict ('' without one);
    ``peak``: the bucket's compiled peak, ``usable``: the planner's usable bytes."""
    if not seen.remat:
        return ""
    r = max(seen.remat, key=lambda w: w.reduced_to)
    verdict = "fits" if peak <= usable else "does not fit"
    return (
        f"XLA:GPU's rematerialization pass could not bring its own estimate of the step's live "
        f"memory under its limit of {_gib(r.limit)} (only from {_gib(r.before)} down to "
        f"{_gib(r.reduced_to)}); that estimate is not what the step allocates: the buffer "
        f"assignment after it holds the peak above, {_gib(peak)}, which the verdict judges "
        f"({verdict} in {_gib(usable)} usable)"
    )


def sort_note(seen: Warnings) -> str:
    """One line on XLA's CUB-sort warnings ('' without one)."""
    if not seen.sorts:
        return ""
    return (
        f"deviceless XLA:GPU compiled {seen.sorts} sort(s) with its own algorithm (without a GPU "
        f"it cannot size CUB's scratch memory); a GPU's compile calls CUB there"
    )
