"""Hugging Face checkpoint files: ``config.json`` and safetensors shards, read tensor by tensor
and written in the hub's sharded layout.

Reading: a directory holds ``model.safetensors`` or several ``*.safetensors`` shards, with or
without ``model.safetensors.index.json`` (its ``weight_map`` names each tensor's file; without
it every shard's header is read once). A tensor is read on its own (the shard is memory-mapped,
so reading one tensor costs that tensor). fp8 tensors (``F8_E4M3``, DeepSeek-V3's released
weights) come with ``<name>_scale_inv``, one fp32 scale per 128 x 128 block (the config's
``quantization_config.weight_block_size``); ``tensor`` returns them dequantized to fp32:
``w * scale_inv`` blockwise. The safetensors library reads every other dtype; its NumPy
reader cannot hold fp8, so fp8 tensors are read from the file's own header and offsets.

Writing: ``write_shards`` fills ``model-00001-of-0000N.safetensors`` files up to a size limit
in the order given and writes ``model.safetensors.index.json`` (``metadata.total_size`` and the
``weight_map``), the layout ``transformers``' ``save_pretrained`` writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from moe_train.config import ConfigError

INDEX = "model.safetensors.index.json"
FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
SCALE_SUFFIX = "_scale_inv"


def read_config(hf_dir: Path) -> dict:
    """``config.json`` of ``hf_dir`` (ConfigError if missing or not JSON)."""
    path = hf_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: not found (a Hugging Face checkpoint directory has config.json and *.safetensors)"
        ) from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None


def _header(path: Path) -> tuple[dict, int]:
    """(the safetensors header of ``path``, the byte offset where its data starts)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConfigError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, MemoryError, OverflowError):
            raise ConfigError(f"{path}: not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: not a safetensors file (bad header)")
    ends = [
        e["data_offsets"][1]
        for k, e in header.items()
        if k != "__metadata__" and isinstance(e, dict) and len(e.get("data_offsets", ())) == 2
    ]
    size, need = path.stat().st_size, 8 + n + max(ends, default=0)
    if size < need:  # an interrupted download or copy
        raise ConfigError(
            f"{path}: truncated: its header needs {need:,} bytes, the file has {size:,}; download it again"
        )
    return header, 8 + n


class HFCheckpoint:
    """The tensors of a Hugging Face checkpoint directory, by name."""

    def __init__(self, hf_dir: Path, block: tuple[int, ...] = (128, 128)):
        self.dir, self.block = Path(hf_dir), block
        self.files: dict[str, Path] = {}  # tensor -> shard
        self.headers: dict[Path, tuple[dict, int]] = {}
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{index}: not a safetensors index (no weight_map)") from None
            self.files = {name: self.dir / file for name, file in weight_map.items()}
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise ConfigError(f"{self.dir}: no *.safetensors files")
            for shard in shards:
                for name in self._header_of(shard)[0]:
                    if name != "__metadata__":
                        self.files[name] = shard

    def _header_of(self, shard: Path) -> tuple[dict, int]:
        if shard not in self.headers:
            if not shard.is_file():
                why = f"named by {INDEX} but missing" if (self.dir / INDEX).is_file() else "not a file"
                raise ConfigError(f"{shard}: {why}")
            self.headers[shard] = _header(shard)
        return self.headers[shard]

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def _entry(self, name: str) -> dict:
        if name not in self.files:
            raise ConfigError(f"{self.dir}: tensor {name} is missing")
        header, _ = self._header_of(self.files[name])
        if name not in header:
            raise ConfigError(f"{self.files[name]}: tensor {name} is missing (the index names this file)")
        return header[name]

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name`` as stored (bf16 as ml_dtypes.bfloat16, fp8 as float8)."""
        entry, shard = self._entry(name), self.files[name]
        if entry["dtype"] in FP8_DTYPES:
            _, start = self._header_of(shard)
            lo, hi = entry["data_offsets"]
            data = np.memmap(shard, np.uint8, mode="r", offset=start + lo, shape=(hi - lo,))
            return np.array(data).view(FP8_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        with safe_open(shard, framework="np") as f:
            return f.get_tensor(name)

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name``; fp8 dequantized to fp32 with its block scales."""
        w = self.raw(name)
        if w.dtype not in FP8_DTYPES.values():
            return w
        scales = self.raw(name + SCALE_SUFFIX) if name + SCALE_SUFFIX in self.files else None
        if scales is None:
            raise ConfigError(f"{self.dir}: fp8 tensor {name} has no {name}{SCALE_SUFFIX}")
        return dequantize(w, scales.astype(np.float32), self.block, name)


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, ...], name: str) -> np.ndarray:
    """fp32 ``w * scale_inv`` where ``scale_inv[i, j]`` covers the block rows
    ``i*b0:(i+1)*b0``, columns ``j*b1:(j+1)*b1`` (the last blocks may be partial)."""
    rows, cols = w.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if scale_inv.shape != want:
        raise ConfigError(
            f"{name}{SCALE_SUFFIX}: shape {scale_inv.shape}, expected {want} "
            f"for a {w.shape} weight in {block[0]}x{block[1]} blocks"
        )
    full = np.repeat(np.repeat(scale_inv, block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return w.astype(np.float32) * full


def write_shards(out_dir: Path, tensors: Iterable[tuple[str, np.ndarray]], max_bytes: int) -> dict:
    """Write ``(name, array)`` pairs into shards of at most ``max_bytes`` (one tensor larger
    than that gets a shard of its own) and the index; returns the index. One shard is in
    memory at a time: each is written as soon as it is full, under a temporary name, and
    renamed once the count is known."""
    written: list[tuple[Path, list[str]]] = []
    sizes: dict[str, int] = {}
    for i, shard in enumerate(_fill(tensors, max_bytes), start=1):
        tmp = out_dir / f"model-{i:05d}.partial.safetensors"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        written.append((tmp, list(shard)))
        sizes.update({k: v.nbytes for k, v in shard.items()})
    weight_map = {}
    for i, (tmp, names) in enumerate(written, start=1):
        final = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        tmp.rename(out_dir / final)
        weight_map.update({name: final for name in names})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return index


def _fill(tensors: Iterable[tuple[str, np.ndarray]], max_bytes: int) -> Iterator[dict]:
    shard, size = {}, 0
    for name, array in tensors:
        if shard and size + array.nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = np.ascontiguousarray(array)
        size += array.nbytes
    if shard:
        yield shard


@contextlib.contextmanager
def new_directory(out: Path, what: str) -> Iterator[Path]:
    """A temporary sibling ``.OUT.partial-<pid>`` to write into, renamed to ``out`` when the
    block ends and removed if it raises: ``out`` appears complete or not at all. ``out``
    must not exist or be empty (ConfigError naming ``what`` otherwise). Every file and
    directory in it gets the mode the umask gives (``umask_modes``)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory; choose a new {what}")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        umask_modes(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def current_umask() -> int:
    """The process's umask (read by setting it, then set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_modes(root: Path) -> None:
    """Every file under ``root`` 0666 and every directory 0777, less the umask (0644 and
    0755 under umask 022), as ``open`` and ``mkdir`` make them: the safetensors writer makes
    its files 0600 and the JSON files are made 0644, so an export had two modes."""
    mask = current_umask()
    for parent, _, files in os.walk(root):
        os.chmod(parent, 0o777 & ~mask)
        for name in files:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)
