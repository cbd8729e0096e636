"""All-to-all cost model for expert parallelism under uniform routing.

The model is the one in the hardware-and-topology reference notes (not shipped; "All-to-all cost
model (uniform routing)"). Symbols, per GPU:

    T tokens, H hidden size, k experts per token (top-k), b bytes per element,
    P expert-parallel (EP) group size, D = min(P, domain_size) GPUs of the group that share
    an NVLink domain (groups are packed domain-first), G = P / D domains the group spans,
    B_nv, B_ib one-way NVLink and network bandwidth, eta_* their achieved fractions,
    alpha_* per-collective latencies.

    V = T * k * H * b                       bytes one GPU sends per dispatch

Flat all-to-all (every copy of a token goes straight to its expert's GPU):

    V_nv = V * (D - 1) / P                  to the other GPUs of the own domain
    V_ib = V * (P - D) / P                  to GPUs in other domains

Hierarchical (deduplicated): a token crosses the network once per remote domain that holds
one of its k experts, then fans out over NVLink. Under uniform routing a token reaches
(G - 1) * (1 - (1 - 1/G)^k) remote domains on average, so

    V_ib = T * H * b * (G - 1) * (1 - (1 - 1/G)^k)
    V_nv = V * (D - 1) / D

In both cases NVLink and network traffic overlap, so

    t = alpha_nv + [P > D] * alpha_ib + max(V_nv / (eta_nv * B_nv), V_ib / (eta_ib * B_ib))

The same time is used for the combine (the reverse all-to-all moves the same bytes).
Bandwidths, efficiencies and latencies come from a ``topology.presets.Cluster``; T, H, k and b
travel together as a ``Traffic``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moe_train.parallel.jobplan import domain_hit
from topology.presets import Cluster

GB = 1e9  # preset bandwidths are GB/s with 1 GB = 1e9 bytes
US = 1e-6  # preset latencies are microseconds

# Per MoE layer per training step: dispatch + combine forward, and their transposes backward.
ALL_TO_ALLS_PER_LAYER = 4

Groups = Sequence[Sequence[int]]  # EP groups of global ranks
Domains = Mapping[int, int] | Sequence[int]  # rank -> index of its NVLink domain


@dataclass(frozen=True)
class Breakdown:
    """Cost of one all-to-all (a dispatch or a combine) for one GPU."""

    v_nvlink_bytes: float  # bytes this GPU sends over NVLink
    v_network_bytes: float  # bytes this GPU sends over the scale-out network
    t_nvlink_s: float  # NVLink transfer time at eta_nvlink * nvlink bandwidth, seconds
    t_network_s: float  # network transfer time at eta_network * NIC bandwidth, seconds
    latency_s: float  # fixed per-collective latency, seconds
    total_s: float  # latency_s + max(t_nvlink_s, t_network_s): the two links overlap


@dataclass(frozen=True)
class LayerCost:
    """Cost of one MoE layer for one GPU over one training step (forward and backward)."""

    all_to_all: Breakdown  # one all-to-all; the layer does ALL_TO_ALLS_PER_LAYER of them
    comm_s: float  # ALL_TO_ALLS_PER_LAYER * all_to_all.total_s
    gemm_flops: float  # expert GEMM FLOPs, forward and backward
    gemm_s: float  # gemm_flops at the cluster's dense bf16 peak (a lower bound)
    total_s: float  # comm_s + gemm_s, i.e. with no overlap of communication and compute
    comm_fraction: float  # comm_s / total_s


@dataclass(frozen=True)
class Traffic:
    """What one GPU dispatches: T tokens of H elements of b bytes, each to its k experts."""

    T: int  # tokens per GPU
    H: int  # hidden size
    k: int  # experts per token (top-k)
    bytes_per_elem: float  # b, bytes per element (2: bf16)

    @property
    def v(self) -> float:
        """V = T * k * H * b: the bytes one GPU sends per dispatch."""
        return self.T * self.k * self.H * self.bytes_per_elem


def _check(t: Traffic, ep: int, domain: int) -> None:
    """Reject sizes the model has no meaning for."""
    for name, value in (*dataclasses.asdict(t).items(), ("ep", ep)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if ep > domain and ep % domain:
        raise ValueError(
            f"ep {ep} spans several NVLink domains of {domain} GPUs but is not a "
            f"multiple of {domain}; EP groups are packed domain-first"
        )


def remote_domains_per_token(groups: int, k: int) -> float:
    """Expected number of other domains a token's k experts fall in: (G-1)(1-(1-1/G)^k)."""
    if groups <= 1:
        return 0.0
    return (groups - 1) * domain_hit(groups, k)


def dispatch_bytes(t: Traffic, ep: int, domain_size: int, hierarchical: bool) -> tuple[float, float]:
    """(V_nv, V_ib): bytes one GPU sends over NVLink and over the network per dispatch."""
    _check(t, ep, domain_size)
    v = t.v
    d = min(ep, domain_size)
    if not hierarchical:
        return v * (d - 1) / ep, v * (ep - d) / ep
    g = ep // d
    return v * (d - 1) / d, t.T * t.H * t.bytes_per_elem * remote_domains_per_token(g, t.k)


def dispatch_time(cluster: Cluster, t: Traffic, ep: int, hierarchical: bool = False) -> Breakdown:
    """Time of one dispatch (or combine) all-to-all on ``cluster``, per the model above."""
    v_nv, v_ib = dispatch_bytes(t, ep, cluster.domain_size, hierarchical)
    nvlink, network = _rates(cluster)
    return _breakdown(cluster, v_nv, v_ib, v_nv / nvlink, v_ib / network, ep > cluster.domain_size)


def _rates(cluster: Cluster) -> tuple[float, float]:
    """(NVLink, network) bytes per second one GPU achieves: eta * bandwidth."""
    return (
        cluster.eta_nvlink * cluster.nvlink_gbps_per_gpu * GB,
        cluster.eta_network * cluster.nic_gbps_per_gpu * GB,
    )


def _breakdown(
    cluster: Cluster, v_nv: float, v_ib: float, t_nv: float, t_ib: float, spans: bool
) -> Breakdown:
    """One all-to-all of these bytes and transfer times: the NVLink latency, plus the network's
    when a group ``spans`` NVLink domains, plus the slower of the two overlapping links."""
    latency = cluster.latency_nvlink_us * US
    if spans:
        latency += cluster.latency_network_us * US
    return Breakdown(
        v_nvlink_bytes=v_nv,
        v_network_bytes=v_ib,
        t_nvlink_s=t_nv,
        t_network_s=t_ib,
        latency_s=latency,
        total_s=latency + max(t_nv, t_ib),
    )


def expert_gemm_flops(T: int, H: int, k: int, F: int) -> float:
    """Expert SwiGLU GEMM FLOPs for T tokens, forward and backward.

    Each of the T*k routed token copies does three H x F matmuls (gate, up, down) at
    2 FLOPs per multiply-add: 2 * T*k * 3*H*F forward; backward costs twice the forward,
    so forward + backward = 3 * 2 * T*k * 3*H*F.
    """
    if F <= 0:
        raise ValueError(f"F must be > 0, got {F}")
    return 3 * 2 * T * k * 3 * H * F


def layer_time(cluster: Cluster, t: Traffic, F: int, ep: int, hierarchical: bool = False) -> LayerCost:
    """Per-GPU cost of one MoE layer per step: 4 all-to-alls plus the expert GEMMs (F: the
    routed experts' SwiGLU width).

    The 4 all-to-alls are dispatch and combine in the forward pass and their transposes in
    the backward pass. The GEMM time uses the dense bf16 peak, so it is a lower bound and
    the communication fraction an upper bound for a given cluster.
    """
    return _layer_cost(cluster, dispatch_time(cluster, t, ep, hierarchical), t, F)


def _layer_cost(cluster: Cluster, a2a: Breakdown, t: Traffic, F: int) -> LayerCost:
    """One MoE layer per step: ALL_TO_ALLS_PER_LAYER of ``a2a`` plus the expert GEMMs at the
    dense bf16 peak."""
    comm = ALL_TO_ALLS_PER_LAYER * a2a.total_s
    flops = expert_gemm_flops(t.T, t.H, t.k, F)
    gemm = flops / cluster.peak_bf16_flops
    total = comm + gemm
    return LayerCost(
        all_to_all=a2a, comm_s=comm, gemm_flops=flops, gemm_s=gemm, total_s=total, comm_fraction=comm / total
    )


# --- Cost of an arbitrary placement ---------------------------------------------------------
#
# For a placement (EP groups of global ranks, and each rank's NVLink domain) under uniform
# routing, each GPU of a group of P sends V/P to every other member: the bytes to members of
# its own domain go over NVLink, the rest over the network. The collective finishes when its
# slowest GPU does, so its time is the worst GPU's max(t_nvlink, t_network) plus the latency
# terms of dispatch_time (the network latency when any group spans domains). For groups
# packed domain-major with the same number D of GPUs in each of their domains this is
# exactly the flat formula above with that D; the hierarchical variant uses dispatch_bytes
# with hierarchical=True for such groups.


def _group_bytes(
    group: Sequence[int], domain_of: Domains, t: Traffic, hierarchical: bool
) -> list[tuple[float, float]]:
    """(V_nv, V_ib) for each GPU of one EP group, in group order."""
    p = len(group)
    counts: dict = {}
    for r in group:
        counts[domain_of[r]] = counts.get(domain_of[r], 0) + 1
    if hierarchical:
        per_domain = set(counts.values())
        if len(per_domain) != 1:
            raise ValueError(
                f"hierarchical dispatch needs the same number of GPUs of a group in "
                f"each of its domains, got {sorted(counts.values())}"
            )
        pair = dispatch_bytes(t, p, per_domain.pop(), hierarchical=True)
        return [pair] * p
    out = []
    for r in group:
        same = counts[domain_of[r]] - 1
        out.append((t.v * same / p, t.v * (p - 1 - same) / p))
    return out


def placement_dispatch_time(
    cluster: Cluster, groups: Groups, domain_of: Domains, t: Traffic, hierarchical: bool = False
) -> Breakdown:
    """One dispatch (or combine) all-to-all over ``groups``: the slowest GPU's Breakdown.

    ``groups`` are EP groups of global ranks; ``domain_of[rank]`` is the rank's NVLink domain
    (a dict or a sequence). ``hierarchical`` needs every group to hold the same number of
    GPUs in each domain it touches (domain-major packing).
    """
    if not groups:
        raise ValueError("no EP groups")
    largest = max(len(g) for g in groups)
    _check(t, largest, largest)
    eta_nv, eta_ib = _rates(cluster)
    worst = None
    spans = False
    for g in groups:
        spans = spans or len({domain_of[r] for r in g}) > 1
        for v_nv, v_ib in _group_bytes(g, domain_of, t, hierarchical):
            t_nv, t_ib = v_nv / eta_nv, v_ib / eta_ib
            if worst is None or max(t_nv, t_ib) > max(worst[2], worst[3]):
                worst = (v_nv, v_ib, t_nv, t_ib)
    assert worst is not None, "at least one group"
    return _breakdown(cluster, *worst, spans)


def placement_layer_time(
    cluster: Cluster, groups: Groups, domain_of: Domains, t: Traffic, F: int, hierarchical: bool = False
) -> LayerCost:
    """``layer_time`` for a placement: 4 of its all-to-alls plus the expert GEMMs per GPU."""
    return _layer_cost(cluster, placement_dispatch_time(cluster, groups, domain_of, t, hierarchical), t, F)
