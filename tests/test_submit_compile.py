"""The submit preflight's XLA:GPU compile (``slurm/compiled.py``): the job compiled at its
planned bucket by the real ``python -m moe_train.compile`` (skipped with the reason where the
CUDA PJRT plugin is not installed), cached, refused when its peak exceeds the usable memory,
and skipped for COMPILE=0, dry runs and presets without a GPU target."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moe_train.compile import plugin
from slurm import choices, compiled, layout
from slurm.plan import LaunchError, Request
from topology import presets

PROBLEM = plugin.version_problem(plugin.search_path())
needs_plugin = pytest.mark.skipif(PROBLEM is not None, reason=f"no CUDA PJRT plugin: {PROBLEM}")
TINY = Request(
    preset="h100-dgx", model="tiny", nodes=1, ep=8, sets=("precision.compute=bf16", "moe.capacity_buckets=1")
)


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
        mp.setenv(compiled.ENV, "1")
        notes = [compiled.preflight(*job(TINY)) for _ in range(2)]
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
        compiled.verdict(smaller, ignore_memory=False, cached=True)
    assert compiled.verdict(smaller, ignore_memory=True, cached=True).startswith("warning: ")


def test_a_change_to_the_config_is_another_cache_key():
    req, _, cfg = job(TINY)
    other = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=cfg.optim.lr / 2))
    assert compiled.cache_key(req, cfg) != compiled.cache_key(req, other)
    assert compiled.cache_key(req, cfg) == compiled.cache_key(req, cfg)


def test_compile_0_skips_it(monkeypatch):
    monkeypatch.setenv(compiled.ENV, "0")
    assert compiled.preflight(*job(TINY)) == "compile: skipped: MOE_TRAIN_COMPILE=0 (COMPILE=0)"


def test_dry_runs_and_presets_without_a_gpu_target_do_not_compile(monkeypatch):
    monkeypatch.setenv(compiled.ENV, "1")
    assert compiled.preflight(*job(dataclasses.replace(TINY, dry_run=True))) is None
    note = compiled.preflight(*job(dataclasses.replace(TINY, preset="cpu-local")))
    assert note == "compile: skipped: cluster preset cpu-local names no XLA:GPU target config"


def test_the_compile_gets_the_jobs_own_arguments():
    req, _, cfg = job(TINY)
    args = compiled.compile_args(req, cfg)
    assert args[:8] == ["--preset", "h100-dgx", "--model", "tiny", "--nodes", "1", "--ep", "8"]
    assert args[-3:] == ["--bucket", "planned", "--json"]
    assert all(f"--set {s}" in " ".join(args) for s in req.sets)
