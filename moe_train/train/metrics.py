"""Per-step metrics: the JSONL record, the progress line and the end-of-run summary.

``<out>/metrics.jsonl`` gets one JSON object per step. Throughput uses
``moe_train.model.flops.train_flops_per_token`` (active experts only); MFU divides by the device's
dense peak from ``topology.peaks`` and is null where that peak is unknown (CPU).
"""

from __future__ import annotations

import json
import math
import os  # noqa: F401  (tests patch metrics.os; the writes are shards.atomic_write)
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moe_train.data.shards import atomic_write


def load_stats(tokens_per_expert_LE: np.ndarray) -> dict[str, Any]:
    """Per-layer loads and the worst max/mean load ratio over MoE layers."""
    loads = np.asarray(tokens_per_expert_LE)
    if loads.size == 0:
        return {"tokens_per_expert": [], "max_over_mean_load": None}
    ratio = loads.max(axis=1) / np.maximum(loads.mean(axis=1), 1e-9)
    return {"tokens_per_expert": loads.astype(int).tolist(), "max_over_mean_load": float(ratio.max())}


def device_peak_bytes(devices) -> int | None:
    """The most memory any of ``devices`` has held since the process started (its allocator's
    ``peak_bytes_in_use``: on a GPU; None where the platform keeps no such count, e.g. CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    peaks = [int(p) for p in peaks if p is not None]
    return max(peaks) if peaks else None


def step_record(
    step: int,
    raw: dict[str, Any],
    *,
    step_time_s: float,
    tokens: int,
    flops_per_token: float,
    devices: int,
    peak_flops: float | None,
    compilations: int,
    mtp: bool = False,
) -> dict[str, Any]:
    """The JSON-ready metrics of one step from the step's device outputs (already on host)."""
    tokens_per_s = tokens / step_time_s if step_time_s > 0 else float("nan")
    tflops = flops_per_token * tokens_per_s / devices / 1e12
    rec: dict[str, Any] = {"step": step}
    for key in ("loss", "total_loss", "aux_loss", "seq_aux_loss", "z_loss", "grad_norm", "lr"):
        rec[key] = float(raw[key])
    if "mtp_loss" in raw:  # multi-token prediction's mean cross-entropy; None without MTP
        rec["mtp_loss"] = float(raw["mtp_loss"]) if mtp else None
    rec.update(
        step_time_s=step_time_s,
        tokens_per_s=tokens_per_s,
        tflops_per_device=tflops,
        mfu=(tflops * 1e12 / peak_flops) if peak_flops else None,
    )
    rec.update(load_stats(raw["tokens_per_expert"]))
    fill = float(raw["recv_buffer_fill"])  # the MoE metrics: moe_train.moe.stats.metrics
    rec.update(
        dropped_tokens=int(raw["dropped_tokens"]),
        compilations=compilations,
        ep_bucket=raw.get("ep_bucket"),
        ep_overflow_reruns=int(raw.get("ep_overflow_reruns", 0)),
        recv_buffer_fill=None if math.isnan(fill) else fill,
        ep_slow_link_rows=float(raw["ep_slow_link_rows"]),
    )
    return rec


ETA_WINDOW = 50  # the ETA is the steps left x the median step time of the last N records


def progress_line(rec: dict[str, Any], total_steps: int, recent: list[dict[str, Any]] | None = None) -> str:
    """The per-step log line. ``recent``: this start's records so far (``rec`` among them);
    the ETA uses the median ``step_time_s`` of the last ``ETA_WINDOW`` that did not compile
    (none yet, e.g. at the first step: no ETA)."""
    load = rec["max_over_mean_load"]
    width = len(str(total_steps))
    eta = eta_s(rec["step"], total_steps, recent if recent else [rec])
    mtp, held = rec.get("mtp_loss"), rec.get("eval_loss")
    held = "" if held is None else f"| eval {held:.4f} (ppl {rec['eval_ppl']:.4g}) "
    return (
        f"step {rec['step']:>{width}}/{total_steps} | loss {rec['loss']:.4f} "
        f"{'' if mtp is None else f'| mtp {mtp:.4f} '}{held}"
        f"| aux {rec['aux_loss']:.3f} | {rec['tokens_per_s']:>9,.0f} tok/s "
        f"| load max/mean {load if load is None else f'{load:.2f}'} "
        f"| {rec['step_time_s'] * 1e3:7.1f} ms"
        f"{'' if eta is None else f' | eta {format_duration(eta)}'}"
    )


def eta_s(step: int, total_steps: int, records: list[dict[str, Any]]) -> float | None:
    """Seconds until ``total_steps``: steps left x (the median recent step time of steps that
    did not compile + the recompiles' share). ``records``: this start's, first step first.
    The first step's compile is a one-off; a later compile (a new capacity bucket, an
    overflow rerun) adds its time over the median, spread over the steps so far, to every
    step left: recompiles seen so far are expected at the same rate. None without a step
    that did not compile."""
    times = [
        r["step_time_s"]
        for r in records[-ETA_WINDOW:]
        if not r.get("compiled") and math.isfinite(r["step_time_s"])
    ]
    if not times:
        return None
    median = float(np.median(times))
    extra = sum(
        max(r["step_time_s"] - median, 0.0)
        for r in records[1:]
        if r.get("compiled") and math.isfinite(r["step_time_s"])
    )
    return max(total_steps - step, 0) * (median + extra / max(len(records) - 1, 1))


def format_duration(seconds: float) -> str:
    """A short duration: ``<1s``, ``45s``, ``3m12s``, ``2h05m``, ``3d04h``; ``?`` for NaN,
    inf or < 0."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s" if s or not seconds else "<1s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class MetricsWriter:
    """Appends one JSON line per step; a resumed run appends to the same file.

    Only one process of a multi-process job writes (``enabled``); the others keep nothing.
    At the start the file is cut back to the records of steps <= ``start_step`` (what a crash
    past the last checkpoint left is redone); lines that are not a JSON object with an integer
    ``"step"`` (torn by a crash or a full disk) are dropped with one warning through ``log``.
    """

    def __init__(self, path: Path, start_step: int, enabled: bool = True, log: Callable[[str], None] = print):
        self.path = path
        self._log = log
        self._f = None
        if enabled:
            self._drop_after(start_step)
            self._f = path.open("a")

    def _drop_after(self, start_step: int) -> None:
        """Forget records of steps a crashed run did past its last checkpoint, and lines it
        tore. The file is only rewritten when that changes it, and then atomically: the kept
        lines go to ``<path>.tmp`` (fsynced) which replaces the file, so a crash during the
        rewrite leaves either the old file or the new one."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        keep, torn = [], []
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()  # the newline ending the last record
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            step = _step_of(line)
            if step is None:
                torn.append(number)
            elif step <= start_step:
                keep.append(line)
        if torn:
            more = f" and {len(torn) - 10} more" if len(torn) > 10 else ""
            shown = ", ".join(map(str, torn[:10])) + more
            self._log(
                f"WARNING: {self.path.name}: dropped {len(torn)} unreadable line(s) "
                f"(torn by a crash?) at line(s) {shown} of {self.path}"
            )
        new = b"".join(line + b"\n" for line in keep)
        if new != data:  # also mends a last line without its newline (an append would join it)
            atomic_write(self.path, new, tolerant=True)

    def write(self, rec: dict[str, Any]) -> None:
        if self._f:
            self._f.write(json.dumps(rec, allow_nan=True) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()


def _step_of(line: bytes) -> int | None:
    """The integer ``"step"`` of one metrics line, None if the line is not such a record."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    step = rec.get("step") if isinstance(rec, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def summary(
    records: list[dict[str, Any]],
    *,
    first_step: int,
    description: str,
    out_dir: Path,
    status: str,
    checkpoint: tuple[int, float] | None = None,
) -> str:
    """One paragraph on the run: loss change, throughput after compilation, balance, and
    ``checkpoint``: (step, seconds ago) of the last checkpoint this start saved."""
    if not records:
        return f"No steps ran ({status}). Run directory: {out_dir}."
    saved = (
        ""
        if checkpoint is None
        else f" (the last: step {checkpoint[0]}, saved {format_duration(checkpoint[1])} ago)"
    )
    first, last = records[0], records[-1]
    steady = records[1:] or records
    tok_s = float(np.median([r["tokens_per_s"] for r in steady]))
    loads = [r["max_over_mean_load"] for r in steady if r["max_over_mean_load"] is not None]
    fall = 100.0 * (first["loss"] - last["loss"]) / first["loss"] if first["loss"] else math.nan
    mfu = last["mfu"]
    evals = [r for r in records if r.get("eval_loss") is not None]
    held = (
        f"held-out loss {evals[-1]['eval_loss']:.4f} (perplexity "
        f"{evals[-1]['eval_ppl']:.4g}) at step {evals[-1]['step']}; "
        if evals
        else ""
    )
    return (
        f"Trained steps {first_step + 1}-{last['step']} of {description} ({status}). "
        f"Loss went from {first['loss']:.4f} to {last['loss']:.4f} "
        f"({fall:.1f}% {'lower' if fall >= 0 else 'HIGHER'}); "
        f"{held}"
        f"median throughput after the first step {tok_s:,.0f} tokens/s "
        f"({last['tflops_per_device']:.3g} TFLOP/s per device"
        f"{'' if mfu is None else f', MFU {100 * mfu:.1f}%'}); "
        f"expert load max/mean {np.mean(loads) if loads else float('nan'):.2f} on average, "
        f"{sum(r['dropped_tokens'] for r in records)} tokens dropped; "
        f"the step compiled {last['compilations']} time(s). "
        f"Metrics: {out_dir / 'metrics.jsonl'}; config: {out_dir / 'config.json'}; "
        f"checkpoints: {out_dir / 'checkpoints'}{saved}."
    )
