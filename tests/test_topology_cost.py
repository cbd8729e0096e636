"""The all-to-all cost model reproduces the reference's worked example and behaves sanely.

Worked example (hardware-and-topology.md): T=8192, H=7168, k=8, bf16, so V ~= 0.94 GB per
dispatch; H100 EP64 over 8 nodes ~19 ms per flat all-to-all, GB200 EP64 inside one rack
~1.3 ms. With the presets' default efficiencies (eta_network 0.86 = DeepEP's 43 of 50 GB/s,
eta_nvlink 0.81 = DeepEP v2's 730 of 900 GB/s) the model gives 19.1 ms and 1.27 ms. At
eta = 1 it would give 16.4 ms and 1.03 ms, so the reference's figures imply eta_network ~= 0.87
and eta_nvlink ~= 0.79. Tolerance: 10 %.
"""

from __future__ import annotations

import dataclasses

import pytest

from moe_train.planner import cost
from topology import presets

T, H, K, BF16 = 8192, 7168, 8, 2
V3 = cost.Traffic(T, H, K, BF16)  # the worked example's dispatch
TOL = 0.10


def test_bytes_per_dispatch_is_0_94_gb():
    v_nv, v_ib = cost.dispatch_bytes(V3, ep=64, domain_size=8, hierarchical=False)
    assert T * K * H * BF16 == pytest.approx(0.94e9, rel=0.01)
    # flat: the bytes to the other 63 GPUs, out of V spread over 64 destinations
    assert v_nv + v_ib == pytest.approx(T * K * H * BF16 * 63 / 64)


def test_worked_example_h100_ep64_flat(h100):
    b = cost.dispatch_time(h100, V3, ep=64, hierarchical=False)
    assert b.total_s == pytest.approx(19e-3, rel=TOL)
    assert b.t_network_s > b.t_nvlink_s  # network bound
    assert b.v_network_bytes == pytest.approx(T * K * H * BF16 * 56 / 64)
    assert b.latency_s == pytest.approx((3.4 + 14.0) * 1e-6)


def test_worked_example_gb200_ep64_in_one_rack(gb200):
    b = cost.dispatch_time(gb200, V3, ep=64, hierarchical=False)
    assert b.total_s == pytest.approx(1.3e-3, rel=TOL)
    assert b.v_network_bytes == 0 and b.t_network_s == 0
    assert b.latency_s == pytest.approx(3.4e-6)


def test_efficiencies_implied_by_reference(h100, gb200):
    ideal_h = dataclasses.replace(h100, eta_network=1.0, eta_nvlink=1.0)
    ideal_g = dataclasses.replace(gb200, eta_nvlink=1.0)
    t_h = cost.dispatch_time(ideal_h, V3, 64).total_s
    t_g = cost.dispatch_time(ideal_g, V3, 64).total_s
    assert t_h / 19e-3 == pytest.approx(0.87, abs=0.01)
    assert t_g / 1.3e-3 == pytest.approx(0.79, abs=0.01)


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("ep", [16, 64, 256])
def test_hierarchical_sends_no_more_network_bytes(h100, k, ep):
    flat = cost.dispatch_time(h100, cost.Traffic(T, H, k, BF16), ep, hierarchical=False)
    hier = cost.dispatch_time(h100, cost.Traffic(T, H, k, BF16), ep, hierarchical=True)
    assert hier.v_network_bytes < flat.v_network_bytes
    assert hier.total_s < flat.total_s


def test_hierarchical_equals_flat_on_network_for_top1(h100):
    flat = cost.dispatch_time(h100, cost.Traffic(T, H, 1, BF16), 64, hierarchical=False)
    hier = cost.dispatch_time(h100, cost.Traffic(T, H, 1, BF16), 64, hierarchical=True)
    assert hier.v_network_bytes == pytest.approx(flat.v_network_bytes)


def test_remote_domains_per_token():
    assert cost.remote_domains_per_token(1, 8) == 0
    assert cost.remote_domains_per_token(2, 1) == pytest.approx(0.5)
    assert cost.remote_domains_per_token(8, 8) == pytest.approx(7 * (1 - (7 / 8) ** 8))


@pytest.mark.parametrize(
    "name,ep",
    [("h100-dgx", 8), ("h100-dgx", 4), ("gb200-nvl72", 72), ("gb200-nvl36x2", 64), ("cpu-local", 8)],
)
@pytest.mark.parametrize("hierarchical", [False, True])
def test_group_inside_one_domain_uses_no_network(name, ep, hierarchical):
    b = cost.dispatch_time(presets.load(name), V3, ep, hierarchical)
    assert b.v_network_bytes == 0 and b.t_network_s == 0
    assert b.v_nvlink_bytes == pytest.approx(T * K * H * BF16 * (ep - 1) / ep)


@pytest.mark.parametrize("hierarchical", [False, True])
def test_monotonic_in_tokens(h100, gb200, hierarchical):
    for cluster in (h100, gb200):
        times = [
            cost.dispatch_time(cluster, cost.Traffic(t, H, K, BF16), 64, hierarchical).total_s
            for t in (256, 1024, 4096, 8192, 16384)
        ]
        assert times == sorted(times) and len(set(times)) == len(times)


def test_ep1_costs_only_latency(h100):
    b = cost.dispatch_time(h100, V3, 1)
    assert b.v_nvlink_bytes == b.v_network_bytes == 0
    assert b.total_s == b.latency_s


def test_layer_time(h100, gb200):
    F = 2048
    for cluster in (h100, gb200):
        layer = cost.layer_time(cluster, V3, F, 64)
        assert layer.comm_s == pytest.approx(4 * layer.all_to_all.total_s)
        assert layer.gemm_flops == 3 * 2 * T * K * 3 * H * F
        assert layer.gemm_s == pytest.approx(layer.gemm_flops / cluster.peak_bf16_flops)
        assert layer.total_s == pytest.approx(layer.comm_s + layer.gemm_s)
        assert 0 < layer.comm_fraction < 1
    # the rack keeps EP64 mostly on NVLink, so communication is a smaller share there
    assert cost.layer_time(gb200, V3, F, 64).comm_fraction < cost.layer_time(h100, V3, F, 64).comm_fraction


def test_bad_sizes_are_rejected(h100):
    with pytest.raises(ValueError, match="not a multiple of 8"):
        cost.dispatch_time(h100, V3, ep=12)
    with pytest.raises(ValueError, match="T must be > 0"):
        cost.dispatch_time(h100, cost.Traffic(0, H, K, BF16), ep=8)
    with pytest.raises(ValueError, match="F must be > 0"):
        cost.layer_time(h100, V3, 0, ep=8)
