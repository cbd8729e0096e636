"""Reading a corpus prepared by ``python -m moe_train.data prepare``.

    split = open_split("corpus/", "train")
    split.eos_id, split.vocab_size, split.dtype
    len(split)                 # documents
    split.tokens[i:j]          # token ids across shard boundaries (a copy only when crossing one)
    split.doc_starts           # int64: start of every document in split.tokens, then the total
    split.document(d)          # the ids of document d, ending with EOS
    split.shards               # one read-only np.memmap per shard file

Opening checks the manifest against the files: every shard present, its size, index and
sha256 agree with the manifest. The sha256 is computed the first time a file is opened and
remembered next to the corpus by size, mtime and inode (``moe_train.data.verify``), so later
opens pay a ``stat``; ``verify=True`` hashes regardless, ``verify=False`` checks sizes only.
Problems are one-line :class:`~moe_train.data.DataError` messages naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moe_train.data import DataError
from moe_train.data import shards as shards_mod
from moe_train.data import verify as verify_mod

FORMAT = "moe_train.prepared"
FORMAT_VERSION = 1


class Tokens:
    """The concatenation of a split's shards, indexable like a 1-D array without copying them."""

    def __init__(self, parts: list[np.ndarray], dtype: np.dtype):
        self._parts = parts
        self.dtype = np.dtype(dtype)
        self._offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts], dtype=np.int64)])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                return self[start:stop][::step]
            return self._range(start, max(start, stop))
        i = int(key) + n if int(key) < 0 else int(key)
        if not 0 <= i < n:
            raise IndexError(f"token index {key} out of range for {n:,} tokens")
        k = int(np.searchsorted(self._offsets, i, side="right")) - 1
        return self._parts[k][i - self._offsets[k]]

    def _range(self, start: int, stop: int) -> np.ndarray:
        if start == stop:
            return np.empty(0, self.dtype)
        first = int(np.searchsorted(self._offsets, start, side="right")) - 1
        last = int(np.searchsorted(self._offsets, stop - 1, side="right")) - 1
        pieces = [
            self._parts[k][max(start - self._offsets[k], 0) : stop - self._offsets[k]]
            for k in range(first, last + 1)
        ]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class Split:
    """One split (``train`` or ``val``) of a prepared directory."""

    def __init__(
        self, root: Path, name: str, manifest: dict, shards: list[np.ndarray], doc_starts: np.ndarray
    ):
        self.root, self.name, self.manifest = root, name, manifest
        self.eos_id = int(manifest["eos_id"])
        self.vocab_size = int(manifest["vocab_size"])
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self.shards = shards
        self.tokens = Tokens(shards, self.dtype)
        self.doc_starts = doc_starts

    def __len__(self) -> int:
        return len(self.doc_starts) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.doc_starts[-1])

    def document(self, d: int) -> np.ndarray:
        """The token ids of document ``d`` (counting from 0 within the split), EOS last."""
        if not 0 <= d < len(self):
            raise IndexError(f"document {d} out of range for {len(self):,} documents")
        return self.tokens[int(self.doc_starts[d]) : int(self.doc_starts[d + 1])]

    def __repr__(self) -> str:
        return (
            f"<Split {self.name} of {self.root}: {len(self):,} documents, "
            f"{self.num_tokens:,} {self.dtype.name} tokens in {len(self.shards)} shards>"
        )


def read_manifest(root: str | Path) -> dict:
    """``root/manifest.json``, checked to be a prepared corpus of a format this code reads."""
    path = Path(root) / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(
            f"{path} not found: {root} is not a finished prepared corpus (run "
            f"python -m moe_train.data prepare, or rerun it to finish)"
        ) from None
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a manifest of python -m moe_train.data prepare")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: format version {manifest.get('format_version')!r}; this kit "
            f"reads version {FORMAT_VERSION}; prepare the corpus again"
        )
    return manifest


def _open_shard(root: Path, entry: dict, dtype: np.dtype):
    """(memmap of the shard's tokens, its index) after checking their sizes against ``entry``."""
    bin_path, idx_path = root / entry["bin"], root / entry["idx"]
    idx = shards_mod.load_index(idx_path)
    if idx is None:
        raise DataError(f"{idx_path}: missing or not a shard index; prepare the corpus again")
    size = bin_path.stat().st_size if bin_path.is_file() else -1
    if (
        size != entry["tokens"] * dtype.itemsize
        or int(idx[-1]) != entry["tokens"]
        or idx.size - 1 != entry["documents"]
    ):
        raise DataError(
            f"{bin_path}: does not match the manifest ({entry['tokens']:,} tokens, "
            f"{entry['documents']:,} documents expected); prepare the corpus again"
        )
    return np.memmap(bin_path, dtype=dtype, mode="r"), idx


def open_split(root: str | Path, name: str = "train", *, verify: bool | str = "cached") -> Split:
    """Split ``name`` of the prepared corpus in ``root`` (memory-mapped, read-only), every
    shard checked against the manifest: ``verify="cached"`` (the default) its sha256 unless
    ``moe_train.data.verify``'s cache holds the file at this size, mtime and inode, ``True`` its
    sha256 always, ``False`` its size only. A shard that fails is a DataError naming it."""
    root = Path(root)
    manifest = read_manifest(root)
    if name not in manifest["splits"]:
        raise DataError(f"{root}: no split {name!r} (splits: {', '.join(manifest['splits'])})")
    if verify not in (True, False, "cached"):
        raise ValueError(f"verify must be True, False or 'cached', not {verify!r}")
    if verify:
        bad = verify_mod.check(root, manifest, [name], trust_cache=verify == "cached")
        if bad:
            raise DataError(
                f"{verify_mod.describe(bad)}; rerun the python -m "
                f"moe_train.data prepare command of {root} to rebuild it"
            )
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    parts, starts, offset = [], [], 0
    for entry in manifest["splits"][name]["files"]:
        tokens, idx = _open_shard(root, entry, dtype)
        parts.append(tokens)
        starts.append(idx[:-1] + offset)
        offset += int(idx[-1])
    doc_starts = np.concatenate(starts + [np.array([offset], np.int64)]).astype(np.int64)
    return Split(root, name, manifest, parts, doc_starts)
