"""``to-hf``: a kit checkpoint (converted, a run, or one step) -> a Hugging Face directory.

Writes ``config.json`` (``families.hf_config``) and ``model-0000i-of-0000N.safetensors`` shards
with ``model.safetensors.index.json``, tensors named and laid out as ``save_pretrained`` does
(experts one by one, ``[out, in]`` Linear weights), in bf16 or fp32; DeepSeek-V3's MTP layers
carry the copies of the embedding and head the released files have. The kit's leaves are read
one at a time (orbax partial restores), so the process holds about one leaf plus one shard; a
scanned run's stacked leaves (every layer's copy of a weight) are first staged, one stored
chunk at a time, in a memory-mapped file (``stage``), so there it holds about one chunk.
A run's step (or converted weights) is verified as every checkpoint reader verifies one
(``weights.read_manifest``):
refused without a manifest unless ``trust_unverified``, and each leaf, once read (or staged),
checked against it (``manifest.verify_leaf``) before it is written: a damaged step stops the
export with ConfigError naming the file, and nothing is left in HF_OUT.
Written under a ``.HF_OUT.partial-<pid>`` sibling and renamed at the end.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from moe_train.checkpoints import checkpoint, manifest
from moe_train.config import Config, ConfigError
from moe_train.convert import weights
from moe_train.convert.families import FAMILIES, Family, family_for, hf_config
from moe_train.convert.from_hf import looped_tree
from moe_train.convert.hf_files import new_directory, write_shards
from moe_train.convert.tensors import entries, extra_copies

DTYPES = {"bf16": ("bfloat16", ml_dtypes.bfloat16), "fp32": ("float32", np.float32)}
SHARD_BYTES = 5 << 30  # transformers' default max_shard_size
# --dtype bf16 of float32 weights, per token: max |logit change| / max |logit| of that token,
# the median and the worst token measured on the tiny Mixtral and DeepSeek-V3 test models
# initialized as Hugging Face does (std 0.02, 4 seeds each, 1024 tokens; tests/test_convert_bf16.py
# checks them). Not a bound: a token whose top-k experts flip under the rounding moves more.
BF16_MEDIAN, BF16_WORST = 3e-3, 6e-3
_e = lambda x: f"{x:.0e}".replace("e-0", "e-")  # noqa: E731  3e-3, not 3e-03
BF16_NOTE = (
    f"note: --dtype bf16 narrowed the stored float32 weights to bf16 (8 mantissa bits). "
    f"Per token, the largest logit change relative to that token's largest logit was "
    f"about {_e(BF16_MEDIAN)} (median) and {_e(BF16_WORST)} (worst token) on the tiny "
    f"Mixtral and DeepSeek-V3 test models (Hugging Face's initialization); this is not a "
    f"bound: a token whose top-k experts flip under the rounding moves more (1e-1 seen "
    f"on the interop test models). Without --dtype every tensor keeps its stored dtype."
)


def _family(source: weights.Source, cfg: Config) -> Family:
    record = source.path / "convert.json"
    if source.kind == "converted" and record.is_file():
        return FAMILIES[json.loads(record.read_text())["family"]]
    return family_for(cfg)


def _leaf_reader(
    source: weights.Source, cfg: Config, scratch: Path, saved: dict | None
) -> Callable[[tuple[str, ...]], np.ndarray]:
    """A function from a looped-layout kit path to that leaf's host array (a scanned run's
    stacked leaves are staged, one at a time, in a memory-mapped file under ``scratch``),
    each checked against the step's manifest ``saved`` (None: not checked)."""
    converted = source.kind == "converted"
    root = (source.path / (weights.WEIGHTS if converted else "state")).absolute()
    scanned = source.kind == "step" and cfg.model.scan_layers
    checkpointer = ocp.PyTreeCheckpointer()
    stacked: dict[tuple[str, ...], np.ndarray] = {}

    def read(saved_path: tuple[str, ...]) -> np.ndarray:
        item: dict = {}
        node = item
        for key in saved_path[:-1]:
            node = node.setdefault(key, {})
        node[saved_path[-1]] = 0
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        path = root / weights.part_of(saved_path[1]) if converted else root
        with weights.quiet_orbax():
            out = checkpointer.restore(
                path, args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True)
            )
        for key in saved_path:
            out = out[key]
        return np.asarray(out)

    def verified(saved_path: tuple[str, ...], read_it: Callable[[], np.ndarray]) -> np.ndarray:
        def checked():
            array = read_it()
            if saved is not None:
                manifest.verify_leaf(saved, "/".join(saved_path), array, str(source.path))
            return array

        # an OSError goes on to the CLI, which tells a read from a write (the staging file)
        return checkpoint.refuse_damage(checked, source.path, keep=(ConfigError, OSError))

    def leaf(kit: tuple[str, ...]) -> np.ndarray:
        if not scanned or not kit[1].startswith("layer_"):
            return verified(kit, lambda: read(kit))
        i = int(kit[1][len("layer_") :])  # looped name -> (group, row) of the scanned tree
        dense = i < cfg.model.first_dense_layers
        group, row = ("dense_layers", i) if dense else ("moe_layers", i - cfg.model.first_dense_layers)
        key = (kit[0], group, *kit[2:])
        if key not in stacked:  # one stacked leaf at a time: layers are visited in order
            stacked.clear()
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            stacked[key] = verified(key, lambda: stage(root, key, scratch / "leaf.bin"))
        return stacked[key][row]

    return leaf


def stage(root: Path, saved_path: tuple[str, ...], path: Path) -> np.ndarray:
    """The leaf ``saved_path`` of the orbax checkpoint at ``root``, copied through TensorStore
    one stored chunk (one device's shard, as saved) at a time into a read-only memory map at
    ``path``: the process holds one chunk, not the stacked leaf."""
    meta = json.loads((root / "_METADATA").read_text())
    use_ocdbt = meta.get("use_ocdbt", True)
    context = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
    info = ocp.type_handlers.ParamInfo(
        name=".".join(saved_path),
        parent_dir=root,  # pyright: ignore[reportArgumentType]  (typed as etils' Path; a pathlib.Path works)
        use_zarr3=meta.get("use_zarr3", False),
        ts_context=context,
    )
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt)
    stored = ts.open(spec, context=context, open=True, read=True).result()
    shape, dtype = tuple(stored.shape), stored.dtype.numpy_dtype
    out = np.memmap(path, dtype=dtype, mode="w+", shape=shape)
    read_shape = stored.chunk_layout.read_chunk.shape
    assert read_shape is not None, "a stored array has a read chunk shape"
    chunk = [c or n for c, n in zip(read_shape, shape)]
    for start in itertools.product(*(range(0, n, c) for n, c in zip(shape, chunk))):
        region = tuple(slice(s, min(s + c, n)) for s, c, n in zip(start, chunk, shape))
        out[region] = stored[region].read().result()
    out.flush()
    del out
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def _tensors(
    source, cfg: Config, fam: Family, dtype, scratch: Path, stored: set[str], saved: dict | None
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) of every tensor, in the kit tree's order, then the MTP copies; cast
    to ``dtype`` (None: as stored). ``stored`` collects the dtype names as stored."""
    leaf = _leaf_reader(source, cfg, scratch, saved)
    # HF name -> its array
    copies: dict[str, np.ndarray | None] = {source: None for _, source in extra_copies(cfg)}
    for e in _ordered(entries(fam, cfg, looped_tree(cfg))):
        for name, array in zip(e.hf, e.to_hf(leaf(e.kit))):
            stored.add(np.dtype(array.dtype).name)
            array = array if dtype is None else array.astype(dtype)
            if name in copies:
                copies[name] = array
            yield name, array
    for name, source_name in extra_copies(cfg):
        array = copies[source_name]
        assert array is not None, f"{source_name} is written before its copies"
        yield name, array


def _ordered(ents):
    """Entries leaf kind by leaf kind across the layers (``layer_0/attn/q``, ``layer_1/attn/q``,
    ...): a scanned checkpoint's stacked leaf is then read once, not once per layer."""

    def key(e):
        top = e.kit[1]
        layer = int(top.split("_")[1]) if top.startswith("layer_") else -1
        return (e.kit[0], top.startswith("layer_"), e.kit[2:] if layer >= 0 else e.kit[1:], layer)

    return sorted(ents, key=key)


# config.json's torch_dtype for tensors kept as stored: the widest dtype among them
WIDEST_FIRST = ("float32", "float16", "bfloat16")


def to_hf(
    ckpt: str | Path,
    out: str | Path,
    dtype: str | None = None,
    log: Callable[[str], None] = print,
    shard_bytes: int = SHARD_BYTES,
    trust_unverified: bool = False,
) -> Path:
    """Export the weights at ``ckpt`` into ``out`` (new or empty). ``dtype`` None keeps every
    tensor as stored (a run's ``model.param_dtype``, a converted source's own dtype), so the
    export reproduces the kit's logits; ``bf16``/``fp32`` cast them all, and the log says
    when that narrows a stored fp32 tensor. A step without a manifest is refused unless
    ``trust_unverified``."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    source = weights.locate(ckpt)
    cfg = weights.config_of(source)
    saved = weights.read_manifest(source, trust_unverified)
    fam = _family(source, cfg)
    np_dtype = None if dtype is None else DTYPES[dtype][1]
    stored: set[str] = set()
    with new_directory(Path(out), "HF_OUT") as tmp:
        scratch = tmp / ".stacked"  # a scanned run's stacked leaf, staged one at a time
        with checkpoint.quiet_reads(weights.to_stderr, str(source.path)):
            index = write_shards(
                tmp, _tensors(source, cfg, fam, np_dtype, scratch, stored, saved), shard_bytes
            )
        shutil.rmtree(scratch, ignore_errors=True)
        torch_name = DTYPES[dtype][0] if dtype else next((d for d in WIDEST_FIRST if d in stored), "float32")
        (tmp / "config.json").write_text(json.dumps(hf_config(fam, cfg, torch_name), indent=2) + "\n")
    kept = f"as stored ({', '.join(sorted(stored))})" if dtype is None else dtype
    log(f"exported {len(index['weight_map'])} tensors ({fam.architecture}, {kept}) to {out}")
    if dtype == "bf16" and "float32" in stored:
        log(BF16_NOTE)
    return Path(out)
