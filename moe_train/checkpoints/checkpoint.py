"""Orbax checkpoints of the train state: periodic, asynchronous, keep-last-N, atomic.

Each checkpoint is ``<out>/checkpoints/<step>/`` with two items: ``state`` (the sharded train
state) and ``meta`` (JSON: the resolved config and the data position). Orbax writes a step into
a temporary directory and renames it only once every file is on disk, so a crash mid-save
leaves at most an unfinished temporary directory, which is ignored and cleaned up on the next
start; ``latest_step`` only ever names finished checkpoints.

Every checkpoint carries a third item, ``manifest`` (``moe_train.checkpoints.manifest``): each array's
shape, dtype, checksums and finiteness, computed on the devices at save. A state with a NaN
or inf is never saved (``NonFiniteState``).

When to save is ``Schedule`` (steps, wall time); ``open_for``/``close`` give the run's
checkpointer and report a directory that cannot be written as ``exits.OutputError``.

``read_manifest`` is where every reader of a checkpoint's arrays starts (resume, ``moe_train.train.resume``;
``train.init_from``, ``score``, ``eval`` and ``to-hf`` through ``moe_train.convert.weights``
and ``to_hf``): a checkpoint without a manifest is ``Unverified`` (saved before manifests
existed, or damaged) and refused unless the reader was told to trust it; the arrays read are
checked against the manifest (``manifest.verify``) before any value is used. ``restore``
verifies the whole state; ``resume.choose`` resumes from the newest checkpoint that reads and
verifies, moving newer ones (unverified ones too) to ``<out>/checkpoints-rejected/`` (never
deleted); readers that cannot fall back stop with ``refuse_damage``'s ConfigError naming the
file. ``quiet_reads`` keeps what the storage libraries print while a damaged checkpoint is
read ("Exception ignored in ...") off the console, counted in one line.

A checkpoint keeps the layer layout it was written with (``model.scan_layers``: stacked
``dense_layers``/``moe_layers`` groups, or looped ``layer_{i}`` blocks; checkpoints from before
scanned layers existed are looped). Restoring into the other layout converts it
(``moe_train.model.transformer.to_scanned`` / ``to_looped``, on the devices, into the template's shardings):
the run continues as if it had never switched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import gc
import json
import shutil
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_train.base import exits
from moe_train.checkpoints import manifest
from moe_train.checkpoints.manifest import CorruptCheckpoint
from moe_train.config import Config, ConfigError, to_dict
from moe_train.model.transformer import is_scanned, to_looped, to_scanned

# Config fields that change the shapes or meaning of the saved state.
STRUCTURAL = {
    "model": None,  # every model field but those below
    "moe": ("num_experts", "expert_ffn", "num_shared_experts", "shared_ffn"),
}
# Model fields that are not: the attention kernel changes no state, a checkpoint of the
# other layer layout is converted on restore, and the MTP loss weight may change on resume
# (DeepSeek-V3 lowered it from 0.3 to 0.1 late in its run).
NOT_STRUCTURAL = {
    "model": (
        "attention",
        "attention_block",
        "scan_layers",
        "mtp_loss_weight",
        "mtp_loss_weight_late",
        "mtp_late_step",
    )
}


def _fp8_state(precision: dict[str, Any]) -> str | None:
    """What fp8 scaling state the train state holds ("precision.fp8_state"): None outside
    fp8 (a config saved before [precision] existed counts as fp32); fp32 <-> bf16 resume."""
    if precision.get("compute") != "fp8":
        return None
    return f"fp8, {precision.get('fp8_backend')} backend, {precision.get('amax_history')}-step amax history"


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
    diffs = [f"{k}={saved[k]!r} (checkpoint) vs {now[k]!r} (this run)" for k in now if saved.get(k) != now[k]]
    if diffs:
        raise ConfigError(
            f"checkpoint in {directory} is incompatible with this config: "
            f"{'; '.join(diffs)}; use another --out or the checkpoint's config"
        )


def _saved_scanned(saved_cfg: dict[str, Any]) -> bool:
    """Whether a checkpoint has the scanned layout (saved before scanning existed: looped)."""
    return bool(saved_cfg.get("model", {}).get("scan_layers", False))


def stack_abstract(xs: list[jax.ShapeDtypeStruct]) -> jax.ShapeDtypeStruct:
    """Per-layer abstract arrays as one [L, ...] array, the layer axis unsharded."""
    x, sh = xs[0], xs[0].sharding
    return jax.ShapeDtypeStruct(
        (len(xs), *x.shape), x.dtype, sharding=NamedSharding(sh.mesh, P(None, *sh.spec))
    )


def take_abstract(x: jax.ShapeDtypeStruct, _: int) -> jax.ShapeDtypeStruct:
    """One layer of an abstract [L, ...] array."""
    sh = x.sharding
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=NamedSharding(sh.mesh, P(*sh.spec[1:])))


class NonFiniteState(Exception):
    """The state to save holds NaN/inf (the step's guard should have stopped first)."""


class Unverified(CorruptCheckpoint):
    """A checkpoint without a manifest: its arrays cannot be verified."""


MANIFEST_FILE = Path("manifest") / "metadata"  # the manifest item, as Orbax's JsonSave writes it


def read_manifest(step_dir: Path, trust_unverified: bool = False) -> dict[str, Any] | None:
    """The manifest of the checkpoint at ``step_dir`` (``RUN/checkpoints/<step>``). Without one
    the checkpoint is unverified: Unverified naming the file, or None when trusted. A
    manifest that cannot be read is CorruptCheckpoint."""
    path = Path(step_dir) / MANIFEST_FILE
    if not path.is_file():
        if trust_unverified:
            return None
        raise Unverified(
            f"{path} is missing: the checkpoint's arrays cannot be verified "
            f"(saved before manifests existed, or damaged)"
        )
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CorruptCheckpoint(f"{path}: cannot read the manifest ({err})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("arrays"), dict):
        raise CorruptCheckpoint(f"{path}: not a checkpoint manifest")
    return saved


@contextlib.contextmanager
def quiet_reads(log: Callable[[str], None], what: str):
    """While reading ``what``, the exceptions Python would print as "Exception ignored in ..."
    (storage libraries abandoning the reads of a damaged file) are counted, not printed, and
    summarized in one ``log`` line. The reads a failed read abandoned are ended here
    (``end_abandoned_reads``), not whenever the garbage collector finds them: later, they
    would be counted against the next checkpoint read, or dumped on the console at exit.
    Their TensorStore reads still in flight call back into the closed event loop when they
    complete, at any later time: those RuntimeErrors are dropped, during the read and after
    it (``_LateReads``), never counted against the read in progress."""
    ignored: list[str] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda u: None if _closed_loop(u) else ignored.append(type(u.exc_value).__name__)
    try:
        yield
    finally:
        ignored += end_abandoned_reads()
        gc.collect()  # what is left of them is finalized here, while it is still counted
        sys.unraisablehook = _LateReads.around(previous)
        if ignored:
            log(
                f"note: reading {what}: {len(ignored)} exception(s) ignored by the storage "
                f"libraries ({', '.join(sorted(set(ignored)))}), not shown"
            )


def end_abandoned_reads() -> list[str]:
    """Close the coroutines of pending asyncio tasks whose event loop is closed; the names of
    the exceptions they raised. Orbax runs each restore in a fresh event loop and closes it
    when the first read fails, with the other reads still pending (their TensorStore reads in
    flight keep them alive). Such a task can never run again; the garbage collector would
    close its coroutine at some later moment, and Orbax's read coroutine then raises
    ("Exception ignored in: <coroutine object _read_array_index_and_device_put>", one
    traceback of ~60 lines each). Closing them now is the same, at a known time."""
    raised = []
    # type(), not isinstance(): that would look up __class__ on every object (lazy modules warn)
    for task in [o for o in gc.get_objects() if issubclass(type(o), asyncio.Task)]:
        if task.done() or not task.get_loop().is_closed():
            continue
        task._log_destroy_pending = False  # no "Task was destroyed but it is pending!" later
        try:
            coro = task.get_coro()
            if coro is not None:
                coro.close()
        except Exception as err:  # what the coroutine raised on its way out
            raised.append(type(err).__name__)
    return raised


class _LateReads:
    """``sys.unraisablehook`` minus "RuntimeError: Event loop is closed": a TensorStore read
    that an abandoned restore left in flight (``end_abandoned_reads``) completes later and
    calls back into the event loop Orbax closed; that is all it says. Everything else goes
    to the hook it wraps."""

    def __init__(self, wrapped):
        self.wrapped = wrapped

    @classmethod
    def around(cls, hook):
        return hook if isinstance(hook, cls) else cls(hook)

    def __call__(self, unraisable) -> None:
        if not _closed_loop(unraisable):
            self.wrapped(unraisable)


def _closed_loop(unraisable) -> bool:
    """Whether an unraisable exception is a late callback into a closed event loop."""
    err = unraisable.exc_value
    return isinstance(err, RuntimeError) and str(err) == "Event loop is closed"


# What reading a damaged checkpoint raises: Orbax, JSON, a missing file, and TensorStore's
# read errors (Orbax re-raises those as a bare Exception). Running out of memory is not damage.
READ_ERRORS = (CorruptCheckpoint, OSError, ValueError, KeyError, TypeError, AttributeError)
NOT_DAMAGE = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")


def is_damage(err: BaseException) -> bool:
    """Whether ``err``, raised reading a checkpoint, means the checkpoint is damaged."""
    text = str(err)
    if any(mark in text for mark in NOT_DAMAGE):
        return False
    return isinstance(err, READ_ERRORS) or (
        type(err) is Exception and ("TensorStore" in text or "error while reading" in text)
    )


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` with the kit's layout and policy."""

    def __init__(self, out_dir: Path, keep: int, use_async: bool):
        self.directory = Path(out_dir).absolute() / "checkpoints"
        self.rejected = Path(out_dir).absolute() / "checkpoints-rejected"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=use_async, create=True, cleanup_tmp_directories=True
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta", "manifest")
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def _read(self, step: int, item: str, args: Any) -> Any:
        """Item ``item`` of checkpoint ``step``, restored with the Orbax ``args``."""
        return self._mngr.restore(step, args=ocp.args.Composite(**{item: args}))[item]

    def read_meta(self, step: int) -> dict[str, Any]:
        return self._read(step, "meta", ocp.args.JsonRestore())

    def read_manifest(self, step: int, trust_unverified: bool = False) -> dict[str, Any] | None:
        """The step's manifest (``read_manifest``)."""
        return read_manifest(self.directory / str(step), trust_unverified)

    def restore(self, step: int, template: Any, trust_unverified: bool = False) -> Any:
        """Restore the state at ``step`` with the shapes, dtypes and shardings of ``template``,
        converting a checkpoint written in the other layer layout. Raises CorruptCheckpoint
        when the step has no manifest (unless trusted) or the arrays read do not match it."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template
        )
        saved_manifest = self.read_manifest(step, trust_unverified)
        saved_cfg = self.read_meta(step)["config"]
        scanned = is_scanned(template.params)
        if _saved_scanned(saved_cfg) == scanned:
            restored = self._restore_state(step, abstract, saved_cfg)
            if saved_manifest is not None:
                manifest.verify(saved_manifest, restored, f"checkpoint {step}")
            return restored
        m = types.SimpleNamespace(
            **{
                k: saved_cfg["model"][k]  # structural: this run's too
                for k in ("num_layers", "first_dense_layers")
            }
        )
        if scanned:
            saved, convert = to_looped(abstract, m, take=take_abstract), to_scanned
        else:
            saved, convert = to_scanned(abstract, m, stack=stack_abstract), to_looped
        restored = self._restore_state(step, saved, saved_cfg)
        if saved_manifest is not None:
            manifest.verify(saved_manifest, restored, f"checkpoint {step}")
        shardings = jax.tree.map(lambda x: x.sharding, template)
        return jax.jit(lambda t: convert(t, m), out_shardings=shardings)(restored)

    def _restore_state(self, step: int, abstract: Any, saved_cfg: dict[str, Any]) -> Any:
        if "precision" in saved_cfg:
            return self._restore_item(step, abstract)
        # Saved by a release whose config had no [precision] and whose train state had no
        # fp8_state (never an fp8 run: check_compatible refuses those): restore the other
        # fields and keep the template's empty one.
        rest = {
            f.name: getattr(abstract, f.name) for f in dataclasses.fields(abstract) if f.name != "fp8_state"
        }
        return abstract.replace(**self._restore_item(step, rest))

    def _restore_item(self, step: int, abstract: Any) -> Any:
        return self._read(step, "state", ocp.args.StandardRestore(abstract))

    def restore_saved(self, step: int) -> Any:
        """Restore the state at ``step`` as saved (host arrays), for inspection."""
        return self._read(step, "state", ocp.args.StandardRestore())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start saving; with async checkpointing the files are written in the background.

        The state's manifest is computed on the devices first; a state with NaN/inf raises
        NonFiniteState and nothing is written. Device buffers are copied before this
        returns, so the caller may donate ``state``.
        """
        fingerprint = manifest.fingerprint(state)
        bad = manifest.non_finite(fingerprint)
        if bad:
            raise NonFiniteState(
                f"the state of step {step} has non-finite values in "
                f"{len(bad)} arrays (e.g. {bad[0]}); not saved"
            )
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
                manifest=ocp.args.JsonSave(fingerprint),
            ),
            force=True,
        )

    def move_aside(self, step: int, reason: str) -> Path:
        """Move checkpoint ``step`` out of the manager's sight into ``checkpoints-rejected/``
        (with a ``REASON`` file); it is never deleted. Process 0 moves; all reload."""
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        target = self.rejected / f"{step}-{stamp}"
        if jax.process_index() == 0:
            self.rejected.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.directory / str(step)), str(target))
            (target / "REASON").write_text(reason + "\n")
        _sync("moe_train: checkpoint moved aside")
        self.reload()
        return target

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def reload(self) -> None:
        """Forget cached step lists (after a failed save or a directory change)."""
        self._mngr.reload()

    def check_for_errors(self) -> None:
        """Raise the error of a background save that failed (cheap; call every step)."""
        self._mngr.check_for_errors()

    def close(self) -> None:
        self.wait()
        self._mngr.close()


def open_for(out_dir: Path, t: Any) -> Checkpointer:
    """The run's checkpointer (``t``: its ``train`` config); OutputError when the directory
    cannot be created."""
    with exits.RaisedAs(lambda err: exits.output_error(err, Path(out_dir) / "checkpoints"), OSError):
        return Checkpointer(out_dir, keep=t.keep_checkpoints, use_async=t.async_checkpoint)


def close(ckpt: Checkpointer) -> None:
    """Wait for the last save and close: an async save that failed raises what the file
    system said (OutputError)."""
    with exits.RaisedAs(lambda err: exits.output_error(err, ckpt.directory)):
        ckpt.close()


class Schedule:
    """When the loop saves, besides the last step and a stop signal: every
    ``train.checkpoint_every`` steps, and once ``train.checkpoint_minutes`` of wall time passed
    since the last save (or the start). The timer is this process's own: the loop agrees on
    it across processes (``moe_train.train.signals.StopFlag.agree``)."""

    def __init__(self, t: Any):
        self.every, self.seconds = t.checkpoint_every, 60.0 * t.checkpoint_minutes
        self._since = time.monotonic()
        self._last: tuple[int, float] | None = None  # (step, monotonic time) of the last save

    def step_due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def timer_due(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self._since >= self.seconds

    def saved(self, step: int) -> None:
        """A save of ``step`` started now: the timer starts again."""
        self._since = time.monotonic()
        self._last = (step, self._since)

    def last_saved(self) -> tuple[int, float] | None:
        """(step, seconds ago) of this start's last save; None before the first."""
        return None if self._last is None else (self._last[0], time.monotonic() - self._last[1])


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _reason(err: BaseException) -> str:
    """One line on why a checkpoint could not be read."""
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, CorruptCheckpoint):
        return text
    if type(err) is Exception:  # TensorStore, through Orbax: the first sentence says it
        return f"cannot read the state: {text.split(' See full TensorStore details')[0][:200]}"
    return f"{type(err).__name__}: {text[:200]}"


def try_step(
    ckpt: Checkpointer,
    step: int,
    template: Any,
    cfg: Config,
    log: Callable[[str], None],
    trust_unverified: bool = False,
) -> tuple[Any, str | None]:
    """(restored state, None), or (None, why it cannot be used) for a damaged or unverified
    checkpoint. A checkpoint of another model raises ConfigError (a mistake, not damage)."""
    with quiet_reads(log, f"checkpoint {step}"):
        saved_cfg, why = _unless_damaged(lambda: ckpt.read_meta(step)["config"])
        if why is not None:
            return None, why
        check_compatible(saved_cfg, cfg, ckpt.directory)
        return _unless_damaged(lambda: ckpt.restore(step, template, trust_unverified))


def refuse_damage(read: Callable[[], Any], where: Path, keep: tuple = (ConfigError,)) -> Any:
    """``read()`` for a reader that cannot fall back: a damaged or unverified checkpoint
    (``is_damage``) raises ConfigError, one line naming ``where`` or the file; errors of the
    types in ``keep`` pass unchanged."""
    try:
        return read()
    except keep:
        raise
    except Exception as err:
        if not is_damage(err):
            raise
        why = _reason(err)
        raise ConfigError(why if isinstance(err, CorruptCheckpoint) else f"{where}: {why}") from None


def _unless_damaged(read: Callable[[], Any]) -> tuple[Any, str | None]:
    """(``read()``, None), or (None, why) when it raised damage (``is_damage``); others raise."""
    try:
        return read(), None
    except Exception as err:
        if not is_damage(err):
            raise
        return None, _reason(err)
