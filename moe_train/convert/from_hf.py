"""``from-hf``: a Hugging Face checkpoint directory -> the kit's converted checkpoint.

``OUT/preset.toml`` is the kit's config of the model (each value with the ``config.json`` key
it came from), ``OUT/weights/<part>/`` orbax checkpoints ``{"params", "moe_state"}`` in the
looped layer layout, one per layer (``moe_train.convert.weights`` reads them into any layout and
device count), each with its manifest (``<part>/manifest/metadata``: every array's shape, dtype,
checksums and finiteness, ``moe_train.checkpoints.manifest``, as a run's checkpoint has; every reader
verifies the weights against it), and ``OUT/convert.json`` what it was made from. Weights keep
the source's dtype (bf16 or fp32; fp8 is dequantized with its block scales to bf16, as
DeepSeek's own fp8-to-bf16 script does); the expert bias is fp32.

Several processes (``workers``) may split the layers between them; each holds about one layer.

Streaming: every tensor's presence and shape are checked from the shard headers before
anything is read; every value is checked finite as its tensor is read (a NaN or inf, as stored
or after narrowing, is a ConfigError naming the tensor and its file). Then, layer by layer,
each kit leaf is assembled in a memory-mapped file (a
stacked expert leaf one expert at a time) and orbax writes the layer from those files: orbax
holds what it writes in memory until the save ends, so the process holds about one layer,
not the model (``tests/test_convert.py`` measures it). Everything is written
under ``OUT``'s sibling ``.OUT.partial-<pid>`` and renamed to ``OUT`` at the end: a failure
leaves no ``OUT``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import multiprocessing
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from moe_train import config
from moe_train.checkpoints import checkpoint, manifest
from moe_train.config import Config, ConfigError
from moe_train.config.checks import first_few
from moe_train.convert import fields
from moe_train.convert.families import Family, family_of, kit_tables
from moe_train.convert.hf_files import (
    FP8_DTYPES,
    SCALE_SUFFIX,
    HFCheckpoint,
    new_directory,
    read_config,
)
from moe_train.convert.tensors import Entry, entries, extra_copies
from moe_train.convert.weights import PRESET, WEIGHTS, part_of
from moe_train.model.settings import model_settings
from moe_train.model.transformer import Transformer

IGNORED = re.compile(r".*(rotary_emb\.inv_freq|" + re.escape(SCALE_SUFFIX) + r")$")
SECTIONS = ("model", "moe", "rope", "train")


def looped_tree(cfg: Config) -> dict:
    """Abstract {"params", "moe_state"} of ``cfg`` in the looped layout."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False))
    tokens = jnp.zeros((1, 8), jnp.int32)
    v = jax.eval_shape(lambda k: Transformer(model_settings(cfg)).init(k, tokens), jax.random.key(0))
    return {"params": nn.unbox(v["params"]), "moe_state": v.get("moe_state", {})}


def plan(hf_dir: Path) -> tuple[Family, dict, Config, dict, HFCheckpoint, list[Entry]]:
    """Everything but the data: (family, config.json, kit config, value sources, files,
    entries), with every tensor checked for presence and shape; ConfigError otherwise."""
    hf = read_config(hf_dir)
    fam = family_of(hf)
    fields.check(fam.name, hf)  # the config's errors before any file is opened
    quant = hf.get("quantization_config") or {}
    ckpt = HFCheckpoint(hf_dir, tuple(quant.get("weight_block_size") or (128, 128)))
    mtp_prefix = f"model.layers.{hf.get('num_hidden_layers')}."
    mtp = fam.name == "deepseek_v3" and any(n.startswith(mtp_prefix) for n in ckpt.names())
    tables, sources = kit_tables(fam, hf, mtp=mtp)
    try:
        cfg = config.apply_tables(config.Config(), tables)
        config.validate(cfg)
    except ConfigError as err:
        raise ConfigError(f"config.json gives a config the kit refuses: {err}") from None
    ents = entries(fam, cfg, looped_tree(cfg))
    _check_tensors(ckpt, ents, cfg)
    return fam, hf, cfg, sources, ckpt, ents


def _check_tensors(ckpt: HFCheckpoint, ents: list[Entry], cfg: Config) -> None:
    used = {name for e in ents for name in e.hf} | {n for n, _ in extra_copies(cfg)}
    for e in ents:
        for name, want in zip(e.hf, e.hf_shapes()):
            got = ckpt.shape(name)  # ConfigError when missing
            if got != tuple(want):
                raise ConfigError(
                    f"{ckpt.dir}: tensor {name} has shape {list(got)}, the config needs {list(want)}"
                )
    unused = sorted(n for n in ckpt.names() - used if not IGNORED.fullmatch(n))
    if unused:
        raise ConfigError(
            f"{ckpt.dir}: tensor {unused[0]} is not used by the converted "
            f"model ({first_few(unused[1:], 2)}); unsupported feature?"
        )


def _dtype_of(ckpt: HFCheckpoint, e: Entry):
    """The stored dtype of leaf ``e``: its source's, bf16 for dequantized fp8, fp32 bias."""
    if not e.hf:
        return np.dtype(np.float32)
    stored = ckpt._entry(e.hf[0])["dtype"]
    if stored in FP8_DTYPES or stored == "BF16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"F32": np.float32, "F16": np.float32, "F64": np.float32}.get(stored, np.float32))


def _read(ckpt: HFCheckpoint, name: str, dtype: np.dtype) -> np.ndarray:
    """HF tensor ``name`` in ``dtype``; ConfigError naming it and its file when a value is NaN
    or inf, as stored (or dequantized) or after narrowing to ``dtype``. One pass over the
    tensor, while it is in memory anyway."""
    source = ckpt.tensor(name)
    with np.errstate(over="ignore"):  # an overflow is reported below, as an error
        x = source.astype(dtype)
    bad = x.size - int(np.count_nonzero(np.isfinite(x)))
    if bad:
        what = (
            "non-finite (NaN or inf)"
            if not np.isfinite(source).all()
            else f"beyond the range of {dtype.name}"
        )
        raise ConfigError(
            f"{ckpt.files[name]}: tensor {name} has {bad:,} of {x.size:,} values "
            f"{what}; the weights are damaged, refusing to convert them"
        )
    return x


def _assemble(ckpt: HFCheckpoint, e: Entry, path: Path) -> np.ndarray:
    """Leaf ``e`` in a memory-mapped file at ``path``, one HF tensor in memory at a time,
    every value checked finite (``_read``)."""
    dtype = _dtype_of(ckpt, e)
    out = np.memmap(path, dtype=dtype, mode="w+", shape=e.shape)  # raw: .npy has no bf16
    if e.kind == "experts":
        for i, name in enumerate(e.hf):
            out[i] = _read(ckpt, name, dtype).T
    else:
        out[...] = e.to_kit([_read(ckpt, n, dtype) for n in e.hf]).astype(dtype, copy=False)
    out.flush()
    return np.memmap(path, dtype=dtype, mode="r", shape=e.shape)


def _by_part(ents: list[Entry]) -> dict[str, list[Entry]]:
    """Entries grouped by the part of the converted checkpoint they are saved in."""
    out: dict[str, list[Entry]] = {}
    for e in ents:
        out.setdefault(part_of(e.kit[1]), []).append(e)
    return out


def _nest(pairs: list[tuple[tuple[str, ...], np.ndarray]]) -> dict:
    tree: dict = {"params": {}, "moe_state": {}}
    for path, value in pairs:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def preset_text(hf_dir: Path, fam: Family, tables: dict, sources: dict) -> str:
    """``preset.toml``: the kit's config of the model, each value with its HF key."""
    lines = [
        f"# {fam.architecture} converted from {hf_dir} by python -m moe_train.convert from-hf.",
        "# Each value names the config.json key it came from.",
        "",
    ]
    for section in SECTIONS:
        if section not in tables:
            continue
        lines.append(f"[{section}]")
        for key, value in tables[section].items():
            lines.append(f"{key} = {_toml(value)}  # {sources[f'{section}.{key}']}")
        lines.append("")
    return "\n".join(lines)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def convert_parts(hf_dir: str, tmp: str, names: list[str]) -> None:
    """Write the parts ``names`` of ``hf_dir``'s conversion under ``tmp/weights/`` (one
    process's share of the work; its scratch files in ``tmp/.arrays-<pid>``)."""
    _, _, _, _, ckpt, ents = plan(Path(hf_dir))
    groups = _by_part(ents)
    arrays = Path(tmp) / f".arrays-{os.getpid()}"
    arrays.mkdir()
    try:
        for part in names:
            tree = _nest(
                [(e.kit, _assemble(ckpt, e, arrays / f"{i}.bin")) for i, e in enumerate(groups[part])]
            )
            _save(Path(tmp) / WEIGHTS / part, tree)
            del tree
            for f in arrays.iterdir():
                f.unlink()
            _return_freed_memory()
    finally:
        shutil.rmtree(arrays, ignore_errors=True)


def _save(directory: Path, tree: dict) -> None:
    """``tree`` (host arrays) as the orbax checkpoint ``directory``, with its manifest in
    ``directory/manifest/metadata``, where a run's step keeps its own (``read_manifest``)."""
    saved = manifest.host_fingerprint(tree)  # of the arrays orbax is given: what it writes
    ocp.PyTreeCheckpointer().save(directory.absolute(), tree)
    path = directory / checkpoint.MANIFEST_FILE
    path.parent.mkdir()
    path.write_text(json.dumps(saved))


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc): without it the per-thread arenas of
    orbax's writers keep a part of every layer, and the process grows with the layer count
    (measured: 3.6 layers' worth after 12 layers, 2.1 with this)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _convert(hf_dir: Path, tmp: Path, names: list[str], workers: int) -> None:
    """The parts, in this process or split over ``workers`` processes (round robin)."""
    if workers <= 1 or len(names) <= 1:
        convert_parts(str(hf_dir), str(tmp), names)
        return
    shares = [names[i::workers] for i in range(min(workers, len(names)))]
    context = multiprocessing.get_context("spawn")  # JAX and orbax do not survive a fork
    with ProcessPoolExecutor(len(shares), mp_context=context) as pool:
        for done in [pool.submit(convert_parts, str(hf_dir), str(tmp), share) for share in shares]:
            done.result()  # re-raises a worker's ConfigError or OSError here


def from_hf(
    hf_dir: str | Path, out: str | Path, log: Callable[[str], None] = print, workers: int = 1
) -> Path:
    """Convert ``hf_dir`` into ``out`` (which must not exist or be empty), the layers split
    over ``workers`` processes (each holds about one layer)."""
    hf_dir, out = Path(hf_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # before reading anything
        raise ConfigError(f"{out}: exists and is not an empty directory; choose a new OUT")
    fam, hf, cfg, sources, ckpt, ents = plan(hf_dir)
    tables, _ = kit_tables(fam, hf, mtp=cfg.model.mtp_depth > 0)
    with new_directory(out, "OUT") as tmp:
        _convert(hf_dir, tmp, list(_by_part(ents)), workers)
        (tmp / PRESET).write_text(preset_text(hf_dir, fam, tables, sources))
        (tmp / "convert.json").write_text(
            json.dumps(
                {
                    "source": str(hf_dir.absolute()),
                    "family": fam.name,
                    "architecture": fam.architecture,
                    "hf_config": hf,
                },
                indent=2,
            )
            + "\n"
        )
    log(
        f"converted {fam.architecture} ({len(ents)} tensors) from {hf_dir} into {out}"
        f"{f' with {workers} processes' if workers > 1 else ''}"
    )
    log(seq_len_line(cfg, sources, out))
    return out


def seq_len_line(cfg: Config, sources: dict, out: Path) -> str:
    """Which ``train.seq_len`` preset.toml holds, where it came from, and how to change it:
    every training sequence is that long, so a fine-tune on a small corpus may want less."""
    origin = sources.get("train.seq_len")
    default = "the kit's default; config.json has no max_position_embeddings"
    why = f"config.json's {origin}" if origin else default
    n = cfg.train.seq_len
    return (
        f"train.seq_len = {n}, from {why}: every training sequence is {n} tokens long (a step's "
        f"time grows with it); add --set train.seq_len=N to a run on {out / PRESET} for shorter ones"
    )
