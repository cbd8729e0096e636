"""Preset XLA_FLAGS are accepted by the installed XLA; unknown flags are named."""

import pytest

from topology import xla_flags
from topology.presets import list_presets, load


@pytest.mark.parametrize("name", [n for n in list_presets() if "XLA_FLAGS" in load(n).env])
def test_preset_flags_are_known_to_this_xla(name):
    assert xla_flags.unknown_flags(load(name).env["XLA_FLAGS"]) == []


def test_unknown_flags_are_each_named():
    flags = (
        "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_not_a_flag=1 --xla_cpu_also_not_a_flag=2"
    )
    assert xla_flags.unknown_flags(flags) == ["--xla_gpu_not_a_flag=1", "--xla_cpu_also_not_a_flag=2"]


def test_split_keeps_quoted_values_together():
    assert xla_flags.split("--a=1 '--b=x y'") == ["--a=1", "--b=x y"]
