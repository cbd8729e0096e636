"""The step-time model's overlap shares regenerated from make compile runs
(``moe_train.planner.overlap_shares``, ``make compute-shares``): a share measured at every chunk
count within the spread is one share, a model's table keeps what differs from the defaults,
the file it writes is one ``make plan`` reads, and a real compile's shares land in it."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from helpers import one_error_line, run_module

from moe_train.planner import compute
from moe_train.planner import overlap_shares as shares
from moe_train.planner.compile import plugin

PROBLEM = plugin.version_problem(plugin.search_path())
needs_plugin = pytest.mark.skipif(PROBLEM is not None, reason=f"no CUDA PJRT plugin: {PROBLEM}")
A2A_STEP = compute.FAMILIES["a2a_hidden_step"]
RS_GROUP = compute.FAMILIES["fsdp_hidden_step_reduce_scatter_group"]


def test_a_share_alike_at_every_chunk_count_is_one_share():
    values = dict(zip(A2A_STEP, (0.39, 0.40, 0.40, 0.41), strict=True)) | {"fsdp_hidden_micro_batch": 0.9}
    assert shares.collapsed(values) == {"a2a_hidden_step": 0.4, "fsdp_hidden_micro_batch": 0.9}


def test_a_share_that_moves_with_the_chunks_keeps_each_count():
    values = dict(zip(RS_GROUP, (0.94, 0.94, 0.47, 0.94), strict=True))
    assert shares.collapsed(values) == values


def test_a_models_table_keeps_only_what_differs_from_the_defaults():
    defaults = {"fsdp_hidden_micro_batch": 0.9} | dict.fromkeys(A2A_STEP, 0.4)
    table = {"fsdp_hidden_micro_batch": 0.27} | dict.fromkeys(A2A_STEP, 0.42)
    assert shares.differing(table, defaults) == {"fsdp_hidden_micro_batch": 0.27}


def test_one_count_that_differs_keeps_its_whole_family():
    defaults = dict.fromkeys(A2A_STEP, 0.4)
    table = dict(zip(A2A_STEP, (0.4, 0.4, 0.1, 0.4), strict=True))
    assert shares.differing(table, defaults) == table


def test_a_chunk_less_share_is_every_count_and_a_per_chunk_key_overrides_it(tmp_path):
    lines = compute.DEFAULTS.read_text().splitlines()
    drop = tuple(f"{f} =" for f in ("a2a_hidden", *compute.FAMILIES["a2a_hidden"]))
    kept = [line for line in lines if not line.startswith(drop)]
    at = kept.index("[compute]") + 1
    kept[at:at] = ["a2a_hidden = 0.3", "a2a_hidden_4chunks = 0.5"]
    (tmp_path / "c.toml").write_text("\n".join(kept) + "\n")
    eff = compute.load(tmp_path / "c.toml")
    assert [getattr(eff, f) for f in compute.FAMILIES["a2a_hidden"]] == [0.3, 0.3, 0.5, 0.3]


def _found(day: str = "2026-12-07") -> dict:
    measured = dict(zip(RS_GROUP, (0.9, 0.9, 0.3, 0.9), strict=True)) | dict.fromkeys(A2A_STEP, 0.25)
    source = {("", f): f"measured deviceless (test): {f}" for f in measured}
    model = {"fsdp_hidden_micro_batch": 0.1}
    source |= {("deepseek-v3", "fsdp_hidden_micro_batch"): "measured deviceless (test): its own"}
    found = {"defaults": measured, "models": {"deepseek-v3": model}, "source": source}
    return found | {"flags": {"h100-dgx": "--xla_test=1"}, "jax": "0.10.2", "day": day}


def test_the_file_written_is_one_make_plan_reads_with_the_measured_shares(tmp_path):
    path = tmp_path / "compute.toml"
    path.write_text(shares.render(_found(), compute.DEFAULTS, shares.load_jobs(shares.JOBS)))
    eff, deepseek = compute.load(path), compute.load(path, model="deepseek-v3")
    assert [getattr(eff, f) for f in RS_GROUP] == [0.9, 0.9, 0.3, 0.9]
    assert (eff.a2a_hidden_step_4chunks, deepseek.fsdp_hidden_micro_batch) == (0.25, 0.1)


def test_what_no_job_measured_is_kept_with_its_source(tmp_path):
    path = tmp_path / "compute.toml"
    path.write_text(shares.render(_found(), compute.DEFAULTS, []))
    old, new = compute.load(), compute.load(path)
    assert new.a2a_hidden_hierarchical_8chunks == old.a2a_hidden_hierarchical_8chunks
    assert new.source["gemm_efficiency"] == old.source["gemm_efficiency"]


def test_the_header_names_the_jax_version_the_day_and_the_jobs(tmp_path):
    text = shares.render(_found(), compute.DEFAULTS, shares.load_jobs(shares.JOBS))
    head = text.partition("[compute]")[0]
    assert "2026-12-07 with jax 0.10.2" in head and "mixtral-step: mixtral-8x7b on 8 h100-dgx" in head


def test_a_job_without_a_key_is_one_line_naming_it(tmp_path):
    jobs = tmp_path / "jobs.toml"
    jobs.write_text('[[job]]\nname = "x"\npreset = "h100-dgx"\nmodel = "tiny"\n')
    out = tmp_path / "c.toml"
    proc = run_module("moe_train.planner.overlap_shares", "--jobs", str(jobs), "--out", str(out))
    assert proc.returncode == 2 and "job[0] key 'chunks'" in one_error_line(proc.stderr)
    assert not out.exists()


MIXTRAL_ONE_NODE = """[[job]]
name = "mixtral-step"
preset = "h100-dgx"
model = "mixtral-8x7b"
nodes = 1
ep = 8
sets = ["parallel.weight_gather=step", "train.micro_batch_size=1"]
chunks = [1, 2]
gives = "step"
table = ""
"""


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> tuple[Path, Path, str]:
    """(results folder, the file written, the second run's stderr) of one step job at one
    layer compiled at 1 and 2 chunks, then regenerated again from the kept compiles."""
    root = tmp_path_factory.mktemp("shares")
    (root / "jobs.toml").write_text(MIXTRAL_ONE_NODE)
    args = ("--jobs", str(root / "jobs.toml"), "--results", str(root / "r"), "--out", str(root / "c.toml"))
    first = run_module("moe_train.planner.overlap_shares", *args, "--layers", "1", timeout=1200)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_module("moe_train.planner.overlap_shares", *args, "--layers", "1", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    return root / "r", root / "c.toml", again.stderr


@needs_plugin
@pytest.mark.slow
def test_a_compiles_measured_share_is_the_one_written(regenerated):
    results, path, _ = regenerated
    record = json.loads((results / "mixtral-step" / "2chunks.json").read_text())
    (bucket,) = record["buckets"]
    written = tomllib.loads(path.read_text())["compute"]
    two = written.get("a2a_hidden_step_2chunks", written.get("a2a_hidden_step"))
    assert bucket["hidden"]["all-to-all"]["share"] == pytest.approx(two, abs=shares.SPREAD)


@needs_plugin
@pytest.mark.slow
def test_a_second_run_keeps_the_compiles_it_has(regenerated):
    assert regenerated[2].count("kept from") == 2 and "compiling" not in regenerated[2]
