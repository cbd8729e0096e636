"""Shard files of a prepared split: written atomically, found again on a rerun.

A split directory (``DIR/train``, ``DIR/val``) holds ``shard_00000.bin``, ``shard_00001.bin``, ...:
raw little-endian token ids (``uint16`` or ``uint32``), whole documents each, EOS after every
document. Next to each, ``shard_00000.idx.npy`` is an int64 array of the shard's document start
offsets (in tokens) followed by its token count, so document ``d`` is
``tokens[idx[d]:idx[d + 1]]`` and ends with EOS.

A shard is written under ``*.tmp`` names, flushed, fsynced and renamed: first the ``.bin``, then
the ``.idx.npy``. A shard is complete when its ``.idx.npy`` exists, loads, and its last entry
times the token size equals the ``.bin`` size; anything else (a ``.bin`` without an index, a
``*.tmp`` file) is an unfinished shard, removed by the next run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import re
import secrets
from pathlib import Path

import numpy as np

TMP = ".tmp"
_SHARD = re.compile(r"^shard_(\d{5,})(\.bin|\.idx\.npy)$")


def shard_name(k: int) -> str:
    return f"shard_{k:05d}"


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """A complete shard, as listed in the manifest."""

    name: str
    documents: int
    tokens: int
    sha256: str  # of the .bin
    idx_sha256: str

    def to_json(self, split: str) -> dict:
        return {
            "name": self.name,
            "bin": f"{split}/{self.name}.bin",
            "idx": f"{split}/{self.name}.idx.npy",
            "documents": self.documents,
            "tokens": self.tokens,
            "sha256": self.sha256,
            "idx_sha256": self.idx_sha256,
        }


def fsync_dir(path: Path, *, tolerant: bool = False) -> None:
    """fsync a folder (after a rename in it); ``tolerant``: an OSError is ignored (some file
    systems cannot fsync a directory; the rename itself is done)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if not tolerant:
            raise


def atomic_write(path: Path, data: bytes, *, tolerant: bool = False, unique: bool = False) -> None:
    """Write ``data`` to ``path`` through ``path.tmp``: fsync, rename, fsync the folder
    (``tolerant``: see ``fsync_dir``). ``unique``: the temporary name also holds the pid and a
    random part, for a file that several processes may write at once."""
    part = f".{os.getpid()}-{secrets.token_hex(4)}" if unique else ""
    tmp = path.with_name(path.name + part + TMP)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent, tolerant=tolerant)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def idx_bytes(starts: np.ndarray) -> bytes:
    """The ``.idx.npy`` file holding ``starts`` (document starts, then the token count)."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(starts, dtype="<i8"), allow_pickle=False)
    return buf.getvalue()


def load_index(path: Path) -> np.ndarray | None:
    """A shard's index, or None when it is missing or not a valid index."""
    try:
        idx = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if idx.dtype != np.dtype("<i8") or idx.ndim != 1 or idx.size < 2 or idx[0] != 0:
        return None
    if np.any(np.diff(idx) <= 0):
        return None
    return idx


def is_complete(split_dir: Path, name: str, dtype: np.dtype) -> bool:
    """Whether shard ``name`` is complete: a valid index whose token count matches the .bin."""
    idx = load_index(split_dir / f"{name}.idx.npy")
    bin_path = split_dir / f"{name}.bin"
    return (
        idx is not None
        and bin_path.is_file()
        and bin_path.stat().st_size == int(idx[-1]) * np.dtype(dtype).itemsize
    )


def complete_record(split_dir: Path, name: str, dtype: np.dtype) -> ShardRecord | None:
    """The record (with checksums) of shard ``name`` if it is complete, else None."""
    if not is_complete(split_dir, name, dtype):
        return None
    bin_path, idx_path = split_dir / f"{name}.bin", split_dir / f"{name}.idx.npy"
    idx = load_index(idx_path)
    assert idx is not None, "is_complete read it"
    return ShardRecord(name, int(idx.size - 1), int(idx[-1]), file_sha256(bin_path), file_sha256(idx_path))


def finished(split_dir: Path, dtype: np.dtype) -> list[ShardRecord]:
    """The complete shards ``0..k-1`` of a split; removes everything after them and ``*.tmp``."""
    records: list[ShardRecord] = []
    if not split_dir.is_dir():
        return records
    while (record := complete_record(split_dir, shard_name(len(records)), dtype)) is not None:
        records.append(record)
    for path in split_dir.iterdir():
        m = _SHARD.match(path.name)
        if path.name.endswith(TMP) or (m and int(m.group(1)) >= len(records)):
            path.unlink()
    return records


class ShardWriter:
    """Appends whole documents to a split's shards; starts a new shard before a document that
    would take a non-empty shard past ``shard_tokens`` tokens."""

    def __init__(self, split_dir: Path, dtype: np.dtype, shard_tokens: int, first: int = 0):
        self.dir, self.dtype, self.shard_tokens = split_dir, np.dtype(dtype), shard_tokens
        self.next_index = first
        self.records: list[ShardRecord] = []  # shards written by this writer
        self._file = None
        self._hasher = None
        self._starts: list[int] = []
        self._tokens = 0

    def _tmp(self, suffix: str) -> Path:
        return self.dir / f"{shard_name(self.next_index)}{suffix}{TMP}"

    def add(self, tokens: np.ndarray) -> None:
        """Append one document's tokens (EOS included)."""
        if self._file is not None and self._tokens + len(tokens) > self.shard_tokens:
            self.close_shard()
        if self._file is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self._tmp(".bin"), "wb")
            self._hasher = hashlib.sha256()
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        assert self._hasher is not None, "made with the file"
        self._file.write(data)
        self._hasher.update(data)
        self._starts.append(self._tokens)
        self._tokens += len(tokens)

    def close_shard(self) -> None:
        """Make the open shard complete: ``.bin`` then ``.idx.npy``, each fsynced and renamed."""
        if self._file is None:
            return
        name = shard_name(self.next_index)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self._tmp(".bin"), self.dir / f"{name}.bin")
        assert self._hasher is not None, "made with the file"
        index = idx_bytes(np.array(self._starts + [self._tokens], dtype="<i8"))
        atomic_write(self.dir / f"{name}.idx.npy", index)
        self.records.append(
            ShardRecord(
                name,
                len(self._starts),
                self._tokens,
                self._hasher.hexdigest(),
                hashlib.sha256(index).hexdigest(),
            )
        )
        self.next_index += 1
        self._starts, self._tokens = [], 0

    def abort(self) -> None:
        """Drop the open shard (after a failure): nothing half-written stays behind."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # closing flushes, which may fail again
                self._file.close()
            self._file = None
        self._tmp(".bin").unlink(missing_ok=True)
        self._tmp(".idx.npy").unlink(missing_ok=True)
