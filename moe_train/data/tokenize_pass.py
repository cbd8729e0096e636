"""Pass 2 of ``prepare``: the documents of every input, routed to their split, encoded by the
worker processes in batches whose results are consumed in submission order, and appended
(EOS after each) to the shard writers that want them.

``tokenize(opts, (files, checked, rule), workers, targets, stream)`` runs it. ``targets`` maps
each split to ranges ``(first, end, writer)`` of its documents (counted from 0 within the
split): a document in a range goes to that range's ``ShardWriter``, any other is skipped
without being encoded. A fresh or resumed run has one range per split, from the documents
its kept shards hold to the end; a repair has one range per shard it rebuilds.
"""

from __future__ import annotations

import collections

import numpy as np

from moe_train.data import DataError
from moe_train.data import inputs as inputs_mod
from moe_train.data import split as split_mod
from moe_train.data.progress import Progress
from moe_train.data.shards import ShardWriter
from moe_train.data.workers import Workers

SPLITS = ("train", "val")
BATCH_DOCS = 256  # documents per encode task, or ...
BATCH_CHARS = 1 << 20  # ... this many characters, whichever comes first


class Pass:
    """Routes documents to splits and ranges, batches them to the workers, writes results in
    order. ``targets``: see the module docstring."""

    def __init__(
        self, workers: Workers, rule: split_mod.ValRule, targets: dict[str, list], progress: Progress
    ):
        self.workers, self.rule, self.targets, self.progress = workers, rule, targets, progress
        self.index = 0  # documents seen, over all inputs
        self.seen = dict.fromkeys(SPLITS, 0)  # documents seen per split
        self.docs = self.tokens = 0  # documents and tokens written by this run
        self.done_bytes = 0
        self._texts: list[str] = []
        self._routes: list[ShardWriter] = []
        self._chars = 0
        self._pending: collections.deque = collections.deque()

    def feed(self, doc: str) -> None:
        """Document ``self.index``: queued for the writer of its range, else skipped."""
        name = "val" if self.rule.is_val(self.index) else "train"
        self.index += 1
        i = self.seen[name]
        self.seen[name] += 1
        writer = next((w for lo, end, w in self.targets[name] if lo <= i < end), None)
        if writer is None:
            return
        self._texts.append(doc)
        self._routes.append(writer)
        self._chars += len(doc)
        if len(self._texts) >= BATCH_DOCS or self._chars >= BATCH_CHARS:
            self.submit()
            self.drain(2 * self.workers.n)

    def submit(self) -> None:
        if self._texts:
            self._pending.append((self.workers.encode(self._texts), self._routes))
            self._texts, self._routes, self._chars = [], [], 0

    def drain(self, keep: int = 0) -> None:
        """Write finished batches, oldest first, until at most ``keep`` are in flight."""
        while len(self._pending) > keep:
            future, routes = self._pending.popleft()
            flat, lengths = future.result()
            ends = np.cumsum(lengths)
            for writer, end, n in zip(routes, ends, lengths):
                writer.add(flat[end - n : end])
            self.docs += len(routes)
            self.tokens += int(ends[-1])

    def read(self, f: inputs_mod.Input, expected: int, opts) -> None:
        """All documents of input ``f`` (which the check counted as ``expected``)."""
        reader = inputs_mod.Reader(f, split_on=opts.split_on, text_field=opts.text_field)
        count = 0
        for doc in reader.documents():
            count += 1
            self.feed(doc)
            if count % BATCH_DOCS == 0:
                self.progress.update(self.docs, self.tokens, self.done_bytes + reader.consumed)
        if count != expected:
            raise DataError(
                f"{f.shown}: changed while being prepared ({expected:,} documents "
                f"when checked, {count:,} now); run prepare again"
            )
        self.done_bytes += f.size


def tokenize(opts, inputs: tuple, workers: Workers, targets: dict, stream) -> tuple[Pass, float]:
    """The pass over ``inputs`` (files, their checks, the val rule) for ``prepare``'s options
    ``opts`` into the writers of ``targets``; every writer's shard closed, or on a failure
    aborted (nothing half-written stays). Returns the pass and its seconds."""
    files, checked, rule = inputs
    for name in SPLITS:
        (opts.out / name).mkdir(exist_ok=True)
    writers = [w for ranges in targets.values() for *_, w in ranges]
    progress = Progress("tokenize", sum(f.size for f in files), stream)
    job = Pass(workers, rule, targets, progress)
    try:
        for f, c in zip(files, checked):
            job.read(f, c.documents, opts)
        job.submit()
        job.drain()
        for w in writers:
            w.close_shard()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        progress.close()
    return job, progress.elapsed
