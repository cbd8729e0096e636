"""The submit preflight's compile: the job's train step compiled by XLA:GPU before it queues.

Where the CUDA PJRT plugin is installed (``make venv EXTRAS=...,compile``), ``make submit``
runs ``python -m moe_train.planner.compile ... --bucket planned --json`` for the job it is about to
submit (the same model, preset, nodes, EP and ``--set`` items, the launcher's own choices
included): XLA:GPU's per-GPU peak at the capacity bucket the memory planner judges the job
by. A job whose compiled peak exceeds the usable memory is refused (exit 2, one line) unless
``--ignore-memory``; a step XLA:GPU cannot compile is refused too. ``COMPILE=0`` (the
environment variable ``MOE_TRAIN_COMPILE=0``) skips the check, and so do a dry run, the smoke
job and a preset without an XLA:GPU target config.

A compile takes minutes on a login node, so its result is cached in
``$XDG_CACHE_HOME/moe_train/compile/<key>.json`` (default ``~/.cache``), keyed by the
trainer's config, the preset, the node count, jax's version and the kit's source files: a
resubmission of the same job pays nothing; any change to them compiles again. ``make
compile`` of the same job at full depth stores its planned bucket there too (``store``).

Where the cache holds the job's peak (``cached_peak``), it decides the memory verdict of
``make plan`` and ``make submit`` (``moe_train.planner.decide``; ``moe_train.planner.memory.verdict``), the
planner's estimate beside it; ``COMPILE=0`` leaves the verdict to the estimate.

The compile runs in a subprocess (the plugin must be set up before jax starts, and the
launcher does not import the compile package, which imports the launcher).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata as metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from moe_train.planner.memory import bucket_label
from moe_train.planner.memory.verdict import Compiled
from moe_train.planner.request import LaunchError, Request
from topology.presets import Cluster

ENV = "MOE_TRAIN_COMPILE"  # "0": skip the preflight compile (make submit COMPILE=0)
ROOT = Path(__file__).resolve().parents[2]  # the checkout
GIB = 2**30
NO_PLUGIN = "needs the CUDA PJRT plugin"
SOURCES = ("moe_train", "topology", "slurm")  # the kit's code, presets and target configs
PREFLIGHT = "the submit preflight"  # who compiled a cached job (its "compiled_by"), in words


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe_train" / "compile"


def compile_args(req: Request, cfg) -> list[str]:
    """``python -m moe_train.planner.compile`` arguments for the job ``req`` (its sets the launcher's)."""
    args = [
        "--preset",
        req.preset,
        "--model",
        req.model,
        "--nodes",
        str(req.nodes),
        "--ep",
        str(cfg.parallel.ep),
    ]
    for item in req.sets:
        args += ["--set", item]
    if req.steps is not None:
        args += ["--steps", str(req.steps)]
    return args + ["--bucket", "planned", "--json"]


def cache_key(req: Request, cfg) -> str:
    """sha256 of what decides the compile: the config, the job, jax and the kit's source."""
    h = hashlib.sha256()
    job = {
        "config": dataclasses.asdict(cfg),
        "preset": req.preset,
        "nodes": req.nodes,
        "jax": metadata.version("jax"),
    }
    h.update(json.dumps(job, sort_keys=True, default=str).encode())
    for package in SOURCES:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in (".py", ".toml", ".txtpb"):
                h.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return h.hexdigest()[:32]


def skip_reason(req: Request, cluster: Cluster) -> str | None:
    """Why the preflight does not compile this job (None: it does)."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0 (COMPILE=0)"
    if req.dry_run or req.smoke:
        return "dry run" if req.dry_run else "smoke job"
    if not cluster.gpu:
        return f"cluster preset {cluster.name} names no XLA:GPU target config"
    return None


def run_compile(args: list[str], out_dir: Path) -> dict:
    """The compile's JSON result, or {"skipped": why} where the plugin is not installed;
    LaunchError with the compile's one-line error where it fails."""
    cmd = [sys.executable, "-m", "moe_train.planner.compile", *args, "--out", str(out_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 0:
        return json.loads(proc.stdout)
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    if NO_PLUGIN in last or "does not match jax" in last:
        return {"skipped": last.removeprefix("error: ")}
    raise LaunchError(
        f"compile: XLA:GPU could not compile the job "
        f"({last.removeprefix('error: ')}); COMPILE=0 submits without this check"
    )


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def verdict(result: dict, ignore_memory: bool, cached: bool) -> str:
    """The note for a compiled job; LaunchError where its peak exceeds the usable memory."""
    (b,) = result["buckets"]
    label = bucket_label(b["bucket"])
    text = (
        f"XLA:GPU peak {_size(b['memory']['peak'])} of {_size(result['usable_bytes'])} "
        f"usable per GPU at the {label} bucket (simulated {result['gpu']}, jax "
        f"{result['jax']}; planner {_size(b['planner']['total'])})"
        f"{' [cached]' if cached else ''}"
    )
    if b["memory"]["peak"] <= result["usable_bytes"]:
        return f"compile: {text}"
    if ignore_memory:
        return f"warning: compile: does not fit: {text}"
    raise LaunchError(
        f"compile: does not fit: {text}; pass --ignore-memory to submit anyway, COMPILE=0 to skip this check"
    )


def cache_path(req: Request, cfg) -> Path:
    """Where the cache keeps the compile of the job ``req`` with config ``cfg``."""
    return cache_dir() / f"{cache_key(req, cfg)}.json"


def store(req: Request, cfg, result: dict, compiled_by: str = PREFLIGHT) -> Path:
    """Cache ``result`` (one bucket, the planned one) for the job; the file written."""
    path = cache_path(req, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**result, "compiled_by": compiled_by}))
    tmp.replace(path)
    return path


def peak_of(result: dict) -> Compiled:
    """XLA:GPU's peak in a cached compile (one bucket)."""
    (b,) = result["buckets"]
    who = result.get("compiled_by", PREFLIGHT)
    return Compiled(b["memory"]["peak"], b["bucket"], f"compiled by {who} (cached)")


def cached_peak(req: Request, cluster: Cluster, cfg) -> Compiled | None:
    """XLA:GPU's peak of the job where the cache holds its compile; None where it does not,
    under ``COMPILE=0`` and for a preset without an XLA:GPU target config."""
    if os.environ.get(ENV, "1") == "0" or not cluster.gpu:
        return None
    path = cache_path(req, cfg)
    try:
        return peak_of(json.loads(path.read_text())) if path.is_file() else None
    except (OSError, ValueError, KeyError):  # a damaged entry: compiled again by the preflight
        return None


def preflight(req: Request, cluster: Cluster, cfg) -> str | None:
    """The compile note for ``req`` (None where skipped for a dry run or the smoke job)."""
    reason = skip_reason(req, cluster)
    if reason is not None:
        return None if (req.dry_run or req.smoke) else f"compile: skipped: {reason}"
    path = cache_path(req, cfg)
    if path.is_file():
        return verdict(json.loads(path.read_text()), req.ignore_memory, cached=True)
    print(
        f"compile: compiling the step for {cluster.gpu} with XLA:GPU (minutes; cached in {path.parent})",
        file=sys.stderr,
        flush=True,
    )
    result = run_compile(compile_args(req, cfg), path.parent / "runs")
    if "skipped" in result:
        return f"compile: skipped: {result['skipped']}"
    store(req, cfg, result)
    return verdict(result, req.ignore_memory, cached=False)
