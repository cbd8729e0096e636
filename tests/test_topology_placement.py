"""EP placement on NVLink domains, and the all-to-all cost of an arbitrary placement.

Hand-computed figures (T=8192, H=7168, k=8, bf16): V = T*k*H*2 = 939,524,096 bytes per dispatch.
H100 EP64 over 8 nodes, flat: V_ib = V*56/64 = 822,083,584 B at 0.86*50 GB/s = 19.118 ms;
V_nv = V*7/64 = 102,760,448 B at 0.82*450 GB/s = 0.2785 ms; latency 3.4 + 14 us.
GB200 EP64 in one rack: V_nv = V*63/64 = 924,844,032 B at 0.81*900 GB/s = 1.2686 ms + 3.4 us.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_train.planner import cost
from topology import presets
from topology.placement import (
    PlacementError,
    allocation,
    compress,
    domain_index,
    domains_spanned,
    naive_domains,
    naive_placement,
    place,
    synth_domains,
)

T, H, K, BF16 = 8192, 7168, 8, 2
V3 = cost.Traffic(T, H, K, BF16)
V = 939_524_096


def blocks(*sizes: int) -> list[list[int]]:
    """Domains of consecutive ranks with these sizes."""
    out, start = [], 0
    for s in sizes:
        out.append(list(range(start, start + s)))
        start += s
    return out


def network_bytes(cluster, p, hierarchical=False) -> float:
    return cost.placement_dispatch_time(
        cluster, p.ep_groups, domain_index(p.domains), V3, hierarchical
    ).v_network_bytes


# --- unit cases -----------------------------------------------------------------------------


def test_h100_two_nodes_ep8_one_group_per_node():
    p = place(blocks(8, 8), ep=8)
    assert p.ep_groups == [list(range(8)), list(range(8, 16))]
    assert p.mesh == (2, 1, 8) and not p.straddling
    assert p.order == list(range(16))


def test_nvl72_two_racks_of_16_trays_ep64(gb200):
    alloc = allocation(gb200, 32, 64)
    doms = synth_domains(gb200, alloc)
    assert doms == blocks(64, 64)
    p = place(doms, ep=64)
    assert p.ep_groups == doms and p.mesh == (2, 1, 64)


def test_unequal_domains_partial_rack():
    p = place(blocks(64, 32), ep=32)
    assert p.dp == 3 and not p.straddling
    dom = domain_index(p.domains)
    assert all(domains_spanned(g, dom) == 1 for g in p.ep_groups)


def test_ep_larger_than_domain_is_packed_domain_major():
    p = place(blocks(*[8] * 8), ep=16)
    assert p.mesh == (4, 2, 8)
    assert p.ep_groups[1] == list(range(16, 32))
    assert "hierarchical" in p.notes[0]


def test_unequal_whole_domains_pair_big_with_small():
    # [64, 64, 32, 32] with ep 96: first-fit decreasing pairs each 64 with a 32
    doms = blocks(64, 64, 32, 32)
    p = place(doms, ep=96)
    dom = domain_index(doms)
    assert [domains_spanned(g, dom) for g in p.ep_groups] == [2, 2]
    assert p.mesh == (2, 3, 32) and not p.straddling


def test_straddle_refused_names_valid_ep():
    # what Slurm gives for 32 NVL72 trays without a segment: racks of 72 + 56 GPUs
    with pytest.raises(PlacementError, match=r"valid ep for these 128 devices: 1, 2, 4, 8, 128"):
        place(blocks(72, 56), ep=64)


def test_allow_straddle(gb200):
    p = place(blocks(72, 56), ep=64, allow_straddle=True)
    assert p.straddling and "straddling allowed" in p.notes[0]
    assert sorted(p.order) == list(range(128)) and p.mesh == (2, 1, 64)


def test_sizes_that_do_not_fill_the_devices():
    with pytest.raises(PlacementError, match="ep 5 does not divide the 16 devices"):
        place(blocks(8, 8), ep=5)
    with pytest.raises(PlacementError, match="use dp 2"):
        place(blocks(8, 8), ep=8, dp=4)
    with pytest.raises(PlacementError, match="more than one NVLink domain"):
        place([[0, 1], [1, 2]], ep=1)


def test_order_follows_discovered_ranks():
    doms = [[5, 1, 7, 3], [0, 2, 4, 6]]
    p = place(doms, ep=4)
    assert p.ep_groups == doms


def test_naive_placement():
    p = naive_placement(128, 64, domains=blocks(72, 56))
    assert p.order == list(range(128)) and p.straddling
    assert naive_placement(16, 8).ep_groups == blocks(8, 8)
    assert not naive_placement(16, 8, domains=blocks(8, 8)).straddling


def test_naive_domains_fill_racks_in_order(gb200, h100):
    assert naive_domains(gb200, 32) == blocks(72, 56)
    assert naive_domains(h100, 2) == blocks(8, 8)


def test_helpers():
    assert compress([0, 1, 2, 3, 8, 9, 11]) == "0-3,8-9,11"
    assert compress([]) == ""
    assert domains_spanned([0, 7, 8], [0] * 8 + [1] * 8) == 2


# --- cost of a placement --------------------------------------------------------------------


def test_bytes_per_dispatch():
    assert T * K * H * BF16 == V


@pytest.mark.parametrize("hierarchical", [False, True])
def test_equal_domains_match_the_flat_and_hierarchical_formulas(h100, gb200, hierarchical):
    groups = [list(range(64))]
    b = cost.placement_dispatch_time(h100, groups, [r // 8 for r in range(64)], V3, hierarchical)
    assert b == cost.dispatch_time(h100, V3, 64, hierarchical)
    g = cost.placement_dispatch_time(gb200, groups, [0] * 64, V3, hierarchical)
    assert g == cost.dispatch_time(gb200, V3, 64, hierarchical)


def test_hand_computed_h100_ep64(h100):
    b = cost.placement_dispatch_time(h100, [list(range(64))], [r // 8 for r in range(64)], V3)
    assert b.v_network_bytes == 822_083_584 and b.v_nvlink_bytes == 102_760_448
    assert b.t_network_s == pytest.approx(0.0191182229, rel=1e-8)
    assert b.t_nvlink_s == pytest.approx(0.000278483599, rel=1e-8)
    assert b.total_s == pytest.approx(0.0191182229 + 17.4e-6, rel=1e-8)
    hier = cost.placement_dispatch_time(
        h100, [list(range(64))], [r // 8 for r in range(64)], V3, hierarchical=True
    )
    # 8192*7168*2 * 7 * (1 - (7/8)^8) = 539,608,335 bytes; V*7/8 over NVLink
    assert hier.v_network_bytes == pytest.approx(539_608_335) and hier.v_nvlink_bytes == V * 7 / 8


def test_hand_computed_nvl72_planned_vs_naive(gb200):
    planned = place(blocks(64, 64), ep=64)
    b = cost.placement_dispatch_time(gb200, planned.ep_groups, domain_index(planned.domains), V3)
    assert b.v_network_bytes == 0 and b.v_nvlink_bytes == 924_844_032
    assert b.total_s == pytest.approx(0.00126864751 + 3.4e-6, rel=1e-8)
    # naive: group 1 = ranks 64-127, of which 64-71 sit in rack 0: each of those sends 56/64
    naive = naive_placement(128, 64, domains=blocks(72, 56))
    n = cost.placement_dispatch_time(gb200, naive.ep_groups, domain_index(naive.domains), V3)
    assert n.v_network_bytes == 822_083_584 and n.v_nvlink_bytes == 102_760_448
    assert n.total_s == pytest.approx(0.0191182229 + 17.4e-6, rel=1e-8)


def test_layer_time_of_a_placement(h100):
    groups, dom = [list(range(64))], [r // 8 for r in range(64)]
    layer = cost.placement_layer_time(h100, groups, dom, V3, 2048)
    assert layer == cost.layer_time(h100, V3, 2048, 64)


def test_hierarchical_needs_even_packing(h100):
    with pytest.raises(ValueError, match="same number of GPUs"):
        cost.placement_dispatch_time(
            h100, [list(range(12))], [r // 8 for r in range(12)], V3, hierarchical=True
        )


# --- properties -----------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def layouts(draw, shuffle: bool = True):
    """(domains, full domain size, ep): racks of nodes filled in order, the last partial."""
    gpn = draw(st.sampled_from([1, 2, 4, 8]))
    npd = draw(st.integers(1, 18))
    nodes = draw(st.integers(1, 40))
    n = nodes * gpn
    ranks = list(range(n))
    if shuffle and draw(st.booleans()):
        ranks = draw(st.permutations(ranks))
    size = gpn * npd
    doms = [ranks[i : i + size] for i in range(0, n, size)]
    return doms, size, draw(st.sampled_from(_divisors(n)))


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_every_device_appears_once(layout):
    doms, _, ep = layout
    p = place(doms, ep, allow_straddle=True)
    everyone = sorted(r for d in doms for r in d)
    assert sorted(p.order) == everyone
    assert sorted(r for g in p.ep_groups for r in g) == everyone
    assert all(len(g) == ep for g in p.ep_groups) and len(p.ep_groups) == p.dp
    assert p.dp * p.expert_x * p.expert == len(everyone)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_groups_span_no_more_domains_than_needed(layout):
    doms, size, ep = layout
    sizes = [len(d) for d in doms]
    try:
        p = place(doms, ep)
    except PlacementError:
        assert not all(s % ep == 0 for s in sizes)  # the fitting cases are never refused
        assert not (len(set(sizes)) == 1 and ep % sizes[0] == 0)
        return
    dom = domain_index(doms)
    need = -(-ep // size)
    assert all(domains_spanned(g, dom) <= need for g in p.ep_groups)
    for g in p.ep_groups:  # each mesh block of `expert` ranks lies inside one domain
        for i in range(0, ep, p.expert):
            assert domains_spanned(g[i : i + p.expert], dom) == 1


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_planned_network_bytes_at_most_naive(layout):
    doms, _, ep = layout
    n = sum(len(d) for d in doms)
    h100 = presets.load("h100-dgx")
    planned = place(doms, ep, allow_straddle=True)
    naive = naive_placement(n, ep, domains=doms)
    flat = network_bytes(h100, planned)
    assert flat <= network_bytes(h100, naive) * (1 + 1e-12)
    if planned.expert_x > 1 and len({len(d) for d in doms}) == 1:
        assert network_bytes(h100, planned, hierarchical=True) <= flat * (1 + 1e-12)


@settings(max_examples=150, deadline=None)
@given(
    gpn=st.sampled_from([1, 2, 4, 8]),
    npd=st.integers(1, 18),
    nodes=st.integers(1, 40),
    segment=st.booleans(),
    data=st.data(),
)
def test_allocations_place_without_straddling(gpn, npd, nodes, segment, data):
    base = presets.load("gb200-nvl72")
    cluster = dataclasses.replace(
        base,
        gpus_per_node=gpn,
        domain_size=gpn * npd,
        slurm=dataclasses.replace(base.slurm, gpus_per_node=gpn, segment=segment),
    )
    ep = data.draw(st.sampled_from(_divisors(nodes * gpn)))
    try:
        alloc = allocation(cluster, nodes, ep)
    except PlacementError as e:
        assert "valid node counts" in str(e) and "valid ep" in str(e)
        return
    if alloc.segment is not None:
        assert nodes % alloc.segment == 0 and alloc.segment <= npd
    doms = synth_domains(cluster, alloc)
    assert len(doms) == alloc.domains and sum(map(len, doms)) == nodes * gpn
    assert all(len(d) == alloc.nodes_per_domain * gpn for d in doms[:-1])
    assert 0 < len(doms[-1]) <= alloc.nodes_per_domain * gpn
    p = place(doms, ep)
    assert not p.straddling
    if ep <= cluster.domain_size:  # groups inside domains: no network traffic at all
        assert p.expert_x == 1 and network_bytes(cluster, p) == 0
    else:  # groups of whole segments (or nodes), packed domain-major
        assert p.expert_x > 1 and all(len(d) % p.expert == 0 for d in doms)
