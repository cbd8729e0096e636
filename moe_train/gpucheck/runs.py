"""Sections that run the trainer or the test suite in child processes: training, EP, GPU tests.

Each trainer run is ``python -m moe_train`` in its own process (the trainer owns its JAX
setup) under ``<out>/train/<name>/``, bounded by the section's remaining budget; its
metrics.jsonl is read back. Losses across kernels are compared step by step as relative
differences.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from moe_train import config
from moe_train.bench.experts import unavailable
from moe_train.gpucheck import FAIL, PASS, SKIP, Context, over_budget, say, skip, verdict

ROOT = Path(__file__).resolve().parents[2]
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}  # max relative loss difference across backends, any step
EP_RTOL = 1e-4  # expert-parallel vs one EP group, fp32
TRAIN_BACKENDS = ("te", "mgpu", "ragged_dot", "tiled")
MIN_RUN_S = {"tiny": 15.0, "small": 60.0}  # a run of that preset is not started with less left
CHILD_MEM_FRACTION = "0.4"  # of the GPU's memory, for each trainer run (tiny and small need little)
STEPS = {"tiny": (30, 6), "small": (5, 0), "band": (50, 12), "ep": (10, 5)}  # (GPU, CPU)


def steps(ctx: Context, what: str) -> int:
    return STEPS[what][0 if ctx.on_gpu else 1]


def trainer(ctx: Context, name: str, preset: str, n_steps: int, sets: list[str]) -> dict[str, Any]:
    """Run the trainer; returns rc, the metrics records, the wall time and the output tail."""
    out = ctx.out_dir / "train" / name
    cmd = [
        sys.executable,
        "-m",
        "moe_train",
        "--preset",
        preset,
        "--out",
        str(out),
        "--steps",
        str(n_steps),
        *[a for s in sets for a in ("--set", s)],
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    # this process keeps what its own sections allocated: the child takes part of the rest
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", CHILD_MEM_FRACTION)
    say(f"trainer run {name}: --preset {preset}, {n_steps} steps")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=max(ctx.left(), 1.0), check=False
        )
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, text = None, f"timed out after {err.timeout:.0f} s"
    metrics = out / "metrics.jsonl"
    recs = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return {
        "rc": rc,
        "records": recs,
        "seconds": time.perf_counter() - t0,
        "tail": text.strip().splitlines()[-3:],
        "out": out,
        "kernels": text.splitlines()[0] if text else "",
    }


def _rel_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _run_row(ctx: Context, run: dict[str, Any], n_steps: int, backend: str, preset: str) -> dict:
    recs = run["records"]
    row = {"preset": preset, "backend": backend, "seconds": round(run["seconds"], 1)}
    if run["rc"] != 0 or len(recs) != n_steps:
        return {**row, "status": FAIL, "reason": f"exit {run['rc']}: {' | '.join(run['tail'])}"}
    last = recs[-1]
    tele = run["out"] / "telemetry" / "rank0.jsonl"
    nvml = tele.is_file() and '"gpu_util_pct"' in tele.read_text()
    row.update(
        first_loss=recs[0]["loss"],
        last_loss=last["loss"],
        dropped=sum(r["dropped_tokens"] for r in recs),
        compilations=last["compilations"],
        mfu=last["mfu"],
        tokens_per_s=last["tokens_per_s"],
        telemetry=tele.is_file(),
        nvml=nvml,
        selftest_s=recs[0].get("selftest_s"),
    )
    problems = [
        p
        for p, bad in (
            # one compilation, plus one per capacity bucket an EP exchange overflowed into
            ("tokens dropped", row["dropped"] != 0),
            ("recompiled", last["compilations"] != 1 + last.get("ep_overflow_reruns", 0)),
            ("no MFU", ctx.on_gpu and last["mfu"] is None),
            ("no telemetry", not tele.is_file()),
            ("no NVML fields in telemetry", ctx.on_gpu and not nvml),
        )
        if bad
    ]
    return {**row, "status": FAIL if problems else PASS, "reason": ", ".join(problems)}


def _runnable(ctx: Context, compute: str, hidden: int, ffn: int) -> tuple[list[str], list[dict]]:
    dtype = "float32" if compute == "fp32" else "bfloat16"
    ok, rows = [], []
    for b in TRAIN_BACKENDS:
        reason = unavailable(b, dtype, hidden, ffn)
        if reason:
            rows.append({"backend": b, "status": SKIP, "reason": reason})
        else:
            ok.append(b)
    return ok, rows


def _preset_runs(ctx: Context, preset: str, n_steps: int, compute: str) -> list[dict]:
    m = config.build(preset)
    backends, rows = _runnable(ctx, compute, m.model.hidden, m.moe.expert_ffn)
    losses = {}
    for i, b in enumerate(backends):
        if ctx.left() < MIN_RUN_S.get(preset, MIN_RUN_S["tiny"]):
            rows.append(over_budget(preset=preset, backend=b))
            continue
        # the first run of a preset runs the trainer's kernel self-test; the others skip it
        # (gemm_numerics checked every backend at larger sizes already)
        run = trainer(
            ctx,
            f"{preset}-{b}",
            preset,
            n_steps,
            [
                f"moe.backend={b}",
                f"precision.compute={compute}",
                "parallel.devices=1",
                "train.log_every=1000",
                "train.checkpoint_every=0",
                "train.checkpoint_minutes=0",
                *(["train.skip_selftest=true"] if i else []),
            ],
        )
        rows.append(_run_row(ctx, run, n_steps, b, preset))
        if rows[-1]["status"] == PASS:
            losses[b] = [r["loss"] for r in run["records"]]
    ref = next(iter(losses), None)
    for r in rows:
        if ref is not None and r.get("backend") in losses and r["backend"] != ref:
            r["max_rel_loss_diff_vs_" + ref] = d = _rel_diff(losses[r["backend"]], losses[ref])
            if d > LOSS_RTOL[compute]:
                r.update(
                    status=FAIL, reason=f"loss differs from {ref} by {d:.2e} (bound {LOSS_RTOL[compute]:.0e})"
                )
    return rows


def training(ctx: Context) -> dict[str, Any]:
    """tiny (30 steps; 6 on CPU) and, on a GPU, small (5 steps) per runnable backend."""
    compute = "bf16" if ctx.on_gpu else "fp32"
    if ctx.child_blocked:
        return skip(ctx.child_blocked)
    rows = _preset_runs(ctx, "tiny", steps(ctx, "tiny"), compute)
    if ctx.on_gpu:
        rows += _preset_runs(ctx, "small", steps(ctx, "small"), compute)
    else:
        rows.append(
            {
                "preset": "small",
                "status": SKIP,
                "reason": "no GPU: the small preset takes minutes per backend on CPU",
            }
        )
    return verdict(rows, compute=compute)


def expert_parallel(ctx: Context) -> dict[str, Any]:
    """tiny with EP over n devices against one device: equal losses (fp32)."""
    if ctx.child_blocked:
        return skip(ctx.child_blocked)
    if ctx.on_gpu and ctx.device_count < 2:
        return skip(f"one GPU here ({ctx.device_count}): expert parallelism needs two or more")
    n = min(ctx.device_count, 8) if ctx.on_gpu else 4  # CPU: fake devices
    n = max(d for d in (1, 2, 4, 8) if d <= n)
    runs = {}
    for ep in (1, n):  # EP 1 on one device: the reference the tests hold EP to
        if ctx.left() < MIN_RUN_S["tiny"]:
            return verdict([over_budget(ep=ep)])
        runs[ep] = trainer(
            ctx,
            f"ep{ep}",
            "tiny",
            steps(ctx, "ep"),
            [f"parallel.devices={ep}", f"parallel.ep={ep}", "precision.compute=fp32", "train.log_every=1000"],
        )
    rows = [
        _run_row(ctx, runs[ep], steps(ctx, "ep"), "auto", f"tiny ep={ep} on {ep} device(s)") for ep in runs
    ]
    if all(r["status"] == PASS for r in rows):
        d = _rel_diff(*[[r["loss"] for r in runs[ep]["records"]] for ep in (n, 1)])
        rows[-1]["max_rel_loss_diff_vs_ep1"] = d
        if d > EP_RTOL:
            rows[-1].update(status=FAIL, reason=f"EP {n} loss differs from EP 1 by {d:.2e}")
    return verdict(rows, devices=n, fake_devices=not ctx.on_gpu)


def gpu_tests(ctx: Context) -> dict[str, Any]:
    """``pytest -m gpu tests`` (where pytest and the tests are present)."""
    if not ctx.on_gpu:
        return skip("no GPU: the gpu-marked tests skip on this machine (make test runs them)")
    try:
        import pytest  # noqa: F401
    except ImportError:
        return skip("pytest is not installed")
    if not (ROOT / "tests").is_dir():
        return skip(f"no tests/ beside the package ({ROOT})")
    # only the modules that hold gpu-marked tests: the others may import what a GPU container
    # lacks (submitit), and one collection error would stop the whole run
    files = [str(f) for f in sorted((ROOT / "tests").glob("test_*.py")) if "pytest.mark.gpu" in f.read_text()]
    if not files:
        return skip("no gpu-marked tests under tests/")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=max(ctx.left(), 1.0)
        )
    except subprocess.TimeoutExpired:
        return {"status": FAIL, "reason": "the gpu-marked tests outran the section's budget"}
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|skipped)", ln)), "")
    ok = proc.returncode in (0, 5)  # 5: none collected
    return {
        "status": PASS if ok else FAIL,
        "reason": "" if ok else summary or lines[-1:],
        "summary": summary,
        "tail": lines[-15:] if not ok else [],
    }


# The README's band for fp8 against bf16 on tiny (tests/test_precision.py holds the same).
FP8_STEP_RTOL, FP8_TAIL_RTOL = 0.03, 0.01


def fp8_loss_band(ctx: Context) -> list[dict[str, Any]]:
    """tiny in bf16 and in fp8 (fp8 backend auto): per-step and last-ten loss gaps."""
    n = steps(ctx, "band")
    if ctx.child_blocked:
        return [{"run": "tiny bf16 and fp8 loss band", "status": SKIP, "reason": ctx.child_blocked}]
    base = ["parallel.devices=1", "train.log_every=1000", "optim.decay_steps=45", "precision.amax_history=64"]
    runs = {}
    for compute in ("bf16", "fp8"):
        if ctx.left() < MIN_RUN_S["tiny"]:
            return [over_budget(run=f"tiny {compute} loss band")]
        runs[compute] = trainer(ctx, f"band-{compute}", "tiny", n, [f"precision.compute={compute}", *base])
    rows = [_run_row(ctx, runs[c], n, "auto", f"tiny {c}") for c in runs]
    if any(r["status"] != PASS for r in rows):
        return rows
    ref, got = ([r["loss"] for r in runs[c]["records"]] for c in ("bf16", "fp8"))
    step_gap = _rel_diff(got, ref)
    tail_gap = abs(sum(got[-10:]) - sum(ref[-10:])) / abs(sum(ref[-10:]))
    ok = step_gap <= FP8_STEP_RTOL and tail_gap <= FP8_TAIL_RTOL
    band = {
        "run": f"fp8 vs bf16 loss, tiny, {n} steps",
        "max_step_gap": step_gap,
        "last10_gap": tail_gap,
        "bounds": [FP8_STEP_RTOL, FP8_TAIL_RTOL],
        "fp8_kernels": runs["fp8"]["kernels"],
        "status": PASS if ok else FAIL,
        "reason": "" if ok else f"outside the band: per step {step_gap:.2%}, last ten {tail_gap:.2%}",
    }
    return [*rows, band]
