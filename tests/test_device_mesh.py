"""The trainer's mesh follows the topology plan: EP groups inside NVLink domains."""

import json
import re

import jax
import pytest
from helpers import refused, sets, train_cli

from moe_train import config
from moe_train.config import ConfigError
from moe_train.train.loop import EXIT_OK, run
from topology import device_mesh
from topology.discovery import DeviceDomain


def cfg_for(*overrides: str) -> config.Config:
    return config.build("tiny", ["train.steps=2", "train.log_every=100", "parallel.devices=8", *overrides])


def recorded(keys: list[str]):
    """A discovery result as a job would have gathered it: device i in domain keys[i]."""
    return lambda: [DeviceDomain(i, 0, "node", k, "nvml") for i, k in enumerate(keys)]


@pytest.fixture
def interleaved(monkeypatch):
    """Two recorded NVLink domains that interleave in device-id order: evens and odds."""
    keys = [f"nvml:rack{i % 2}" for i in range(8)]
    monkeypatch.setattr(device_mesh.discovery, "discover", recorded(keys))
    return [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_each_ep_group_lies_in_one_recorded_domain(interleaved):
    plan = device_mesh.build(cfg_for("parallel.ep=4"), jax.devices()[:8])
    assert sorted(plan.placement.ep_groups) == interleaved


def test_mesh_order_is_the_placement_order(interleaved):
    plan = device_mesh.build(cfg_for("parallel.ep=4"), jax.devices()[:8])
    assert [d.id for d in plan.mesh.devices.flat] == plan.placement.order


def test_ep_larger_than_a_domain_spans_whole_domains(interleaved):
    plan = device_mesh.build(cfg_for("parallel.ep=8"), jax.devices()[:8])
    assert dict(plan.mesh.shape) == {"data": 1, "expert_x": 2, "expert": 4}


def test_fake_domains_split_the_group_axis():
    plan = device_mesh.build(cfg_for("parallel.ep=8", "parallel.domain_size=2"), jax.devices()[:8])
    assert dict(plan.mesh.shape) == {"data": 1, "expert_x": 4, "expert": 2}


def test_straddling_groups_are_refused_with_the_override_named(monkeypatch):
    monkeypatch.setattr(device_mesh.discovery, "discover", recorded(["a"] * 3 + ["b"] * 5))
    with pytest.raises(ConfigError, match="parallel.ep=4: .*straddle.*allow_straddle=true"):
        device_mesh.build(cfg_for("parallel.ep=4"), jax.devices()[:8])


def test_straddling_allowed_on_request(monkeypatch):
    monkeypatch.setattr(device_mesh.discovery, "discover", recorded(["a"] * 3 + ["b"] * 5))
    plan = device_mesh.build(cfg_for("parallel.ep=4", "parallel.allow_straddle=true"), jax.devices()[:8])
    assert plan.placement.straddling


def test_preset_mismatch_is_a_warning(interleaved):
    plan = device_mesh.build(cfg_for("parallel.ep=4", "parallel.cluster=gb200-nvl72"), jax.devices()[:8])
    assert plan.warnings


UNKNOWN_CLUSTER = "parallel.cluster: unknown cluster preset 'h100'; valid presets: .*h100-dgx"


def test_an_unknown_cluster_preset_names_the_key_and_the_valid_ones():
    with pytest.raises(ConfigError, match=UNKNOWN_CLUSTER):
        device_mesh.build(cfg_for("parallel.cluster=h100"), jax.devices()[:8])


def test_the_cluster_preset_is_checked_with_fake_domains_too():
    with pytest.raises(ConfigError, match=UNKNOWN_CLUSTER):
        device_mesh.build(cfg_for("parallel.cluster=h100", "parallel.domain_size=2"), jax.devices()[:8])


def test_the_trainer_refuses_an_unknown_cluster_preset_with_one_line_and_writes_nothing(tmp_path):
    line = refused(train_cli(tmp_path / "out", "--steps", 1, "--devices", 1, *sets("parallel.cluster=h100")))
    assert re.match(f"error: {UNKNOWN_CLUSTER}", line) and not (tmp_path / "out").exists()


def test_fake_domain_size_must_divide_the_devices():
    with pytest.raises(ConfigError, match="parallel.domain_size=3 does not divide the 8 devices"):
        device_mesh.build(cfg_for("parallel.ep=4", "parallel.domain_size=3"), jax.devices()[:8])


@pytest.mark.slow
def test_training_uses_the_planned_order(tmp_path, interleaved):
    lines = []
    assert run(cfg_for("parallel.ep=4", "parallel.cluster=cpu-local"), tmp_path, log=lines.append) == EXIT_OK
    saved = json.loads((tmp_path / "layout.json").read_text())
    assert sorted(saved["ep_groups"]) == interleaved
    assert any(line.startswith("layout: each EP group of 4 lies inside one NVLink domain") for line in lines)
