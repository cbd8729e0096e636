"""The submit preflight's XLA:GPU compile (``moe_train/planner/preflight.py``): the job compiled at its
planned bucket by the real ``python -m moe_train.planner.compile`` (skipped with the reason where the
CUDA PJRT plugin is not installed), cached, refused when its peak exceeds the usable memory,
and skipped for COMPILE=0, dry runs and presets without a GPU target; a cached peak decides
the memory verdict of make plan and make submit, the estimate beside it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moe_train.planner import choices, layout, memory, preflight, show
from moe_train.planner.compile import plugin
from moe_train.planner.decide import decide
from moe_train.planner.memory import GIB
from moe_train.planner.request import LaunchError, Request
from slurm import plan, site
from topology import presets

PROBLEM = plugin.version_problem(plugin.search_path())
needs_plugin = pytest.mark.skipif(PROBLEM is not None, reason=f"no CUDA PJRT plugin: {PROBLEM}")
TINY = Request(
    preset="h100-dgx", model="tiny", nodes=1, ep=8, sets=("precision.compute=bf16", "moe.capacity_buckets=1")
)
ROOT = Path(__file__).resolve().parents[1]


def job(req: Request):
    cluster = presets.load(req.preset)
    cfg, _ = layout.model_config(req, cluster)
    req, cfg, _ = choices.planned(req, cluster, cfg)
    return req, cluster, cfg


@pytest.fixture(scope="module")
def first_and_second(tmp_path_factory):
    """The preflight's note twice for the same job, and its cache directory."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        mp.setenv(preflight.ENV, "1")
        notes = [preflight.preflight(*job(TINY)) for _ in range(2)]
    return notes, cache / "moe_train" / "compile"


@needs_plugin
@pytest.mark.slow
def test_the_preflight_compiles_the_job_and_says_it_fits(first_and_second):
    (first, _), _ = first_and_second
    assert first.startswith("compile: XLA:GPU peak ") and " MiB of 72.0 GiB usable" in first
    assert "[cached]" not in first


@needs_plugin
@pytest.mark.slow
def test_the_same_job_again_reads_the_cache(first_and_second):
    (_, second), cache = first_and_second
    assert second.endswith("[cached]") and len(list(cache.glob("*.json"))) == 1


@needs_plugin
@pytest.mark.slow
def test_a_compiled_peak_over_the_usable_memory_is_refused(first_and_second):
    _, cache = first_and_second
    (path,) = cache.glob("*.json")
    result = json.loads(path.read_text())
    smaller = {**result, "usable_bytes": result["buckets"][0]["memory"]["peak"] - 1}
    with pytest.raises(LaunchError, match="compile: does not fit: .*--ignore-memory.*COMPILE=0"):
        preflight.verdict(smaller, ignore_memory=False, cached=True)
    assert preflight.verdict(smaller, ignore_memory=True, cached=True).startswith("warning: ")


def test_a_change_to_the_config_is_another_cache_key():
    req, _, cfg = job(TINY)
    other = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=cfg.optim.lr / 2))
    assert preflight.cache_key(req, cfg) != preflight.cache_key(req, other)
    assert preflight.cache_key(req, cfg) == preflight.cache_key(req, cfg)


def test_compile_0_skips_it(monkeypatch):
    monkeypatch.setenv(preflight.ENV, "0")
    assert preflight.preflight(*job(TINY)) == "compile: skipped: MOE_TRAIN_COMPILE=0 (COMPILE=0)"


def test_dry_runs_and_presets_without_a_gpu_target_do_not_compile(monkeypatch):
    monkeypatch.setenv(preflight.ENV, "1")
    assert preflight.preflight(*job(dataclasses.replace(TINY, dry_run=True))) is None
    note = preflight.preflight(*job(dataclasses.replace(TINY, preset="cpu-local")))
    assert note == "compile: skipped: cluster preset cpu-local names no XLA:GPU target config"


def test_the_compile_gets_the_jobs_own_arguments():
    req, _, cfg = job(TINY)
    args = preflight.compile_args(req, cfg)
    assert args[:8] == ["--preset", "h100-dgx", "--model", "tiny", "--nodes", "1", "--ep", "8"]
    assert args[-3:] == ["--bucket", "planned", "--json"]
    assert all(f"--set {s}" in " ".join(args) for s in req.sets)


# ----------------------------------------------------------------------------- the verdict


def cache_peak(monkeypatch, tmp_path, over_usable: int):
    """The TINY job's decision, its cache holding a compile whose peak is the usable memory
    plus ``over_usable`` bytes (no plugin needed: the entry is written as the preflight would)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(preflight.ENV, "0")
    d = decide(TINY)  # COMPILE=0: the estimate's verdict, the cache not read
    usable, bucket = d.memory.verdict.usable_bytes, d.memory.estimate.bucket
    result = {
        "buckets": [{"bucket": bucket, "memory": {"peak": usable + over_usable}, "planner": {"total": 1}}],
        "usable_bytes": usable,
        "gpu": "h100-sxm",
        "jax": "test",
    }
    preflight.store(d.req, d.cfg, result)
    monkeypatch.setenv(preflight.ENV, "1")
    return d, decide(TINY)


def test_a_cached_peak_over_the_usable_memory_decides_does_not_fit(monkeypatch, tmp_path):
    estimated, d = cache_peak(monkeypatch, tmp_path, over_usable=GIB)
    assert estimated.fits and not d.fits  # the estimate fits; XLA:GPU's peak does not
    v = d.memory.verdict
    assert v.compiled is not None and v.needed_bytes == v.usable_bytes + GIB
    line = show.render(show.show(TINY)).splitlines()[0]
    assert line.startswith(f"memory: does not fit: needs {v.needed_bytes / GIB:.1f} GiB per GPU")
    assert "XLA:GPU's compiled peak" in line and "compiled by the submit preflight (cached)" in line
    assert f"the planner's estimate {v.total_bytes / GIB:.1f} GiB" in line
    with pytest.raises(LaunchError, match="does not fit: .*--ignore-memory"):  # make submit refuses it
        (tmp_path / "kit.sqsh").write_bytes(b"")
        plan.plan(
            dataclasses.replace(TINY, image=str(tmp_path / "kit.sqsh")),
            site.Site(),
            host_python="python3",
            kit_root=ROOT,
            now="20260101-000000",
        )


def test_a_cached_peak_within_the_usable_memory_fits_with_the_estimate_beside_it(monkeypatch, tmp_path):
    _, d = cache_peak(monkeypatch, tmp_path, over_usable=-GIB)
    v = d.memory.verdict
    assert d.fits and v.spare_bytes == GIB
    assert v.message.startswith(f"fits with 1.0 GiB to spare ({v.needed_bytes / GIB:.1f} GiB of ")
    assert f"the planner's estimate {v.total_bytes / GIB:.1f} GiB" in v.message


def test_compile_0_leaves_the_verdict_to_the_estimate(monkeypatch, tmp_path):
    estimated, _ = cache_peak(monkeypatch, tmp_path, over_usable=GIB)
    monkeypatch.setenv(preflight.ENV, "0")
    d = decide(TINY)
    assert d.memory.verdict == estimated.memory.verdict and d.memory.verdict.compiled is None


def test_a_compiled_peak_that_fits_decides_where_the_estimate_does_not():
    req, cluster, cfg = job(TINY)
    total = memory.plan(cfg, cluster, 1).estimate.per_device["total"]
    reserve = (cluster.gpu_memory_gib * GIB - total + GIB) / GIB  # usable: 1 GiB below the estimate
    bucket = memory.plan(cfg, cluster, 1).estimate.bucket
    peak = memory.Compiled(total - 2 * GIB, bucket, "compiled by make compile (cached)")
    v = memory.plan(cfg, cluster, 1, reserve_gib=reserve, compiled=peak).verdict
    assert v.fits and v.alternatives == () and "the planner's estimate" in v.message
    assert not memory.plan(cfg, cluster, 1, reserve_gib=reserve).verdict.fits
    other = dataclasses.replace(peak, bucket="worst" if bucket != "worst" else "1")
    assert memory.plan(cfg, cluster, 1, compiled=other).verdict.compiled is None  # not the job's peak
