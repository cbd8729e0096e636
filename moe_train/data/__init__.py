"""Training batches: synthetic Markov text, pre-tokenised files, or raw UTF-8 bytes.

Every source answers ``batch(step)`` with an ``int32 [batch_size // process_count, seq_len + 1]``
array (packed prepared data: a dict of the token ids and their documents' segment ids, both of
that shape); the model reads ``inputs = b[:, :-1]`` and ``targets = b[:, 1:]``. A batch is a pure
function of ``(data.seed, step)``: the global batch of a step never changes, so a resumed run sees
exactly the batches it would have seen, and process ``p`` of ``P`` always gets rows
``[p*B/P, (p+1)*B/P)`` of it whatever ``P`` is.

Sources (``data.source``):

* ``synthetic``: walks of a fixed random sparse Markov chain over the vocabulary (each token has a
  few likely successors, plus a small chance of a uniform jump). Learnable: its entropy rate is
  about 1.5 nats per token at vocabulary 256, far below ``ln(vocab_size)``.
* ``tokens``: a flat file of ``uint16`` or ``uint32`` token ids (``data.token_dtype``), memory
  mapped; each row is a window of ``seq_len + 1`` tokens at a random offset.
* ``bytes``: any UTF-8 text file, one token per byte (vocabulary 256), windowed the same way.
* ``prepared``: the train split of a directory written by ``python -m moe_train.data prepare``:
  shuffled documents cut into rows, packed with segment ids unless ``data.packing=false``
  (``moe_train.data.packed``; such a batch is ``{"tokens", "segments"}``, ``moe_train.data.packing``).

Relative paths resolve against the working directory, then against the kit root (the folder
holding the ``moe_train`` package), so presets can name shipped files such as
``moe_train/assets/corpus.txt``. Problems with the data are raised as :class:`DataError`, a
one-line :class:`ConfigError`.

May import: ``moe_train.base`` (exit codes and the output error of ``python -m
moe_train.data``) and ``moe_train.config``; tokenizers, sentencepiece, pyarrow where a source
needs them. Never the model, the loop, the launcher or the planners (``moe_train.model``
imports ``packing`` from here, the loop the batch sources).
"""

from __future__ import annotations

import codecs
import dataclasses
import operator
from pathlib import Path

import numpy as np

from moe_train.config import DATA_SOURCES, TOKEN_DTYPES, ConfigError, DataConfig

KIT_ROOT = Path(__file__).resolve().parents[2]  # moe_train/data/__init__.py -> the kit root

# Files up to this size are fully validated when opened (token range, UTF-8); larger files have
# their first SCAN_LIMIT bytes checked at open, and every batch is range-checked regardless.
SCAN_LIMIT = 64 << 20
_CHUNK = 8 << 20

# Synthetic chain: successor probabilities (shared by all states; the successor sets differ)
# and the probability of a uniform jump to any token.
SYNTH_PROBS = (0.55, 0.25, 0.12, 0.08)
SYNTH_JUMP = 0.04
_TABLE_TAG = 0x5EED7AB1  # separates the chain table's random stream from the batches' streams


class DataError(ConfigError):
    """A user-facing problem with the training data (missing file, bad contents, bad split)."""


@dataclasses.dataclass(eq=False, repr=False, kw_only=True)
class Source:
    """Base of all sources: deterministic ``batch(step)`` and a one-line ``description``."""

    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int
    description = ""  # not a field: each source sets its own

    def batch(self, step: int, *, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """This process's rows of the global batch of ``step``: int32 ``[B // P, seq_len + 1]``."""
        step, lo, hi = self._rows(step, process_index, process_count)
        rng = np.random.default_rng([self.seed, step])
        out = self._generate(rng, lo, hi)
        return np.ascontiguousarray(out, dtype=np.int32)

    def _generate(self, rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
        raise NotImplementedError

    def _rows(self, step: int, process_index: int, process_count: int) -> tuple[int, int, int]:
        try:
            step, process_index, process_count = (
                operator.index(step),
                operator.index(process_index),
                operator.index(process_count),
            )
        except TypeError:
            raise DataError(
                f"batch(step={step!r}, process_index={process_index!r}, "
                f"process_count={process_count!r}) needs integers"
            ) from None
        if step < 0:
            raise DataError(f"batch step must be a non-negative integer, got {step!r}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise DataError(
                f"process_index={process_index} is not in 0..{process_count - 1} "
                f"(process_count={process_count})"
            )
        if self.batch_size % process_count:
            raise DataError(
                f"train.batch_size={self.batch_size} is not divisible by the "
                f"{process_count} processes; use a multiple of {process_count}"
            )
        rows = self.batch_size // process_count
        return step, process_index * rows, (process_index + 1) * rows

    def close(self) -> None:
        """Release what the source holds (a prefetch thread); a no-op for most."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.description}>"


class SyntheticSource(Source):
    """Walks of a fixed sparse Markov chain built from the seed: learnable, not noise."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        v = self.vocab_size
        k = len(SYNTH_PROBS)
        table_rng = np.random.default_rng([self.seed, v, _TABLE_TAG])
        # k distinct successors per token (for tiny vocabularies, with repeats).
        if k <= v <= 64:
            succ = np.argsort(table_rng.random((v, v)), axis=1)[:, :k]
        elif v > 64:
            succ = _distinct_rows(table_rng, v, k)
        else:
            succ = table_rng.integers(0, v, size=(v, k))
        # Column k is the jump column: its successor is 0 and the jump target is added.
        self._succ = np.concatenate([succ, np.zeros((v, 1), succ.dtype)], axis=1).astype(np.int64)
        self._succ_flat = self._succ.reshape(-1)
        probs = np.asarray(SYNTH_PROBS) * (1.0 - SYNTH_JUMP)
        self._cdf = np.cumsum(probs)  # edges of the k successor buckets; the rest is a jump
        self.description = (
            f"synthetic: Markov chain over {v:,} tokens, {k} likely successors "
            f"each + {SYNTH_JUMP:.0%} jumps, seed {self.seed}"
        )

    def entropy_rate(self) -> float:
        """Nats per token of the chain (an upper bound when successors repeat)."""
        p = np.append(np.asarray(SYNTH_PROBS) * (1 - SYNTH_JUMP), SYNTH_JUMP)
        return float(-(p * np.log(p)).sum() + SYNTH_JUMP * np.log(self.vocab_size))

    def _generate(self, rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
        b, length, v = self.batch_size, self.seq_len + 1, self.vocab_size
        first = rng.integers(0, v, size=b)[lo:hi]
        u = rng.random((length - 1, b))[:, lo:hi]  # drawn for the global batch, then sliced
        bucket = np.zeros(u.shape, np.int64)  # 0..k-1: that successor; k: a uniform jump
        for edge in self._cdf:
            bucket += u >= edge
        c = self._cdf[-1]
        jumps = u >= c
        jump = np.zeros(u.shape, np.int64)  # the jump target, reusing u's uniform tail
        jump[jumps] = np.minimum(((u[jumps] - c) * (v / (1.0 - c))).astype(np.int64), v - 1)
        width = self._succ.shape[1]
        out = np.empty((length, hi - lo), dtype=np.int64)
        out[0] = first
        flat = self._succ_flat
        for t in range(1, length):
            np.add(flat[out[t - 1] * width + bucket[t - 1]], jump[t - 1], out=out[t])
        return out.T


def _distinct_rows(rng: np.random.Generator, v: int, k: int) -> np.ndarray:
    """``[v, k]`` successors, distinct within each row, for large vocabularies."""
    succ = rng.integers(0, v, size=(v, k))
    for _ in range(100):
        s = np.sort(succ, axis=1)
        dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if not dup.any():
            break
        succ[dup] = rng.integers(0, v, size=(int(dup.sum()), k))
    return succ


class _WindowSource(Source):
    """Random windows of ``seq_len + 1`` tokens from a memory-mapped flat array."""

    kind = ""

    def __init__(self, path: Path, shown: str, dtype: np.dtype, **kw) -> None:
        super().__init__(**kw)
        self.path = path
        self.dtype = np.dtype(dtype)
        size = path.stat().st_size
        what = self._expected()
        if size % self.dtype.itemsize:
            raise DataError(
                f"{shown}: {size:,} bytes is not a whole number of {self.dtype.name} tokens; expected {what}"
            )
        self.num_tokens = size // self.dtype.itemsize
        need = self.seq_len + 1
        if self.num_tokens < need:
            raise DataError(
                f"{shown}: only {self.num_tokens:,} tokens, shorter than "
                f"train.seq_len + 1 = {need}; expected {what} of at least "
                f"{need} tokens"
            )
        self._data = np.memmap(path, dtype=self.dtype, mode="r")
        self._shown = shown
        self.description = f"{self.kind}: {shown} ({self.num_tokens:,} tokens)"
        self._check_file()

    def _expected(self) -> str:
        raise NotImplementedError

    def _check_file(self) -> None:
        pass

    def _generate(self, rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
        length = self.seq_len + 1
        starts = rng.integers(0, self.num_tokens - length + 1, size=self.batch_size)[lo:hi]
        if len(starts) * length <= 1 << 16:
            win = np.stack([self._data[s : s + length] for s in starts])
        else:
            win = self._data[starts[:, None] + np.arange(length)]
        win = np.asarray(win)
        if win.size and int(win.max()) >= self.vocab_size:
            row, col = np.unravel_index(int(win.argmax()), win.shape)
            self._bad_id(int(win.max()), int(starts[row]) + int(col))
        return win

    def _bad_id(self, value: int, index: int) -> None:
        raise DataError(
            f"{self._shown}: token id {value:,} at token {index:,} is >= "
            f"model.vocab_size={self.vocab_size:,}; expected {self._expected()} "
            f"with ids below {self.vocab_size:,}"
        )


class TokensSource(_WindowSource):
    kind = "tokens"

    def _expected(self) -> str:
        return f"a flat {self.dtype.name} token file (data.token_dtype={self.dtype.name})"

    def _check_file(self) -> None:
        # Full scan of small files at open; larger ones are checked batch by batch.
        if self.num_tokens * self.dtype.itemsize > SCAN_LIMIT:
            return
        step = _CHUNK // self.dtype.itemsize
        for lo in range(0, self.num_tokens, step):
            chunk = self._data[lo : lo + step]
            top = int(chunk.max())
            if top >= self.vocab_size:
                self._bad_id(top, lo + int(np.argmax(chunk >= self.vocab_size)))


class BytesSource(_WindowSource):
    kind = "bytes"

    def _expected(self) -> str:
        return "a UTF-8 text file (data.source=bytes trains on its bytes)"

    def _check_file(self) -> None:
        # Decode the file (the first SCAN_LIMIT bytes of a larger one) as UTF-8.
        decoder = codecs.getincrementaldecoder("utf-8")()
        limit = min(self.num_tokens, SCAN_LIMIT)
        for lo in range(0, limit, _CHUNK):
            hi = min(lo + _CHUNK, limit)
            pending = len(decoder.getstate()[0])  # bytes of a character split across chunks
            try:
                decoder.decode(self._data[lo:hi].tobytes(), final=hi == self.num_tokens)
            except UnicodeDecodeError as e:
                at = lo - pending + e.start
                raise DataError(
                    f"{self._shown}: not UTF-8 text (invalid byte "
                    f"0x{self._data[max(at, 0)]:02x} near byte {max(at, 0):,}); "
                    f"expected {self._expected()}"
                ) from None


def resolve_path(
    path: str, what: str = "file", *, directory: bool = False, empty: str = "", key: str = "data.path"
) -> tuple[Path, str]:
    """The file (or, with ``directory``, the directory) ``path`` names, and how to show it:
    cwd first, then the kit root. ``empty``: the message when ``path`` is empty; ``key``: what
    the user set (``data.path``, or a command's ``--data``), named in the errors."""
    if not path:
        raise DataError(empty or f"{key} is empty; expected the path of {what}")
    p = Path(path).expanduser()
    tried = [p] if p.is_absolute() else list(dict.fromkeys([Path.cwd() / p, KIT_ROOT / p]))
    kind = "a directory" if directory else "a regular file"
    for i, cand in enumerate(tried):
        if cand.is_dir() if directory else cand.is_file():
            return cand, (str(cand) if i else str(path))
        if cand.exists():
            where = "" if str(cand) == path else f" ({cand})"
            raise DataError(f"{key} {path}{where} is not {kind}; expected {what}")
    looked = "" if tried == [p] and str(p) == path else " (looked in " + " and ".join(map(str, tried)) + ")"
    raise DataError(f"{key} {path} not found{looked}; expected {what}")


def make_source(data_cfg: DataConfig, *, vocab_size: int, seq_len: int, batch_size: int) -> Source:
    """The training batch source that ``data_cfg`` describes."""
    for key, value in (
        ("model.vocab_size", vocab_size),
        ("train.seq_len", seq_len),
        ("train.batch_size", batch_size),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise DataError(f"{key} must be a positive integer, got {value!r}")
    seed = data_cfg.seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"data.seed must be a non-negative integer, got {seed!r}")
    kw = dict(vocab_size=int(vocab_size), seq_len=int(seq_len), batch_size=int(batch_size), seed=int(seed))
    source = data_cfg.source
    if source == "synthetic":
        return SyntheticSource(**kw)
    if source == "tokens":
        if data_cfg.token_dtype not in TOKEN_DTYPES:
            raise DataError(
                f"data.token_dtype={data_cfg.token_dtype!r} is not valid; "
                f"choose one of: {', '.join(TOKEN_DTYPES)}"
            )
        dtype = np.dtype(data_cfg.token_dtype)
        path, shown = resolve_path(data_cfg.path, f"a flat {dtype.name} token file")
        return TokensSource(path, shown, dtype, **kw)
    if source == "bytes":
        if vocab_size < 256:
            raise DataError(f"data.source=bytes needs model.vocab_size >= 256, got {vocab_size}")
        path, shown = resolve_path(data_cfg.path, "a UTF-8 text file")
        return BytesSource(path, shown, np.dtype(np.uint8), **kw)
    if source == "prepared":
        from moe_train.data.packed import PreparedSource  # imports this module

        return PreparedSource(data_cfg.path, bool(data_cfg.packing), **kw)
    raise DataError(f"data.source={source!r} is not valid; choose one of: {', '.join(DATA_SOURCES)}")
