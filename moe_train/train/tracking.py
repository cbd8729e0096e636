"""Experiment tracking: TensorBoard event files for every run, Weights & Biases on request.

Process 0 creates one ``Tracker`` per start of a run (``moe_train.train.loop``, next to the
``metrics.MetricsWriter``), calls ``write(rec)`` with each step record that goes to
``metrics.jsonl`` (``moe_train.train.metrics.step_record`` plus the loop's fields) and ``close()``
at the end. ``train.tensorboard`` (default true) writes ``<out>/tensorboard/`` through
``tensorboardX``; ``train.wandb_project`` (default "": off) also logs to W&B, offline unless
``WANDB_MODE`` says otherwise (``wandb sync <out>/wandb/offline-run-*`` uploads it later).

Every numeric value of a record becomes a scalar at ``global_step = rec["step"]``; None and
strings (``ep_bucket="worst"``, ``mfu`` on CPU) are left out, booleans are written as 0/1:

=================================================  ===========================================
tag                                                record key(s)
=================================================  ===========================================
``train/<key>``                                    ``loss``, ``total_loss``, ``aux_loss``,
                                                   ``seq_aux_loss``, ``z_loss``, any other
                                                   ``*loss``, ``grad_norm``, ``lr``,
                                                   ``skipped``, ``nonfinite_skips``
``perf/<key>``                                     ``step_time_s``, ``tokens_per_s``,
                                                   ``tflops_per_device``, ``mfu``,
                                                   ``compilations``, ``compiled``,
                                                   ``selftest_s``
``memory/<key>``                                   ``compiled_*_bytes`` (first step of a start)
``moe/<key>``                                      ``max_over_mean_load``, ``dropped_tokens``,
                                                   ``recv_buffer_fill``, ``ep_*``
``moe/layer_{l}/max_over_mean_load|max_load|``     ``tokens_per_expert[l]`` (l: MoE layer, the
``mean_load``                                      row of ``tokens_per_expert``, not the block)
``moe/layer_{l}/tokens_per_expert`` (histogram)    ``tokens_per_expert[l]``, histogram steps
``eval/<name>``                                    ``eval_<name>``
``other/<key>``                                    any other numeric key
=================================================  ===========================================

One record is one event (all its values in one ``Summary``): half the bytes of one event per
scalar, and a crash never leaves half a step. The per-expert histograms are written only at
the first step of each start, the last step of the run and every ``max(train.log_every, 50)``
steps: a 58-layer, 256-expert model adds about 60 kB per histogram step, every step would be
gigabytes over a long run; the per-layer scalars are there at every step.

A resumed run (restarting after step N) opens a new event file with ``purge_step=N+1``: its
``SessionLog.START`` event at step N+1 tells TensorBoard to drop the points a crashed start
left past N (the fast Rust loader also drops them when a step goes back). Files sort by name
in start order (the suffix is the start's time in ns), as TensorBoard reads them.

Tracking never fails or stops a run: without ``tensorboardX`` (a container that lacks it), or
when the event file cannot be written, one warning goes to ``log`` and TensorBoard is off for
the rest of this start; the same holds for W&B (not installed, ``wandb.init`` or
``wandb.log`` failing). Events are flushed (and fsynced, by tensorboardX) in the background
every ``FLUSH_SECS`` seconds and at ``close()``.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Log = Callable[[str], None]

TB_DIR = "tensorboard"  # <out>/tensorboard/: the event files
FLUSH_SECS = 10  # background flush (with fsync) of pending events; close() flushes the rest
MAX_QUEUE = 100  # events queued for the writer thread: one per record, so ~100 steps behind
HISTOGRAM_EVERY = 50  # at most one per-expert histogram per layer every N steps (see above)
HISTOGRAM_BINS = 64  # linear bins of a load histogram: about 1 kB per layer and histogram step

# Record keys with a fixed group; others are grouped by their name (``tag_of``).
GROUPS = {
    "grad_norm": "train",
    "lr": "train",
    "skipped": "train",
    "nonfinite_skips": "train",
    "step_time_s": "perf",
    "tokens_per_s": "perf",
    "tflops_per_device": "perf",
    "mfu": "perf",
    "compilations": "perf",
    "compiled": "perf",
    "selftest_s": "perf",
    "max_over_mean_load": "moe",
    "dropped_tokens": "moe",
    "recv_buffer_fill": "moe",
}
NOT_SCALARS = {"step", "tokens_per_expert"}  # the x axis, and the per-layer loads


def tag_of(key: str) -> str:
    """The TensorBoard tag of one record key (the table in the module docstring)."""
    if key in GROUPS:
        return f"{GROUPS[key]}/{key}"
    if key.startswith("eval_"):
        return f"eval/{key[len('eval_') :]}"
    if key.endswith("loss"):
        return f"train/{key}"
    if key.startswith("compiled_") and key.endswith("_bytes"):
        return f"memory/{key}"
    if key.startswith("ep_"):
        return f"moe/{key}"
    return f"other/{key}"


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a number (bools as 0/1), else None."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    return None


def layer_loads(tokens_per_expert: Any) -> dict[str, float]:
    """Per MoE layer l: ``moe/layer_{l}/max_load``, ``mean_load`` and ``max_over_mean_load``."""
    loads = np.asarray(tokens_per_expert if tokens_per_expert is not None else [], dtype=float)
    out: dict[str, float] = {}
    if loads.ndim != 2 or loads.size == 0:
        return out
    for layer, row in enumerate(loads):
        top, mean = float(row.max()), float(row.mean())
        out[f"moe/layer_{layer}/max_load"] = top
        out[f"moe/layer_{layer}/mean_load"] = mean
        out[f"moe/layer_{layer}/max_over_mean_load"] = top / max(mean, 1e-9)
    return out


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """Every scalar of one step record, by tag (NaN and inf are kept: a diverging loss shows)."""
    out = {}
    for key, value in rec.items():
        number = None if key in NOT_SCALARS else _number(value)
        if number is not None:
            out[tag_of(key)] = number
    out.update(layer_loads(rec.get("tokens_per_expert")))
    return out


def run_id(out_dir: Path) -> str:
    """A W&B run id that stays the same for every start of the run in ``out_dir``: its name
    (letters, digits, ``-`` and ``_`` only) and a hash of its absolute path."""
    path = Path(out_dir).resolve()
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", path.name).strip("-")[:40] or "run"
    return f"{slug}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


class _Backend:
    """What the TensorBoard and W&B backends share: ``_writer`` (the open ``SummaryWriter``
    or W&B run) is set by ``_open`` and dropped by ``_failed`` or ``_end``; ``active`` while
    it is set."""

    _writer: Any = None
    _log: Log  # set by each backend
    _failed: Callable[[BaseException], None]  # each backend's: log once, drop the writer

    @property
    def active(self) -> bool:
        return self._writer is not None

    def _open(self, opener: Callable[[], Any]) -> None:
        """``_writer = opener()``; a failure goes to ``_failed`` (logged, the backend off)."""
        try:
            self._writer = opener()
        except Exception as err:
            self._failed(err)  # each backend's: log once, drop the writer

    def _end(self, end: Callable[[Any], Any], what: str, note: str = "") -> None:
        """Drop the writer and ``end(writer)`` it, once; a failure is logged as ``what`` failing."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            end(writer)
        except Exception as err:
            self._log(f"WARNING: {what} failed: {type(err).__name__}: {err}{note}")


class _TensorBoard(_Backend):
    """``<out>/tensorboard/`` through ``tensorboardX.SummaryWriter``; ``active`` until the
    first failure, which is logged once."""

    def __init__(self, directory: Path, purge_step: int, log: Log):
        self.directory, self._log, self._writer = directory, log, None
        try:
            import tensorboardX  # optional at run time: a GPU container may lack it
            from tensorboardX import summary

            # protobuf builds the class at import time: pyright cannot see it
            from tensorboardX.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]
        except ImportError as err:
            log(
                f"WARNING: TensorBoard is off for this run: tensorboardX cannot be imported "
                f"({err}); pip install tensorboardX, or set train.tensorboard=false"
            )
            return
        self._summary, self._Summary = summary, Summary
        # opens the event file: fails here if the directory cannot be written
        self._open(
            lambda: tensorboardX.SummaryWriter(
                str(directory),
                purge_step=purge_step,
                max_queue=MAX_QUEUE,
                flush_secs=FLUSH_SECS,
                filename_suffix=f".{time.time_ns()}",
            )
        )

    def write(self, step: int, values: dict[str, float], loads: Any = None) -> None:
        """One event at ``step``: the scalars, and a load histogram per layer if ``loads``."""
        if not _worker_alive(self._writer):
            self._failed(RuntimeError("the tensorboardX writer thread died (see its traceback)"))
            return
        try:
            summary = self._Summary(
                value=[self._Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()]
            )
            for layer, row in enumerate(np.asarray(loads if loads is not None else [], float)):
                if row.size:
                    summary.value.extend(
                        self._summary.histogram(
                            f"moe/layer_{layer}/tokens_per_expert", row, min(HISTOGRAM_BINS, row.size)
                        ).value
                    )
            self._writer.file_writer.add_summary(summary, global_step=step)
        except Exception as err:
            self._failed(err)

    def close(self) -> None:
        """Flush and close the event file (the writer thread ends)."""
        self._end(
            lambda writer: writer.close(),
            f"TensorBoard: closing {self.directory}",
            "; events flushed before are readable",
        )

    def _failed(self, err: BaseException) -> None:
        """Log the failure once and stop writing; what was flushed stays readable."""
        writer, self._writer = self._writer, None
        self._log(
            f"WARNING: TensorBoard is off for the rest of this run: cannot write "
            f"{self.directory}: {type(err).__name__}: {err}"
        )
        if writer is not None and _worker_alive(writer):  # closing a dead one could block
            try:
                writer.close()
            except Exception:
                pass  # the failure is reported above; the run goes on


def _worker_alive(writer) -> bool:
    """Whether the writer thread of a ``SummaryWriter`` runs. One that died (a disk error
    on that thread) would make every add block once ``MAX_QUEUE`` events wait: a hung run."""
    event_writer = getattr(writer.file_writer, "event_writer", None)
    worker = getattr(event_writer, "_worker", None)  # tensorboardX 2.6 internals
    return worker is None or not hasattr(worker, "is_alive") or worker.is_alive()


class _WandB(_Backend):
    """One W&B run per run directory (all starts resume it); ``active`` until it fails."""

    def __init__(self, project: str, out_dir: Path, config: dict[str, Any] | None, log: Log):
        self._log = log
        try:
            # optional: never a dependency of this package
            import wandb  # pyright: ignore[reportMissingImports]
        except ImportError as err:
            log(
                f"WARNING: W&B is off for this run: train.wandb_project={project!r} but wandb "
                f"cannot be imported ({err}); pip install wandb, or set train.wandb_project=''"
            )
            return
        self._open(
            lambda: wandb.init(
                project=project,
                dir=str(out_dir),
                config=config or {},
                resume="allow",
                id=run_id(out_dir),
                name=Path(out_dir).name,
                mode=os.environ.get("WANDB_MODE") or "offline",
            )
        )

    def write(self, step: int, values: dict[str, float]) -> None:
        # W&B keeps steps increasing: steps a crashed start logged past the resumed one are
        # not logged again (W&B warns); TensorBoard shows the redone steps
        try:
            self._writer.log(values, step=step)
        except Exception as err:
            self._failed(err)

    def close(self) -> None:
        self._end(lambda run: run.finish(), "W&B: finishing the run")

    def _failed(self, err: BaseException) -> None:
        self._writer = None
        self._log(f"WARNING: W&B is off for the rest of this run: {type(err).__name__}: {err}")


class Tracker:
    """TensorBoard and W&B for one start of a run; create it on process 0 only.

    ``start_step`` is the step the start resumed from (0 for a fresh run), ``train`` the run's
    ``TrainConfig`` (``tensorboard``, ``wandb_project``, ``log_every``, ``steps``), ``config``
    the resolved config as a dict (W&B's run config). Nothing here raises on I/O errors.
    """

    def __init__(
        self, out_dir: Path, start_step: int, train, *, config: dict[str, Any] | None = None, log: Log = print
    ):
        out_dir = Path(out_dir)
        self._first, self._last = start_step + 1, train.steps
        self._histogram_every = max(train.log_every, HISTOGRAM_EVERY)
        self._tb = _TensorBoard(out_dir / TB_DIR, start_step + 1, log) if train.tensorboard else None
        self._wandb = _WandB(train.wandb_project, out_dir, config, log) if train.wandb_project else None

    @property
    def active(self) -> bool:
        """Whether anything is still being written."""
        return any(b is not None and b.active for b in (self._tb, self._wandb))

    def histogram_step(self, step: int) -> bool:
        """The first step of this start, the last of the run and every ``max(log_every, 50)``."""
        return step in (self._first, self._last) or step % self._histogram_every == 0

    def write(self, rec: dict[str, Any]) -> None:
        """One step record (as in metrics.jsonl) at ``global_step = rec["step"]``."""
        if not self.active:
            return
        step = int(rec["step"])
        values = scalars(rec)
        if self._tb is not None and self._tb.active:
            loads = rec.get("tokens_per_expert") if self.histogram_step(step) else None
            self._tb.write(step, values, loads)
        if self._wandb is not None and self._wandb.active:
            self._wandb.write(step, values)

    def close(self) -> None:
        """Flush and close the event file, finish the W&B run."""
        for backend in (self._tb, self._wandb):
            if backend is not None:
                backend.close()
