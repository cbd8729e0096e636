"""Orbax checkpoints of the train state: periodic, asynchronous, keep-last-N, atomic.

Each checkpoint is ``<out>/checkpoints/<step>/`` with two items: ``state`` (the sharded train
state) and ``meta`` (JSON: the resolved config and the data position). Orbax writes a step into
a temporary directory and renames it only once every file is on disk, so a crash mid-save
leaves at most an unfinished temporary directory, which is ignored and cleaned up on the next
start; ``latest_step`` only ever names finished checkpoints.

A checkpoint keeps the layer layout it was written with (``model.scan_layers``: stacked
``dense_layers``/``moe_layers`` groups, or looped ``layer_{i}`` blocks; checkpoints from before
scanned layers existed are looped). Restoring into the other layout converts it
(``moe_train.model.to_scanned`` / ``to_looped``, on the devices, into the template's shardings):
the run continues as if it had never switched.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_train.config import Config, ConfigError, to_dict
from moe_train.model import is_scanned, to_looped, to_scanned

# Config fields that change the shapes or meaning of the saved state.
STRUCTURAL = {
    "model": None,  # every model field but those below
    "moe": ("num_experts", "expert_ffn", "num_shared_experts", "shared_ffn"),
}
# Model fields that are not: the attention kernel changes no state, and a checkpoint of the
# other layer layout is converted on restore.
NOT_STRUCTURAL = {"model": ("attention", "attention_block", "scan_layers")}


def _fp8_state(precision: dict[str, Any]) -> str | None:
    """What fp8 scaling state the train state holds ("precision.fp8_state"): None outside
    fp8 (a config saved before [precision] existed counts as fp32); fp32 <-> bf16 resume."""
    if precision.get("compute") != "fp8":
        return None
    return (f"fp8, {precision.get('fp8_backend')} backend, "
            f"{precision.get('amax_history')}-step amax history")


def structure(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for section, keys in STRUCTURAL.items():
        values = cfg_dict.get(section, {})
        for key in keys or values:
            if key not in NOT_STRUCTURAL.get(section, ()):
                out[f"{section}.{key}"] = values.get(key)
    out["precision.fp8_state"] = _fp8_state(cfg_dict.get("precision", {}))
    return out


def check_compatible(saved_cfg: dict[str, Any], cfg: Config, directory: Path) -> None:
    """Raise ConfigError when a checkpoint's structure differs from this run's config."""
    saved, now = structure(saved_cfg), structure(to_dict(cfg))
    diffs = [f"{k}={saved[k]!r} (checkpoint) vs {now[k]!r} (this run)"
             for k in now if saved.get(k) != now[k]]
    if diffs:
        raise ConfigError(f"checkpoint in {directory} is incompatible with this config: "
                          f"{'; '.join(diffs)}; use another --out or the checkpoint's config")


def _saved_scanned(saved_cfg: dict[str, Any]) -> bool:
    """Whether a checkpoint has the scanned layout (saved before scanning existed: looped)."""
    return bool(saved_cfg.get("model", {}).get("scan_layers", False))


def _stack_abstract(xs: list[jax.ShapeDtypeStruct]) -> jax.ShapeDtypeStruct:
    """Per-layer abstract arrays as one [L, ...] array, the layer axis unsharded."""
    x, sh = xs[0], xs[0].sharding
    return jax.ShapeDtypeStruct((len(xs), *x.shape), x.dtype,
                                sharding=NamedSharding(sh.mesh, P(None, *sh.spec)))


def _take_abstract(x: jax.ShapeDtypeStruct, _: int) -> jax.ShapeDtypeStruct:
    """One layer of an abstract [L, ...] array."""
    sh = x.sharding
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype,
                                sharding=NamedSharding(sh.mesh, P(*sh.spec[1:])))


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` with the kit's layout and policy."""

    def __init__(self, out_dir: Path, keep: int, use_async: bool):
        self.directory = Path(out_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=use_async, create=True,
            cleanup_tmp_directories=True)
        self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                           item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def read_meta(self, step: int) -> dict[str, Any]:
        restored = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return restored["meta"]

    def restore(self, step: int, template: Any) -> Any:
        """Restore the state at ``step`` with the shapes, dtypes and shardings of ``template``,
        converting a checkpoint written in the other layer layout."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template)
        saved_cfg = self.read_meta(step)["config"]
        scanned = is_scanned(template.params)
        if _saved_scanned(saved_cfg) == scanned:
            return self._restore_state(step, abstract, saved_cfg)
        m = types.SimpleNamespace(**{k: saved_cfg["model"][k]  # structural: this run's too
                                     for k in ("num_layers", "first_dense_layers")})
        if scanned:
            saved, convert = to_looped(abstract, m, take=_take_abstract), to_scanned
        else:
            saved, convert = to_scanned(abstract, m, stack=_stack_abstract), to_looped
        restored = self._restore_state(step, saved, saved_cfg)
        shardings = jax.tree.map(lambda x: x.sharding, template)
        return jax.jit(lambda t: convert(t, m), out_shardings=shardings)(restored)

    def _restore_state(self, step: int, abstract: Any, saved_cfg: dict[str, Any]) -> Any:
        if "precision" in saved_cfg:
            return self._restore_item(step, abstract)
        # Saved by a release whose config had no [precision] and whose train state had no
        # fp8_state (never an fp8 run: check_compatible refuses those): restore the other
        # fields and keep the template's empty one.
        rest = {f.name: getattr(abstract, f.name) for f in dataclasses.fields(abstract)
                if f.name != "fp8_state"}
        return abstract.replace(**self._restore_item(step, rest))

    def _restore_item(self, step: int, abstract: Any) -> Any:
        restored = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))
        return restored["state"]

    def restore_saved(self, step: int) -> Any:
        """Restore the state at ``step`` as saved (host arrays), for inspection."""
        restored = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        return restored["state"]

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start saving; with async checkpointing the files are written in the background.

        Device buffers are copied before this returns, so the caller may donate ``state``.
        """
        self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
