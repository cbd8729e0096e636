"""Model weights from wherever they are kept: a converted checkpoint, a run, one saved step.

``locate(path)`` tells the three apart:

* a converted checkpoint (``python -m moe_train.convert from-hf HF_DIR OUT``): ``OUT/preset.toml``
  (the model's config) and ``OUT/weights/<part>/``, orbax checkpoints ``{"params",
  "moe_state"}`` in the looped layer layout, in the source's dtype, one per part (``model``:
  embedding, final norm, head; ``layer_{i}``; ``mtp_{k}``), so that converting holds one
  layer at a time, each with its manifest in ``<part>/manifest/metadata`` (as a run's step
  has it, ``moe_train.checkpoints.manifest``);
* a run directory (``--out`` of a training run): its newest checkpoint;
* one step of a run (``RUN/checkpoints/<step>``).

``restore(source, cfg, mesh)`` reads the parameters and the expert bias (never the optimizer
state) onto ``mesh`` in ``cfg``'s layout, dtype and shardings, converting the layer layout
where it differs. ``config_of(source)`` is the config the weights were made with.

Weights are read as every checkpoint reader reads them (``moe_train.checkpoints.checkpoint``): the
manifest first (a step's, or every part's of a converted checkpoint; without one they are
refused unless ``trust_unverified``: converted by a ``from-hf`` that wrote none, or damaged),
then the arrays, as stored, checked against it before they are cast or converted. Damaged,
unverified or mismatching weights raise ConfigError, one line naming the file (``score``,
``eval``, ``train.init_from`` and ``to-hf`` exit 2 with it). The refusal of weights without a
manifest names the option that reads them as they are: ``--trust-unverified`` (``score``,
``eval``, ``to-hf``) or ``train.init_from_trust_unverified=true``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import types
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from moe_train import config
from moe_train.checkpoints import checkpoint, manifest
from moe_train.config import Config, ConfigError
from moe_train.model.settings import model_settings
from moe_train.model.transformer import Transformer, is_scanned, to_looped, to_scanned
from moe_train.parallel import sharding

PRESET, WEIGHTS = "preset.toml", "weights"
TRUST_FLAG = "--trust-unverified"  # how score, eval and to-hf are told to read unverified weights
TRUST_KEY = "train.init_from_trust_unverified"  # the same for train.init_from


@dataclasses.dataclass(frozen=True)
class Source:
    """Where weights are: ``kind`` converted | step; ``path`` the converted dir or step dir."""

    kind: str
    path: Path


def locate(path: str | Path) -> Source:
    """The weights at ``path`` (a converted checkpoint, a run, or one step); ConfigError
    naming what it looked for if there are none."""
    p = Path(path)
    if (p / PRESET).is_file() and (p / WEIGHTS).is_dir():
        return Source("converted", p)
    if (p / "state").is_dir() and (p / "meta").is_dir():
        return Source("step", p)
    steps = sorted(
        (int(d.name) for d in (p / "checkpoints").glob("*") if d.name.isdigit() and (d / "state").is_dir()),
        reverse=True,
    )
    if steps:
        return Source("step", p / "checkpoints" / str(steps[0]))
    raise ConfigError(
        f"{p}: no weights here: expected a converted checkpoint ({PRESET} and "
        f"{WEIGHTS}/), a run directory with checkpoints/<step>/, or one step's "
        "directory"
    )


def config_of(source: Source) -> Config:
    """The config the weights belong to (validated)."""
    if source.kind == "converted":
        cfg = config.load_preset(str(source.path / PRESET))
    else:
        meta_file = source.path / "meta" / "metadata"
        meta = checkpoint.refuse_damage(lambda: json.loads(meta_file.read_text())["config"], meta_file)
        cfg = config.from_dict(meta)
    config.validate(cfg)
    return cfg


def _abstract(cfg: Config, mesh: Mesh):
    """Abstract (params, moe_state) of ``cfg`` with their shardings on ``mesh``."""
    tokens = jnp.zeros((1, cfg.train.seq_len), jnp.int32)
    boxed = jax.eval_shape(lambda k: Transformer(model_settings(cfg)).init(k, tokens), jax.random.key(0))
    shd = sharding.Sharding.of(mesh, cfg)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nn.unbox(boxed["params"]),
        shd.params(boxed["params"]),
    )
    moe_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shd.replicated), boxed.get("moe_state", {})
    )
    return params, moe_state


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _directories(source: Source) -> list[Path]:
    """The directories whose manifests cover ``source``: the step, or each converted part."""
    if source.kind == "step":
        return [source.path]
    return sorted(d for d in (source.path / WEIGHTS).iterdir() if d.is_dir())


def _manifest_of(directory: Path, source: Source, trust_unverified: bool, opt_in: str) -> dict | None:
    """``checkpoint.read_manifest`` of one directory; the refusal of one without a manifest
    names ``opt_in`` (the option that reads it as it is) and, for a converted part, how to
    get one."""
    try:
        return checkpoint.read_manifest(directory, trust_unverified)
    except checkpoint.Unverified as err:
        if source.kind == "converted":
            raise checkpoint.Unverified(
                f"{err}; convert it again with python -m moe_train.convert from-hf HF_DIR OUT "
                f"(or read it as it is with {opt_in})"
            ) from None
        raise checkpoint.Unverified(f"{err}; {opt_in} reads it as it is") from None


def read_manifest(
    source: Source, trust_unverified: bool, log=to_stderr, opt_in: str = TRUST_FLAG
) -> dict | None:
    """The manifest of the weights: a step's, or a converted checkpoint's parts' together.
    ConfigError naming the file and ``opt_in`` when one is missing, unless trusted: then None
    (the weights are read unverified) and a warning."""
    found = {
        d: checkpoint.refuse_damage(lambda d=d: _manifest_of(d, source, trust_unverified, opt_in), d)
        for d in _directories(source)
    }
    missing = [d for d, saved in found.items() if saved is None]
    if missing:
        log(
            f"WARNING: {missing[0] / checkpoint.MANIFEST_FILE} is missing: reading "
            f"{source.path} unverified ({opt_in})"
        )
        return None
    if source.kind == "step":
        return found[source.path]
    version = next(
        (m.get("version") for m in found.values() if m.get("version") != manifest.VERSION), manifest.VERSION
    )
    return {
        "version": version,
        "arrays": {name: entry for m in found.values() for name, entry in m["arrays"].items()},
    }


def restore(
    source: Source,
    cfg: Config,
    mesh: Mesh,
    trust_unverified: bool = False,
    log=to_stderr,
    opt_in: str = TRUST_FLAG,
) -> tuple[Any, Any]:
    """(params, moe_state) of ``source`` as ``cfg`` wants them on ``mesh``: read straight into
    their shardings (each process reads its shards), verified against the manifest, cast to
    ``cfg``'s dtypes, the layer layout converted on the devices where it differs.
    ConfigError naming the file for unverified, damaged or mismatching weights, or the first
    tensor whose shape differs (another model) or that is missing. ``opt_in`` is the option
    that trusts unverified weights, named in the refusal and the warning."""
    saved_manifest = read_manifest(source, trust_unverified, log, opt_in)
    with checkpoint.quiet_reads(log, str(source.path)):
        return checkpoint.refuse_damage(lambda: _restore(source, cfg, mesh, saved_manifest), source.path)


def _restore(source: Source, cfg: Config, mesh: Mesh, saved_manifest: dict | None):
    params, moe_state = _abstract(cfg, mesh)
    target = {"params": params, "moe_state": moe_state}
    m = types.SimpleNamespace(
        num_layers=cfg.model.num_layers, first_dense_layers=cfg.model.first_dense_layers
    )
    saved_scanned = source.kind == "step" and config_of(source).model.scan_layers
    want_scanned = is_scanned(params)
    saved = target
    if saved_scanned != want_scanned:
        saved = (
            to_looped(target, m, take=checkpoint.take_abstract)
            if want_scanned
            else to_scanned(target, m, stack=checkpoint.stack_abstract)
        )
    items = (
        {source.path / WEIGHTS / name: item for name, item in parts(saved).items()}
        if source.kind == "converted"
        else {source.path / "state": saved}
    )
    restored = _merge([_read_verified(source, path, item, saved_manifest) for path, item in items.items()])
    if saved_scanned != want_scanned:
        convert = to_scanned if want_scanned else to_looped
        shardings = jax.tree.map(lambda x: x.sharding, target)
        restored = jax.jit(lambda t: convert(t, m), out_shardings=shardings)(restored)
    return restored["params"], restored["moe_state"]


def _read_verified(source: Source, path: Path, item: dict, saved_manifest: dict | None) -> dict:
    """``item``'s arrays from the orbax checkpoint at ``path``, read as stored, checked against
    ``saved_manifest`` (None: not checked), then cast to ``item``'s dtypes (a converted
    checkpoint part by part); damage names the converted part, or the step."""
    where = path if source.kind == "converted" else source.path

    def read():
        restored = _restore_item(source, path, item)
        if saved_manifest is not None:
            manifest.verify(saved_manifest, restored, str(where), partial=True)
        return jax.tree.map(
            lambda x, want: x if x.dtype == want.dtype else x.astype(want.dtype), restored, item
        )

    return checkpoint.refuse_damage(read, where)


def part_of(top: str) -> str:
    """The part of a converted checkpoint holding the subtree ``top`` (``layer_{i}``,
    ``mtp_{k}``; the embedding, final norm and head are in ``model``)."""
    return top if top.startswith(("layer_", "mtp_")) else "model"


def parts(tree: dict) -> dict[str, dict]:
    """{"params", "moe_state"} split into the parts a converted checkpoint saves apart (one
    orbax checkpoint each, so converting holds one layer at a time)."""
    out: dict[str, dict] = {}
    for collection, sub in tree.items():
        for top, value in sub.items():
            part = out.setdefault(part_of(top), {"params": {}, "moe_state": {}})
            part[collection][top] = value
    return out


def _merge(trees: list[dict]) -> dict:
    out: dict = {"params": {}, "moe_state": {}}
    for t in trees:
        for collection in out:
            out[collection].update(t.get(collection, {}))
    return out


def _restore_item(source: Source, path: Path, saved: dict) -> dict:
    """``saved``'s leaves from the orbax checkpoint at ``path`` into their shardings, in the
    checkpoint's own dtypes (to verify them before they are cast)."""
    saved = {k: v for k, v in saved.items() if v}  # orbax keeps no empty collection
    have = _check_shapes(path, saved, source)

    def restore_args(key, x):
        stored = have[jax.tree_util.keystr(key)].dtype
        return ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=stored, global_shape=x.shape)

    args = jax.tree_util.tree_map_with_path(restore_args, saved)
    with quiet_orbax():
        restored = ocp.PyTreeCheckpointer().restore(
            path.absolute(), args=ocp.args.PyTreeRestore(item=saved, restore_args=args, partial_restore=True)
        )
    return {"params": {}, "moe_state": {}, **restored}


class _NoMissingMetadata(logging.Filter):
    """Drops orbax's warning that a run's ``state`` item has no checkpoint-level metadata
    file (its CheckpointManager writes that one level up): true and harmless here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Metadata file does not exist" not in record.getMessage()


@contextlib.contextmanager
def quiet_orbax():
    log, quiet = logging.getLogger("absl"), _NoMissingMetadata()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _check_shapes(path: Path, saved: dict, source: Source) -> dict:
    """Every tensor ``saved`` names is in the checkpoint at ``path`` with that shape (orbax
    would pad or cut a different one to the requested shape); returns the checkpoint's
    metadata by key path (``shape``, ``dtype``)."""
    with quiet_orbax():
        meta = ocp.PyTreeCheckpointer().metadata(path.absolute())
    tree = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
    have = {
        jax.tree_util.keystr(k): v
        for k, v in jax.tree_util.tree_leaves_with_path(_plain(tree), is_leaf=lambda x: hasattr(x, "shape"))
    }
    for key, want in jax.tree_util.tree_leaves_with_path(saved):
        name = jax.tree_util.keystr(key)
        got = have.get(name)
        if got is None:
            raise ConfigError(f"{source.path}: tensor {name} is missing (another model?)")
        if tuple(got.shape) != tuple(want.shape):
            raise ConfigError(
                f"{source.path}: tensor {name} has shape {tuple(got.shape)}, "
                f"this model needs {tuple(want.shape)}"
            )
    return have


def _plain(tree):
    """Orbax's metadata tree as nested dicts (its containers differ between releases)."""
    if hasattr(tree, "items") and not hasattr(tree, "shape"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def start_from(path: str, state, cfg: Config, mesh: Mesh, log=print):
    """``state`` (a freshly initialised train state) with the parameters and expert bias of
    the weights at ``path`` (``train.init_from``): step 0 and a fresh optimizer state. Weights
    without a manifest are refused unless ``train.init_from_trust_unverified``."""
    source = locate(path)
    trust = cfg.train.init_from_trust_unverified
    params, moe_state = restore(source, cfg, mesh, trust, log=log, opt_in=f"{TRUST_KEY}=true")
    log(f"initialised from {source.path} ({source.kind} weights): fresh optimizer, step 0")
    return state.replace(params=params, moe_state=moe_state)
