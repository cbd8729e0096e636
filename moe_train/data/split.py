"""Which documents of a prepared corpus are held out for validation.

A document is identified by its index: its position among all documents of all inputs, in input
order, counting from 0. Its split depends only on that index and ``--seed``, through a 64-bit
hash, never on its text or on how the work was parallelised:

    h(i) = splitmix64(splitmix64(seed) XOR i)

* ``--val-fraction F``: document ``i`` is held out when ``h(i) < F * 2**64``. Each document is
  decided on its own (streaming), so the split holds *about* ``F`` of the documents; appending
  inputs never moves an earlier document between splits.
* ``--val-docs N``: exactly the ``N`` documents with the smallest ``h(i)`` (ties by index), which
  needs the document count (known after the input check).

Held-out documents are scattered through the corpus rather than taken from its start or end, so
the validation split samples every input.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from moe_train.data import DataError

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_CHUNK = 1 << 20


def splitmix64(x: int) -> int:
    """The splitmix64 output for state ``x`` (Steele, Lea and Flood 2014), as a Python int."""
    z = (x + _GAMMA) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def doc_hash(seed: int, index: int) -> int:
    """``h(index)`` for ``seed``: the 64-bit hash that decides the document's split."""
    return splitmix64(splitmix64(seed) ^ index)


def doc_hashes(seed: int, start: int, count: int) -> np.ndarray:
    """``h(i)`` for ``i`` in ``[start, start + count)`` as uint64, equal to :func:`doc_hash`."""
    z = np.arange(start, start + count, dtype=np.uint64) ^ np.uint64(splitmix64(seed))
    with np.errstate(over="ignore"):
        z = z + np.uint64(_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


@dataclasses.dataclass(frozen=True)
class ValRule:
    """``--val-fraction`` or ``--val-docs`` with ``--seed``: answers ``is_val(index)``."""

    seed: int
    fraction: float | None = None  # set for --val-fraction
    docs: int | None = None  # set for --val-docs
    chosen: frozenset = frozenset()  # the --val-docs indices, once the document count is known

    def describe(self) -> dict:
        """The rule as written to the manifest."""
        if self.docs is not None:
            return {
                "rule": "docs",
                "docs": self.docs,
                "seed": self.seed,
                "hash": "the N smallest splitmix64(splitmix64(seed) ^ index)",
            }
        return {
            "rule": "fraction",
            "fraction": self.fraction,
            "seed": self.seed,
            "hash": "splitmix64(splitmix64(seed) ^ index) < fraction * 2**64",
        }

    def with_count(self, documents: int) -> ValRule:
        """The rule for a corpus of ``documents`` documents (picks the ``--val-docs`` set)."""
        if self.docs is None:
            return self
        if self.docs > documents:
            raise DataError(
                f"--val-docs {self.docs:,} is more than the {documents:,} documents "
                f"in the inputs; use a smaller N or --val-fraction"
            )
        chosen = frozenset(smallest(self.seed, documents, self.docs))
        return dataclasses.replace(self, chosen=chosen)

    def is_val(self, index: int) -> bool:
        if self.docs is not None:
            return index in self.chosen
        return bool(self.fraction) and doc_hash(self.seed, index) < int(self.fraction * 2.0**64)


def smallest(seed: int, documents: int, n: int) -> list[int]:
    """The ``n`` indices in ``[0, documents)`` with the smallest hashes, chunk by chunk."""
    best: list[tuple[int, int]] = []
    for lo in range(0, documents, _CHUNK):
        h = doc_hashes(seed, lo, min(_CHUNK, documents - lo))
        keep = np.argsort(h, kind="stable")[:n]
        best = heapq.nsmallest(n, best + [(int(h[k]), lo + int(k)) for k in keep])
    return sorted(i for _, i in best)
