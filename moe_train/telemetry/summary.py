"""The run summary, ``<out>/summary.json``: per rank and job-wide, from the run's files.

Process 0 writes it at the end of a run, after every process has stopped its sampler; any
time later (also on a running or crashed run) ``python -m moe_train.telemetry.summary RUN_DIR``
recomputes it from ``metrics.jsonl``, ``telemetry/rank<N>.jsonl`` and ``config.json``.

Figures:

* Throughput (from metrics.jsonl, over steps that did not compile, else all steps): median
  ``tokens_per_s`` and ``tflops_per_device``; ``mfu`` = that TFLOP/s over the peak per device
  (the ``parallel.cluster`` preset's, else the device kind's from ``topology.peaks``; null
  without one, e.g. on CPU or in float32).
* Utilization (telemetry samples taken while a non-compiling step ran; else while any step
  ran; else all samples; ``window`` says which): mean/p5/p95 of ``gpu_util_pct`` per rank and
  pooled over ranks, the same for the host's ``host_cpu_pct``; mean power.
* Energy: joules each GPU drew while its sampler ran (compilation and checkpoints included),
  per token trained: job ``energy_j / tokens``; per rank ``energy_j / (tokens / ranks)``.
* Stragglers: ranks whose mean GPU utilization is more than ``STRAGGLER_UTIL_GAP_PCT`` points
  under the job's median, or whose median step time (from the step starts each sampler
  records) is over ``STRAGGLER_STEP_RATIO`` times the job's median.
* Ranks that wrote no telemetry file are listed in ``missing_ranks``; lines skipped as cut or
  unreadable are counted under ``data_quality``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from moe_train.telemetry.files import RunData, load_run, run_dir_main, samples, starts
from topology import peaks, presets

STRAGGLER_UTIL_GAP_PCT = 10.0  # percentage points under the job's median GPU utilization
STRAGGLER_STEP_RATIO = 1.05  # median step time over the job's median step time


def stats(values: Iterable[Any]) -> dict[str, float] | None:
    """Mean, 5th and 95th percentile of the finite numbers in ``values``; None if there are none."""
    arr = np.array(
        [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)], dtype=float
    )
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return None
    return {
        "mean": float(arr.mean()),
        "p5": float(np.percentile(arr, 5)),
        "p95": float(np.percentile(arr, 95)),
        "n": int(arr.size),
    }


def _median(values: Iterable[Any]) -> float | None:
    vals = [float(v) for v in values if isinstance(v, (int, float)) and np.isfinite(v)]
    return float(statistics.median(vals)) if vals else None


def steady(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Steps that did not compile (the throughput a run settles at); all steps if none."""
    return [r for r in metrics if not r.get("compiled")] or metrics


PEAK_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp8": "fp8"}  # precision.compute -> peak


def peak_for(config: dict[str, Any] | None, device_kind: str | None) -> float | None:
    """Peak FLOP/s per device for MFU, from a resolved config (``config.json``): the cluster
    preset's when one is named, else by device kind; fp8 runs against the fp8 peak, none for
    fp32 (TF32 or true FP32 is ambiguous)."""
    if not config:
        return None

    compute = config.get("precision", {}).get("compute")
    dtype = PEAK_DTYPE.get(compute, "float32")
    cluster = config.get("parallel", {}).get("cluster", "")
    if cluster:
        try:
            return presets.load(cluster).peak_flops(dtype)
        except presets.TopologyError:
            return None
    return peaks.peak_flops(device_kind, dtype) if device_kind else None


def _peak_from_metrics(metrics: list[dict[str, Any]]) -> float | None:
    """The peak the trainer used, recovered from a step's ``tflops_per_device / mfu``."""
    for r in metrics:
        if r.get("mfu") and r.get("tflops_per_device"):
            return r["tflops_per_device"] * 1e12 / r["mfu"]
    return None


def tokens_trained(data: RunData) -> int:
    """Tokens of the steps in metrics.jsonl (global batch x sequence length per step)."""
    train = (data.config or {}).get("train", {})
    per_step = train.get("batch_size", 0) * train.get("seq_len", 0)
    if per_step:
        return per_step * len(data.metrics)
    return int(round(sum(r.get("tokens_per_s", 0) * r.get("step_time_s", 0) for r in data.metrics)))


def throughput(data: RunData, peak: float | None) -> dict[str, Any]:
    """Median tokens/s, TFLOP/s per device and MFU over the steady steps."""
    recs = steady(data.metrics)
    tflops = _median(r.get("tflops_per_device") for r in recs)
    return {
        "steps": len(data.metrics),
        "steady_steps": len(recs),
        "compiled_steps": [r["step"] for r in data.metrics if r.get("compiled")],
        "tokens": tokens_trained(data),
        "tokens_per_s": _median(r.get("tokens_per_s") for r in recs),
        "step_time_s": _median(r.get("step_time_s") for r in recs),
        "tflops_per_device": tflops,
        "peak_tflops_per_device": peak / 1e12 if peak else None,
        "mfu": tflops * 1e12 / peak if (peak and tflops is not None) else None,
    }


def step_durations(records: list[dict[str, Any]]) -> dict[int, float]:
    """Wall seconds of each step on this rank, from consecutive step starts in its samples."""
    out: dict[int, float] = {}
    pending: tuple[Any, float] | None = None
    for rec in records:
        if rec.get("kind") == "start":
            pending = None
        marks = rec.get("steps") if rec.get("kind") == "sample" else None
        for mark in marks or ():
            if not (isinstance(mark, list) and len(mark) == 2 and isinstance(mark[1], (int, float))):
                continue
            if pending is not None and isinstance(pending[0], int):
                out[pending[0]] = mark[1] - pending[1]
            pending = (mark[0], mark[1])
    return out


def _window(sample_recs: list[dict], compiled: set[int]) -> tuple[list[dict], str]:
    """The samples to judge utilization on, and which window that is."""
    running = [s for s in sample_recs if isinstance(s.get("step"), int)]
    settled = [s for s in running if s["step"] not in compiled]
    if settled:
        return settled, "steps that did not compile"
    if running:
        return running, "all steps"
    return sample_recs, "whole run"


def _utilization(judged: list[dict]) -> dict[str, dict[str, float] | None]:
    """``gpu_util_pct`` and ``host_cpu_pct``: the ``stats`` of the samples judged on."""
    return {key: stats(s.get(key) for s in judged) for key in ("gpu_util_pct", "host_cpu_pct")}


def _energy(records: list[dict[str, Any]]) -> float | None:
    """Joules over all sampler sessions in the file (the counter restarts at each start line)."""
    total, session, seen = 0.0, 0.0, False
    for rec in records:
        if rec.get("kind") == "start":
            total, session = total + session, 0.0
        elif rec.get("kind") == "sample" and isinstance(rec.get("energy_j"), (int, float)):
            session, seen = max(session, rec["energy_j"]), True
    return total + session if seen else None


def rank_summary(
    rank: int, records: list[dict[str, Any]], compiled: set[int], tokens_per_rank: float
) -> dict[str, Any]:
    """One rank's figures from its telemetry lines."""
    recs = samples(records)
    window, which = _window(recs, compiled)
    first = (starts(records) or [{}])[-1]
    durations = step_durations(records)
    energy = _energy(records)
    return {
        "rank": rank,
        "host": first.get("host"),
        "nvml": first.get("nvml"),
        "gpu_name": first.get("gpu_name"),
        "device_kind": first.get("device_kind"),
        "samples": len(recs),
        "window": which,
        **_utilization(window),
        "power_w_mean": _mean(s.get("power_w") for s in window),
        "energy_j": energy,
        "energy_per_token_j": energy / tokens_per_rank if (energy is not None and tokens_per_rank) else None,
        "step_time_s_median": _median(v for k, v in durations.items() if k not in compiled),
        "sample_ms_mean": _mean(s.get("sample_ms") for s in recs),
        "unsupported": {
            r["field"]: r.get("error") for r in records if r.get("kind") == "unsupported" and "field" in r
        },
        "errors": [r.get("error") for r in records if r.get("kind") == "error"],
    }


def _mean(values: Iterable[Any]) -> float | None:
    """The mean of the finite numbers; None if there are none."""
    s = stats(values)
    return s["mean"] if s else None


def stragglers(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks well under the job's median GPU utilization or over its median step time."""
    util = {r["rank"]: r["gpu_util_pct"]["mean"] for r in ranks if r["gpu_util_pct"]}
    steps = {r["rank"]: r["step_time_s_median"] for r in ranks if r["step_time_s_median"]}
    return _off_median(
        util,
        lambda v, mid: v < mid - STRAGGLER_UTIL_GAP_PCT,
        lambda v, mid: f"GPU utilization {v:.0f}% vs job median {mid:.0f}%",
    ) + _off_median(
        steps,
        lambda v, mid: v > STRAGGLER_STEP_RATIO * mid,
        lambda v, mid: f"median step {v * 1e3:.1f} ms vs job median {mid * 1e3:.1f} ms",
        highest_first=True,
    )


def _off_median(
    by_rank: dict[Any, float],
    off: Callable[[float, float], bool],
    why: Callable[[float, float], str],
    highest_first: bool = False,
) -> list[dict[str, Any]]:
    """``{"rank", "why"}`` of the ranks whose value is ``off`` the ranks' median (none with
    fewer than two ranks), lowest value first (``highest_first``: highest first)."""
    if len(by_rank) <= 1:
        return []
    mid = statistics.median(by_rank.values())
    return [
        {"rank": k, "why": why(v, mid)}
        for k, v in sorted(by_rank.items(), key=lambda kv: kv[1], reverse=highest_first)
        if off(v, mid)
    ]


def _expected_ranks(data: RunData, process_count: int | None) -> int:
    counts = [s.get("process_count") for recs in data.telemetry.values() for s in starts(recs)]
    counts = [c for c in counts if isinstance(c, int)]
    return max([process_count or 0, *counts, len(data.telemetry)])


def build(
    data: RunData, *, peak_flops: float | None = None, process_count: int | None = None
) -> dict[str, Any]:
    """The summary of ``data`` (see the module docstring); ``peak_flops`` overrides the lookup."""
    kinds = [s.get("device_kind") for recs in data.telemetry.values() for s in starts(recs)]
    peak = (
        peak_flops
        or peak_for(data.config, next((k for k in kinds if k), None))
        or _peak_from_metrics(data.metrics)
    )
    tput = throughput(data, peak)
    expected = _expected_ranks(data, process_count)
    compiled = set(tput["compiled_steps"])
    ranks = [
        rank_summary(r, recs, compiled, tput["tokens"] / max(expected, 1))
        for r, recs in data.telemetry.items()
    ]
    missing = [r for r in range(expected) if r not in data.telemetry]
    energies = [r["energy_j"] for r in ranks]
    energy = sum(energies) if energies and None not in energies else None
    powers = [r["power_w_mean"] for r in ranks if r["power_w_mean"] is not None]
    judged = [s for recs in data.telemetry.values() for s in _window(samples(recs), compiled)[0]]
    job = {
        **tput,
        "ranks_expected": expected,
        "ranks_found": len(ranks),
        "missing_ranks": missing,
        **_utilization(judged),
        "mean_power_w": float(np.mean(powers)) if powers else None,
        "total_power_w": float(np.sum(powers)) if powers else None,
        "energy_j": energy,
        "energy_per_token_j": energy / tput["tokens"]
        if (energy is not None and tput["tokens"] and not missing)
        else None,
    }
    total = (data.config or {}).get("train", {}).get("steps")
    return {
        "run_dir": str(data.run_dir),
        "generated_at": time.time(),
        "progress": {"last_step": data.metrics[-1]["step"] if data.metrics else None, "total_steps": total},
        "job": job,
        "ranks": ranks,
        "stragglers": stragglers(ranks),
        "data_quality": {"skipped_lines": dict(data.skipped), "problems": list(data.problems)},
    }


def write(
    run_dir: Path | str,
    *,
    peak_flops: float | None = None,
    process_count: int | None = None,
    log: Callable[[str], None] = print,
) -> Path | None:
    """Build and write ``<run_dir>/summary.json``; never raises (logs and returns None)."""
    try:
        summary = build(load_run(run_dir), peak_flops=peak_flops, process_count=process_count)
        path = Path(run_dir) / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.replace(path)
        return path
    except Exception as err:
        log(f"summary: not written ({type(err).__name__}: {err})")
        return None


def describe(summary: dict[str, Any]) -> list[str]:
    """A few readable lines of the job-wide figures."""
    j = summary["job"]

    def fmt(v: Any, spec: str = ".3g", unit: str = "") -> str:
        return "n/a" if v is None else f"{v:{spec}}{unit}"

    util = j["gpu_util_pct"] or {}
    return [
        f"steps {summary['progress']['last_step']} of {summary['progress']['total_steps']}, "
        f"ranks {j['ranks_found']}/{j['ranks_expected']}"
        + (f" (missing {j['missing_ranks']})" if j["missing_ranks"] else ""),
        f"tokens/s {fmt(j['tokens_per_s'], ',.0f')}, TFLOP/s per device "
        f"{fmt(j['tflops_per_device'])}, MFU {fmt(j['mfu'] and 100 * j['mfu'], '.1f', '%')}",
        f"GPU util mean {fmt(util.get('mean'), '.0f', '%')}, power {fmt(j['mean_power_w'], '.0f', ' W')}"
        f" per GPU, energy {fmt(j['energy_per_token_j'])} J/token",
        "stragglers: "
        + (", ".join(f"rank {s['rank']} ({s['why']})" for s in summary["stragglers"]) or "none"),
    ]


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_train.telemetry.summary RUN_DIR``: (re)write RUN_DIR/summary.json and
    print it short."""

    def work(run_dir: Path) -> list[str] | None:
        path = write(run_dir)
        return None if path is None else [*describe(json.loads(path.read_text())), f"wrote {path}"]

    return run_dir_main("python -m moe_train.telemetry.summary", main.__doc__, argv, work)


if __name__ == "__main__":
    sys.exit(main())
