"""The planner snapshot (tests/snapshots/planner.json, slurm/snapshot.py) beside the launcher's golden
files (slurm/golden/*.sbatch): the goldens hold what the launcher renders, the snapshot the
planner's figures for the same jobs, compared within ``snapshot.REL_TOL``; a change of a share in
moe_train/planner/compute.toml moves the snapshot and no golden.

The snapshot changes only on purpose: MOE_TRAIN_UPDATE_GOLDEN=1 pytest tests/test_planner_snapshot.py
(or python -m slurm.examples --update-golden, make golden) rewrites it with the golden files.
"""

from __future__ import annotations

import copy
import os
import re

import pytest

from moe_train.planner import choices, compute
from moe_train.planner.decide import decide
from slurm import examples, snapshot
from topology import presets

PRESETS = presets.list_presets()


@pytest.fixture
def halved_compute(monkeypatch, tmp_path):
    """moe_train/planner/compute.toml with every number halved (the efficiencies and every
    overlap share, the model tables' too), loaded in place of the shipped one: a compute-bound
    job and a communication-bound one both slow down."""
    share = compute.load().gemm_efficiency
    text, count = re.subn(
        r"(?m)^(\w+) = ([0-9.]+)$", lambda m: f"{m[1]} = {float(m[2]) / 2}", compute.DEFAULTS.read_text()
    )
    assert count > 10
    path = tmp_path / "compute.toml"
    path.write_text(text)
    monkeypatch.setattr(compute, "DEFAULTS", path)
    assert compute.load().gemm_efficiency == share / 2


def test_the_snapshot_holds_the_planners_figures():
    jobs = examples.planner_jobs()
    if os.environ.get(examples.UPDATE_ENV) == "1":
        snapshot.write(jobs)
    assert snapshot.SNAPSHOT.exists(), f"missing {snapshot.SNAPSHOT}; regenerate with {examples.UPDATE_ENV}=1"
    found = snapshot.differences(snapshot.load(), jobs)
    assert not found, (
        "the planner's figures moved beyond the snapshot's tolerance; if on purpose, rerun with "
        f"{examples.UPDATE_ENV}=1 (make golden) and review the diff:\n" + "\n".join(found)
    )


def test_a_compute_change_moves_the_snapshot(halved_compute):
    found = snapshot.differences(snapshot.load(), examples.planner_jobs())
    predicted = [p for p in PRESETS if not presets.load(p).nominal]
    assert {line.partition(":")[0] for line in found if "search.step_s" in line} == set(predicted)


@pytest.mark.parametrize("preset", PRESETS)
def test_the_planner_chooses_nothing_in_a_golden_job(preset):
    chosen = decide(examples.request_for(preset)).choices
    assert chosen and not [c.key for c in chosen if c.source == choices.PLANNER]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_compute_change_leaves_the_golden_file(halved_compute, preset):
    assert examples.golden_text(preset) == examples.golden_path(preset).read_text()


@pytest.mark.parametrize("preset", PRESETS)
def test_the_golden_file_holds_no_planner_line(preset):
    golden = examples.golden_path(preset).read_text()
    lines = snapshot.load()[preset]["lines"]
    assert lines and not [line for line in lines if line in golden]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_golden_file_holds_no_preset_prose(preset):
    golden = examples.golden_path(preset).read_text()
    prose = [" ".join(s.split()) for s in presets.load(preset).env_source.values()]
    assert prose and not [p for p in prose if p in golden]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_dry_run_still_shows_the_planners_lines(preset):
    shown, spec = examples.shown_text(preset), examples.spec_for(preset)
    assert spec.planner_notes and all(f"{n}\n" in shown for n in spec.planner_notes)


@pytest.mark.parametrize("preset", PRESETS)
def test_the_dry_run_still_shows_the_presets_prose(preset):
    shown, spec = examples.shown_text(preset), examples.spec_for(preset)
    assert all(f"# {name}: {' '.join(source.split())}\n" in shown for name, _, source in spec.env)


def _scaled(entry: dict, key: str, factor: float) -> dict:
    out = copy.deepcopy(entry)
    out["figures"][key] *= factor
    return out


def test_a_figure_within_the_tolerance_is_no_difference():
    entry = snapshot.load()["h100-dgx"]
    assert snapshot.job_differences(entry, _scaled(entry, "search.step_s", 1 + snapshot.REL_TOL / 2)) == []


def test_a_figure_beyond_the_tolerance_is_a_difference():
    entry = snapshot.load()["h100-dgx"]
    found = snapshot.job_differences(entry, _scaled(entry, "search.step_s", 1 + 2 * snapshot.REL_TOL))
    assert len(found) == 1 and found[0].startswith("search.step_s: ")


def _lines(entry: dict, change) -> dict:
    out = copy.deepcopy(entry)
    out["lines"] = [change(line) for line in entry["lines"]]
    return out


def test_a_lines_numbers_are_no_difference():
    entry = snapshot.load()["h100-dgx"]
    assert snapshot.job_differences(entry, _lines(entry, lambda s: re.sub(r"\d", "7", s))) == []


def test_a_lines_words_are_a_difference():
    entry = snapshot.load()["h100-dgx"]
    found = snapshot.job_differences(entry, _lines(entry, lambda s: s.replace("fits", "suits")))
    assert [d.partition(":")[0] for d in found] == ["lines"]
