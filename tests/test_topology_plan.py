"""``python -m moe_train.planner.ep_plan``: allocation shapes, the JSON plan, the human output, errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import pipe, run_module, start_module

from moe_train.planner.ep_plan import make_plan
from topology import presets
from topology.placement import PlacementError, allocation


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_module("moe_train.planner.ep_plan", *args, timeout=120)


def plan_json(*args: str) -> dict:
    r = cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def nvl72():
    return presets.load("gb200-nvl72")


# --- allocation -----------------------------------------------------------------------------


def test_nvl72_32_nodes_ep64_uses_16_of_18_trays(nvl72):
    a = allocation(nvl72, 32, 64)
    assert (a.segment, a.domains, a.nodes_per_domain) == (16, 2, 16)
    assert "--segment=16" in a.reason and "2 of 18 nodes per domain spare" in a.reason


def test_nvl72_36_nodes_ep8_whole_racks(nvl72):
    a = allocation(nvl72, 36, 8)
    assert (a.segment, a.domains, a.nodes_per_domain) == (18, 2, 18)


def test_nvl72_ep_larger_than_a_rack_spans_whole_segments(nvl72):
    a = allocation(nvl72, 32, 128)
    assert a.segment == 16 and "spans 2 whole segments" in a.reason


def test_nvl72_18_nodes_ep64_refused(nvl72):
    with pytest.raises(PlacementError) as e:
        allocation(nvl72, 18, 64, num_experts=256)
    msg = str(e.value)
    assert "valid node counts for ep 64: 16, 32, 48, 64" in msg
    assert "valid ep for 18 nodes: 1, 2, 4, 8" in msg


def test_nvl36x2_segment_is_one_domain_of_two_racks():
    a = allocation(presets.load("gb200-nvl36x2"), 36, 72)
    assert a.segment == 18 and a.domains == 2


def test_h100_has_no_segment():
    h100 = presets.load("h100-dgx")
    a = allocation(h100, 8, 8)
    assert (a.segment, a.domains, a.nodes_per_domain) == (None, 8, 1)
    assert allocation(h100, 8, 64).domains == 8
    with pytest.raises(PlacementError, match="valid node counts for ep 16: 2, 4, 6, 8"):
        allocation(h100, 3, 16)


# --- the plan -------------------------------------------------------------------------------


def test_json_nvl72_deepseek_ep64():
    d = plan_json("--preset", "gb200-nvl72", "--nodes", "32", "--model", "deepseek-v3", "--ep", "64")
    for key in (
        "ep_groups",
        "domains",
        "a2a_seconds",
        "bytes_over_network",
        "allocation",
        "mesh",
        "comm_fraction",
    ):
        assert key in d
    assert d["allocation"]["segment"] == 16
    assert d["mesh"] == {"data": 2, "expert_x": 1, "expert": 64}
    racks = [set(r) for r in d["domains"]]
    assert len(racks) == 2 and all(len(r) == 64 for r in racks)
    assert all(any(set(g) <= r for r in racks) for g in d["ep_groups"])
    assert sorted(r for g in d["ep_groups"] for r in g) == list(range(128))
    # planned: no network at all; naive: ranks 64-71 sit in rack 0 (72 + 56), their group in
    # rack 1, so each of them sends 56 of 64 shares over the network, 4 times per layer
    assert d["bytes_over_network"]["planned"] == 0
    T = 15360 * 4096 // 128  # the preset's batch over 128 GPUs
    assert d["tokens_per_gpu"] == T
    assert d["bytes_over_network"]["naive"] == pytest.approx(4 * T * 8 * 7168 * 2 * 56 / 64)
    assert d["a2a_seconds"]["planned"] < d["a2a_seconds"]["naive"]
    assert d["speedup"] > 10
    assert d["comm_fraction"]["planned"] < d["comm_fraction"]["naive"]
    assert d["straddling"] == {"planned": False, "naive": True}


def test_json_ep_beyond_a_rack_is_hierarchical():
    d = plan_json(
        "--preset",
        "gb200-nvl72",
        "--nodes",
        "32",
        "--model",
        "deepseek-v3",
        "--ep",
        "128",
        "--tokens",
        "8192",
    )
    assert d["mesh"] == {"data": 1, "expert_x": 2, "expert": 64}
    assert d["hierarchical"] == {"planned": True, "naive": False}
    assert d["tokens_from"] == "--tokens"
    assert 0 < d["bytes_over_network"]["planned"] < d["bytes_over_network"]["naive"]


def test_h100_mixtral_planned_equals_naive():
    p = make_plan("h100-dgx", 8, "mixtral-8x7b", 8)
    assert p.planned.placement.ep_groups == p.naive.placement.ep_groups
    assert p.speedup == 1.0 and p.planned.network_bytes_layer == 0


def test_human_output_mentions_the_segment():
    r = cli("--preset", "gb200-nvl72", "--nodes", "32", "--model", "deepseek-v3", "--ep", "64")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "--segment=16" in out and "mesh (data, expert_x, expert): (2, 1, 64)" in out
    assert "group 1: ranks 64-127  in domain 1" in out
    assert "planned" in out and "naive" in out and "speedup" in out


def test_many_groups_are_abbreviated():
    r = cli(
        "--preset",
        "h100-dgx",
        "--nodes",
        "32",
        "--model",
        "qwen3-30b-a3b",
        "--ep",
        "8",
        "--tokens",
        "4096",
    )
    assert r.returncode == 0, r.stderr
    assert "... 24 more groups" in r.stdout and "group 31: ranks 248-255" in r.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ("--preset", "gb200-nvl72", "--nodes", "32", "--model", "deepseek-v3", "--ep", "48"),
            "valid ep for 32 gb200-nvl72 nodes: 1, 2, 4, 8, 16, 32, 64, 128",
        ),
        (("--preset", "nope", "--nodes", "2", "--model", "tiny", "--ep", "2"), "valid presets: b200-hgx"),
        (
            ("--preset", "h100-dgx", "--nodes", "2", "--model", "nope", "--ep", "2"),
            "unknown model preset 'nope'",
        ),
        (
            ("--preset", "gb200-nvl72", "--nodes", "18", "--model", "deepseek-v3", "--ep", "64"),
            "valid node counts for ep 64: 16, 32",
        ),
        (("--preset", "h100-dgx", "--nodes", "2", "--model", "tiny", "--ep", "8", "--dp", "3"), "use dp 2"),
        (("--preset", "h100-dgx", "--nodes", "0", "--model", "tiny", "--ep", "8"), "--nodes"),
    ],
)
def test_errors_are_one_line_exit_2(args, needle):
    r = cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]


def test_topology_without_a_subcommand_prints_usage():
    r = run_module("topology", timeout=120)
    assert r.returncode == 2 and "usage:" in r.stderr


def test_site_file_straddle_refused_then_allowed(tmp_path):
    # a site with 3-node (24-GPU) NVLink domains and no segments: 4 nodes are racks of 24 + 8
    text = (Path(presets.PRESET_DIR) / "h100-dgx.toml").read_text()
    site = tmp_path / "site.toml"
    site.write_text(text.replace("domain_size = 8 ", "domain_size = 24 "))
    args = ("--preset", str(site), "--nodes", "4", "--model", "tiny", "--ep", "8")
    assert plan_json(*args)["straddling"]["planned"] is False  # 24 and 8 hold whole groups
    args = ("--preset", str(site), "--nodes", "4", "--model", "qwen3-30b-a3b", "--ep", "16")
    r = cli(*args)
    assert r.returncode == 2 and "straddle" in r.stderr
    d = plan_json(*args, "--allow-straddle")
    assert d["straddling"]["planned"] is True and d["allocation"]["segment"] is None
    assert d["bytes_over_network"]["planned"] <= d["bytes_over_network"]["naive"]


def test_closed_stdout_is_not_a_traceback():
    # `python -m moe_train.planner.ep_plan ... | head` closes the pipe early: exit quietly.
    proc = start_module(
        "moe_train.planner.ep_plan", *"--preset h100-dgx --nodes 2 --model tiny --ep 8".split()
    )
    pipe(proc.stdout).close()  # before the child has written anything
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err
