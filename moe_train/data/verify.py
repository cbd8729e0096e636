"""Checking a prepared corpus's shards against its manifest, paying for each sha256 once.

``check(root, manifest, splits)`` compares every shard file of ``splits`` that the manifest
lists (each ``.bin`` and ``.idx.npy``) with it: present, the size it implies, then the sha256
it records. It returns the files that fail, as :class:`Bad` (split, shard, path, why).

The sha256 of a large corpus takes minutes (about 1 s per GB), so a file that matched is
remembered in ``ROOT/verified.json``: its size, its mtime (ns), its inode and the sha256 it
matched. A later check of the same file with the same size, mtime and inode pays only a
``stat``; a write to the file changes its mtime, and a copy of the corpus (even one that keeps
mtimes and takes ``verified.json`` along) has new inodes, so either is hashed again.
``trust_cache=False`` hashes every file (``prepare`` on an existing directory does) and
records the result. The cache is written atomically (a unique
temporary name, fsync, rename) and merged under a lock on ``ROOT/verified.lock``, so the
processes of one run that open the corpus together hash it once: the first holds the lock
while it hashes, the others then find the files recorded. Where ``ROOT`` cannot be written
(a read-only corpus) nothing is locked or recorded and every check hashes the files, silently;
a ``verified.json`` that a writer (``prepare``) left there is still used. An unreadable or
malformed cache is ignored and rewritten.

What the cache cannot see: a change in place that keeps the size and restores the mtime
(``touch -r``), or one made within the file system's mtime granularity of the check that
recorded it.
``open_split(..., verify=True)`` or ``prepare`` hashes regardless.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moe_train.data import shards

CACHE, LOCK = "verified.json", "verified.lock"
FORMAT = "moe_train.verified"


@dataclasses.dataclass(frozen=True)
class Bad:
    """A shard file that does not match the manifest."""

    split: str
    shard: int  # index in the split's manifest list
    path: Path
    why: str


@dataclasses.dataclass(frozen=True)
class _File:
    split: str
    shard: int
    rel: str  # path relative to the corpus root, as the manifest names it
    sha256: str
    size: int | None  # the size the manifest implies (None: not implied, the index)


def _files(manifest: dict, splits) -> list[_File]:
    itemsize = np.dtype(manifest["dtype"]).itemsize
    out = []
    for name in splits:
        for k, e in enumerate(manifest["splits"][name]["files"]):
            out.append(_File(name, k, e["bin"], e["sha256"], int(e["tokens"]) * itemsize))
            out.append(_File(name, k, e["idx"], e["idx_sha256"], None))
    return out


def _entry(st: os.stat_result, sha256: str) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "sha256": sha256}


def _check_one(root: Path, f: _File, cache: dict, seen: dict) -> Bad | None:
    """None when ``f`` matches (recording it in ``seen``), else why not."""
    path = root / f.rel
    try:
        st = path.stat()
    except OSError:
        return Bad(f.split, f.shard, path, "missing")
    if f.size is not None and st.st_size != f.size:
        return Bad(
            f.split, f.shard, path, f"does not match the manifest ({st.st_size:,} bytes, {f.size:,} expected)"
        )
    if cache.get(f.rel) == _entry(st, f.sha256):
        seen[f.rel] = cache[f.rel]
        return None
    try:
        digest = shards.file_sha256(path)
    except OSError as err:
        return Bad(f.split, f.shard, path, f"unreadable ({err.strerror or err})")
    if digest != f.sha256:
        return Bad(f.split, f.shard, path, "sha256 differs from the manifest (changed in place or corrupted)")
    seen[f.rel] = _entry(st, f.sha256)
    return None


def check(root: str | Path, manifest: dict, splits, *, trust_cache: bool = True) -> list[Bad]:
    """The shard files of ``splits`` that do not match ``manifest`` (none: all verified);
    those that match are recorded in the cache (see the module docstring)."""
    root = Path(root)
    with _locked(root):
        cache = _load(root)
        seen: dict[str, dict] = {}
        bad = [
            b
            for f in _files(manifest, splits)
            if (b := _check_one(root, f, cache if trust_cache else {}, seen)) is not None
        ]
        failed = {str(b.path.relative_to(root)) for b in bad}
        listed = {f.rel for f in _files(manifest, manifest["splits"])}
        merged = {k: v for k, v in {**cache, **seen}.items() if k in listed and k not in failed}
        if merged != cache:
            _save(root, merged)
    return bad


def _load(root: Path) -> dict[str, dict]:
    """The cache's entries; {} when it is missing, unreadable or not a cache."""
    try:
        data = json.loads((root / CACHE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(v, dict)}


def _save(root: Path, files: dict[str, dict]) -> None:
    """Write the cache; a directory that cannot be written keeps none (no error)."""
    data = json.dumps({"format": FORMAT, "files": dict(sorted(files.items()))}, indent=1)
    with contextlib.suppress(OSError):
        shards.atomic_write(root / CACHE, (data + "\n").encode("utf-8"), tolerant=True, unique=True)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``root/verified.lock`` while checking; without one where the
    file cannot be opened for writing (read-only corpus) or the file system refuses locks."""
    try:
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        fd = None
    try:
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def describe(bad: list[Bad]) -> str:
    """One line naming the first failing file and how many more there are."""
    more = f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""
    return f"{bad[0].path}: {bad[0].why}{more}"
