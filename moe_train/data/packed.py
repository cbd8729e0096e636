"""Rows of packed documents from a prepared corpus (``data.source=prepared``).

Training rows (``PreparedSource``). Epoch ``e`` of the train split is its documents in a
shuffled order (``numpy.random.default_rng([data.seed, e, tag])``) concatenated into one
stream of N tokens (every document ends with EOS). The stream is cut into
R = (N - 1) // S rows of S + 1 tokens that overlap by one (row j is ``stream[j*S : j*S+S+1]``),
so every token but the stream's first is a target once per epoch (the last
N - 1 - R*S tokens of an epoch are left out), and the epoch's rows are visited in a second
shuffled order. Global row g = step * B + r is row g mod R of epoch g // R: a batch depends
only on (data.seed, step) and the corpus, a resumed run sees the batches it would have seen,
and each process builds the rows of its share only. Batches are computed one or two steps
ahead on a background thread (``moe_train.data.prefetch``).

Packing (``data.packing``, the default): each row records which document piece each token
belongs to as segment ids 1, 2, ... (the batch ``{"tokens", "segments"}`` of
``moe_train.data.packing``): attention stays inside a document, positions restart per document
and a document's first token is not predicted from the one before. ``data.packing=false``
gives the same tokens as a plain ``[B, S+1]`` array (attention then crosses documents, as with
a flat token file).

Held-out rows (``val_rows``): the val split in document order (not shuffled), cut the same
way from its start; a row past the split's end is padded with ``packing.PAD`` in a segment of
its own (never scored).

Memory per process: an epoch's document order and cumulative lengths (16 bytes a document)
and its row order (8 bytes a row), for the at most two epochs kept at a time.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from moe_train.data import DataError, Source, packing, resolve_path
from moe_train.data.prefetch import Prefetcher
from moe_train.data.prepared import Split, open_split, read_manifest

_ORDER_TAG = 0x9AC4ED  # separates the epochs' shuffles from the other random streams
_EPOCHS_KEPT = 2  # a batch spans at most two epochs when R >= B


def resolve_dir(path: str, key: str = "data.path") -> tuple[Path, str]:
    """The prepared directory ``data.path`` (or ``key``) names, and how to show it (cwd, then
    kit root)."""
    what = "a directory written by python -m moe_train.data prepare"
    empty = f"data.source=prepared needs {key}=<{what}>" if key == "data.path" else f"{key} is empty"
    return resolve_path(path, what, directory=True, empty=empty, key=key)


def open_checked(path: str, name: str, vocab_size: int) -> tuple[Split, str]:
    """Split ``name`` of the prepared ``data.path``, its vocabulary checked against the model."""
    root, shown = resolve_dir(path)
    split = open_split(root, name)
    if split.vocab_size > vocab_size:
        raise DataError(
            f"data.path={shown}: prepared with a vocabulary of "
            f"{split.vocab_size:,} tokens, more than model.vocab_size="
            f"{vocab_size:,}; set model.vocab_size >= {split.vocab_size:,}"
        )
    return split, shown


class Stream:
    """The documents of ``split`` in ``order`` as one token stream that rows are cut from."""

    def __init__(self, split: Split, order: np.ndarray):
        self.split, self.order = split, order
        lengths = np.diff(split.doc_starts)[order]
        self.cum = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.total = int(self.cum[-1])

    def rows(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, segment ids), int32 [len(starts), length]: ``stream[s : s + length]`` for
        each start; document pieces numbered 1, 2, ...; past the end PAD, one more segment."""
        n = len(starts)
        tokens = np.full((n, length), packing.PAD, np.int32)
        segments = np.empty((n, length), np.int32)
        ends = np.clip(np.asarray(starts, np.int64) + length, 0, self.total)
        first = np.searchsorted(self.cum, starts, side="right") - 1
        last = np.searchsorted(self.cum, ends - 1, side="right") - 1
        doc_starts, cum = self.split.doc_starts, self.cum
        for i in range(n):
            col, seg = 0, 0
            for k in range(int(first[i]), int(last[i]) + 1) if ends[i] > starts[i] else ():
                lo, hi = max(int(starts[i]), int(cum[k])), min(int(ends[i]), int(cum[k + 1]))
                at = int(doc_starts[self.order[k]]) + lo - int(cum[k])
                seg += 1
                tokens[i, col : col + hi - lo] = self.split.tokens[at : at + hi - lo]
                segments[i, col : col + hi - lo] = seg
                col += hi - lo
            segments[i, col:] = seg + 1
        return tokens, segments


class PreparedSource(Source):
    """Shuffled, packed rows of a prepared corpus's train split (see the module docstring)."""

    def __init__(self, path: str, packed: bool, **kw) -> None:
        super().__init__(**kw)
        self.split, shown = open_checked(path, "train", self.vocab_size)
        self.packed = packed
        n, need = self.split.num_tokens, self.seq_len + 1
        self.rows_per_epoch = (n - 1) // self.seq_len
        if self.rows_per_epoch < 1:
            raise DataError(
                f"data.path={shown}: the train split holds {n:,} tokens, fewer than "
                f"train.seq_len + 1 = {need}; prepare more text or lower seq_len"
            )
        self._epochs: dict[int, tuple[Stream, np.ndarray]] = {}
        self._lock = threading.Lock()
        self._prefetch = Prefetcher(self._build)
        self.description = (
            f"prepared: {shown} ({len(self.split):,} documents, {n:,} tokens, "
            f"{self.rows_per_epoch:,} rows an epoch, "
            f"{'packed with segment ids' if packed else 'not packed'})"
        )

    def batch(self, step: int, *, process_index: int = 0, process_count: int = 1):
        """This process's rows of the global batch of ``step``: int32 ``[B // P, seq_len + 1]``,
        or with packing ``{"tokens", "segments"}`` of that shape (``moe_train.data.packing``)."""
        step, lo, hi = self._rows(step, process_index, process_count)
        return self._prefetch.get(step, lo, hi)

    def close(self) -> None:
        """Stop the prefetch thread (later batches are computed on the spot)."""
        self._prefetch.close()

    def epoch(self, e: int) -> tuple[Stream, np.ndarray]:
        """(stream of epoch ``e``'s document order, its row order); the last two are kept."""
        with self._lock:
            if e not in self._epochs:
                rng = np.random.default_rng([self.seed, e, _ORDER_TAG])
                order = rng.permutation(len(self.split))
                self._epochs[e] = (Stream(self.split, order), rng.permutation(self.rows_per_epoch))
                while len(self._epochs) > _EPOCHS_KEPT:
                    self._epochs.pop(next(iter(self._epochs)))
            return self._epochs[e]

    def _build(self, step: int, lo: int, hi: int):
        S, R = self.seq_len, self.rows_per_epoch
        epoch_of, row_of = np.divmod(step * self.batch_size + np.arange(lo, hi, dtype=np.int64), R)
        tokens = np.empty((hi - lo, S + 1), np.int32)
        segments = np.empty_like(tokens)
        for e in np.unique(epoch_of):
            stream, row_order = self.epoch(int(e))
            sel = epoch_of == e
            tokens[sel], segments[sel] = stream.rows(row_order[row_of[sel]] * S, S + 1)
        top = int(tokens.max(initial=0))
        if top >= self.vocab_size:
            raise DataError(
                f"{self.split.root}: token id {top:,} in the batch of step {step} is "
                f">= model.vocab_size={self.vocab_size:,} (a damaged shard? run "
                f"open_split(..., verify=True))"
            )
        return packing.make(tokens, segments if self.packed else None)


def val_rows(path: str, *, vocab_size: int, seq_len: int, rows: int, packed: bool):
    """The first ``rows`` rows of the val split (document order), padded past its end, and
    how many real rows it has; a DataError where there is no (or an empty) val split."""
    root, shown = resolve_dir(path)
    splits = read_manifest(root)["splits"]
    if not splits.get("val", {}).get("documents"):
        raise DataError(
            f"train.eval_every needs held-out data but data.path={shown} has no "
            f"val split; prepare it with --val-fraction or --val-docs, or set "
            f"train.eval_every=0"
        )
    split, _ = open_checked(path, "val", vocab_size)
    stream = Stream(split, np.arange(len(split)))
    tokens, segments = stream.rows(np.arange(rows, dtype=np.int64) * seq_len, seq_len + 1)
    real = min(rows, -(-(stream.total - 1) // seq_len))
    return packing.make(tokens, segments if packed else None), real, shown
