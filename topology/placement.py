"""Expert-parallel placement: which devices form each EP group, and what to ask Slurm for.

Input is plain data: ``domains``, the global device ranks in each NVLink domain (from
discovery on a running job, or from ``synth_domains`` for a plan), and the parallel sizes.
``place`` returns a ``Placement`` whose ``order`` the trainer reshapes to the mesh
(dp, expert_x, expert), so EP group g is ``order[g*ep:(g+1)*ep]`` and data parallelism
(FSDP) runs across groups, outermost.

Rules:

* every domain holds a whole number of EP groups (ep <= domain size): each group lies inside
  one domain, ``expert_x = 1``;
* otherwise each group must be made of whole domains and span the fewest of them,
  ceil(ep / largest domain); groups are packed domain-major (first-fit decreasing by domain
  size), so the hierarchical dispatch sends each token once per remote domain;
* anything else straddles domains and is refused with the nearest valid choices, unless
  ``allow_straddle``: then the candidate order (consecutive packing, largest domain first;
  whole groups first and leftovers together; the default order) whose worst GPU has the
  fewest peers in other domains, then whose groups span the fewest domains.

``allocation`` picks the Slurm shape (``--segment`` on rack-scale NVLink presets) that makes
such a placement possible; ``synth_domains`` and ``naive_domains`` give the domains a job of
that shape, or a topology-blind one (racks filled in order), would get.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from topology.presets import Cluster, TopologyError


class PlacementError(TopologyError):
    """An EP/DP request that cannot be placed without straddling NVLink domains."""


@dataclass(frozen=True)
class Placement:
    """Where every device sits in the (dp, expert_x, expert) mesh."""

    order: list[int]  # global ranks in mesh order; EP group g is order[g*ep:(g+1)*ep]
    ep_groups: list[list[int]]  # the EP groups, in mesh (dp index) order
    ep: int  # expert-parallel group size
    dp: int  # data-parallel (FSDP) size: the number of EP groups
    expert_x: int  # mesh blocks per EP group, each in one domain (= domains spanned; 1 if ep fits)
    expert: int  # devices of a group in one mesh block (inside one domain)
    straddling: bool  # True: some EP group crosses domains more than the sizes require
    domains: list[list[int]]  # the NVLink domains this placement was made for (global ranks)
    notes: list[str]  # why this order, in words

    @property
    def mesh(self) -> tuple[int, int, int]:
        """(dp, expert_x, expert): the shape the trainer reshapes ``order`` to."""
        return self.dp, self.expert_x, self.expert


@dataclass(frozen=True)
class Allocation:
    """The Slurm allocation shape a plan asks for."""

    nodes: int  # nodes in the job
    segment: int | None  # --segment value (nodes per block group); None: no --segment
    domains: int  # NVLink domains the job is planned on
    nodes_per_domain: int  # nodes of the job per domain (without --segment the last may have fewer)
    reason: str  # one readable line: why this shape


def domain_index(domains: Sequence[Sequence[int]]) -> dict[int, int]:
    """rank -> index of its domain in ``domains``."""
    return {r: i for i, dom in enumerate(domains) for r in dom}


def domains_spanned(group: Sequence[int], domain_of: Mapping[int, int] | Sequence[int]) -> int:
    """How many distinct domains the ranks of ``group`` are in."""
    return len({domain_of[r] for r in group})


def compress(ranks: Sequence[int]) -> str:
    """Ranks as ranges: [0, 1, 2, 3, 8, 9] -> "0-3,8-9"."""
    parts: list[str] = []
    start = prev = None
    for r in ranks:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = r
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)


def _chunks(order: Sequence[int], size: int) -> list[list[int]]:
    return [list(order[i : i + size]) for i in range(0, len(order), size)]


def _check_domains(domains: Sequence[Sequence[int]]) -> int:
    """Total device count; every rank must appear in exactly one non-empty domain."""
    if not domains or any(len(d) == 0 for d in domains):
        raise PlacementError("placement needs at least one non-empty NVLink domain")
    ranks = [r for d in domains for r in d]
    if len(set(ranks)) != len(ranks):
        raise PlacementError("a device rank appears in more than one NVLink domain")
    return len(ranks)


def _groups_ok(groups: Sequence[Sequence[int]], domains: Sequence[Sequence[int]], ep: int) -> bool:
    """Each group inside one domain, or made of whole domains spanning the fewest of them."""
    dom = domain_index(domains)
    need = -(-ep // max(len(d) for d in domains))
    for g in groups:
        touched = {dom[r] for r in g}
        if len(touched) != need:
            return False
        if need > 1 and sum(len(domains[i]) for i in touched) != ep:
            return False
    return True


def _pack_whole_domains(sizes: Sequence[int], ep: int) -> list[list[int]] | None:
    """Domain indices of each EP group made of whole domains, each group spanning the fewest,
    ceil(ep / largest domain); first-fit decreasing. None when that fails or ep fits a domain."""
    biggest = max(sizes)
    if ep <= biggest:
        return None
    span = -(-ep // biggest)
    buckets: dict[int, deque[int]] = {}
    for i, size in enumerate(sizes):
        buckets.setdefault(size, deque()).append(i)
    by_size = sorted(buckets, reverse=True)
    packed: list[list[int]] = []
    while any(buckets.values()):
        first = next(size for size in by_size if buckets[size])
        group, need = [buckets[first].popleft()], ep - first
        for size in by_size:
            while need >= size and buckets[size]:
                group.append(buckets[size].popleft())
                need -= size
        if need or len(group) != span:
            return None
        packed.append(group)
    return packed


def _fits(sizes: Sequence[int], ep: int) -> bool:
    """Whether domains of these sizes hold EP groups of ``ep`` without straddling."""
    return all(s % ep == 0 for s in sizes) or _pack_whole_domains(sizes, ep) is not None


def _layout(domains: Sequence[Sequence[int]], ep: int) -> tuple[list[int], int, bool]:
    """(order, block size, valid): the best order, the mesh's inner size, and no straddle."""
    sizes = [len(d) for d in domains]
    if all(s % ep == 0 for s in sizes):
        return [r for d in domains for r in d], ep, True
    packed = _pack_whole_domains(sizes, ep)
    if packed is not None:
        order = [r for grp in packed for i in grp for r in domains[i]]
        return order, math.gcd(ep, *sizes), True
    return _straddle_order(domains, ep), ep, False


def _straddle_score(order: Sequence[int], dom: Mapping[int, int], ep: int) -> tuple[int, int]:
    """(most peers any GPU has in other domains, most domains any group spans)."""
    cross = span = 0
    for g in _chunks(order, ep):
        counts: dict[int, int] = {}
        for r in g:
            counts[dom[r]] = counts.get(dom[r], 0) + 1
        cross = max(cross, ep - min(counts.values()))
        span = max(span, len(counts))
    return cross, span


def _straddle_order(domains: Sequence[Sequence[int]], ep: int) -> list[int]:
    """The straddling order whose worst GPU has the fewest cross-domain peers, then spans least.

    Candidates: domains packed consecutively, largest first; whole groups inside each domain
    first and the leftovers together; the default order (ranks ascending), so a straddling
    plan is never worse than the topology-blind one.
    """
    by_size = sorted(domains, key=len, reverse=True)
    whole = [r for d in by_size for r in d[: len(d) - len(d) % ep]]
    rest = sorted((d[len(d) - len(d) % ep :] for d in by_size), key=len, reverse=True)
    candidates = [
        [r for d in by_size for r in d],
        whole + [r for d in rest for r in d],
        sorted(r for d in domains for r in d),
    ]
    dom = domain_index(domains)
    return min(candidates, key=lambda o: _straddle_score(o, dom, ep))


def _sizes_text(domains: Sequence[Sequence[int]]) -> str:
    """Domain sizes as "2 x 72 + 1 x 56"."""
    counts: dict[int, int] = {}
    for d in domains:
        counts[len(d)] = counts.get(len(d), 0) + 1
    return " + ".join(f"{c} x {s}" for s, c in sorted(counts.items(), reverse=True))


def valid_eps(domains: Sequence[Sequence[int]]) -> list[int]:
    """EP sizes that divide the device count and place without straddling these domains."""
    sizes = [len(d) for d in domains]
    n = sum(sizes)
    return [e for e in range(1, n + 1) if n % e == 0 and _fits(sizes, e)]


def _check_sizes(n: int, ep: int, dp: int | None, domains: Sequence[Sequence[int]]) -> int:
    """The data-parallel size; PlacementError for sizes that do not fill ``n`` devices."""
    if ep < 1 or n % ep:
        raise PlacementError(
            f"ep {ep} does not divide the {n} devices; valid ep for domains "
            f"of {_sizes_text(domains)}: {_join(valid_eps(domains))}"
        )
    if dp is not None and dp * ep != n:
        raise PlacementError(f"dp {dp} x ep {ep} = {dp * ep} but there are {n} devices; use dp {n // ep}")
    return n // ep


def _count(n: int, noun: str) -> str:
    """The count with its noun, plural unless 1: "1 node", "2 nodes"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _join(values: Sequence[int]) -> str:
    return ", ".join(map(str, values)) if values else "none"


def place(
    domains: Sequence[Sequence[int]], ep: int, dp: int | None = None, *, allow_straddle: bool = False
) -> Placement:
    """The mesh order keeping EP groups inside NVLink domains (see the module docstring)."""
    n = _check_domains(domains)
    dp = _check_sizes(n, ep, dp, domains)
    order, block, ok = _layout(domains, ep)
    sizes = _sizes_text(domains)
    if not ok and not allow_straddle:
        raise PlacementError(
            f"EP groups of {ep} would straddle NVLink domains of {sizes} devices; valid ep "
            f"for these {n} devices: {_join(valid_eps(domains))}; or use domains holding a "
            f"multiple of {ep} devices (e.g. a Slurm segment), or allow straddling"
        )
    groups = _chunks(order, ep)
    dom = domain_index(domains)
    spans = [domains_spanned(g, dom) for g in groups]
    if not ok:
        notes = [
            f"straddling allowed: {sum(s > 1 for s in spans)} of {dp} EP groups of {ep} "
            f"cross domains of {sizes} (at most {max(spans)} each); flat all-to-all"
        ]
        return Placement(order, groups, ep, dp, 1, ep, True, [list(d) for d in domains], notes)
    if block == ep:
        notes = [f"each EP group of {ep} lies inside one NVLink domain ({sizes} devices)"]
    else:
        notes = [
            f"each EP group of {ep} spans {spans[0]} whole domains ({sizes} devices), "
            f"packed domain-major: hierarchical dispatch sends each token once per "
            f"remote domain"
        ]
        if any(len(d) != block for d in domains):
            notes.append(f"mesh blocks of {block} devices: some blocks of a group share a domain")
    notes.append(f"data parallelism (FSDP) runs across {_count(dp, 'EP group')}")
    return Placement(order, groups, ep, dp, ep // block, block, False, [list(d) for d in domains], notes)


def naive_placement(
    num_devices: int, ep: int, dp: int | None = None, *, domains: Sequence[Sequence[int]] | None = None
) -> Placement:
    """The topology-blind baseline: order 0..N-1, EP groups of consecutive ranks.

    With ``domains`` (the same ranks), ``straddling`` says whether a group crosses domains
    more than the sizes require; without them it is False (unknown).
    """
    doms = [list(d) for d in domains] if domains is not None else [list(range(num_devices))]
    _check_domains(doms)
    if sorted(r for d in doms for r in d) != list(range(num_devices)):
        raise PlacementError(f"the domains must hold exactly the ranks 0..{num_devices - 1}")
    dp = _check_sizes(num_devices, ep, dp, doms)
    order = list(range(num_devices))
    groups = _chunks(order, ep)
    straddling = domains is not None and not _groups_ok(groups, doms, ep)
    dom = domain_index(doms)
    crossing = sum(domains_spanned(g, dom) > 1 for g in groups)
    notes = ["topology-blind: default device order, EP groups of consecutive ranks, flat all-to-all"]
    if domains is not None:
        notes.append(f"{crossing} of {dp} EP groups cross NVLink domains")
    return Placement(order, groups, ep, dp, 1, ep, straddling, doms, notes)


# --- Slurm allocation shape ---------------------------------------------------------------


def _domain_chunks(cluster: Cluster, nodes: int, per_domain: int) -> list[list[int]]:
    """Node-major global ranks, ``per_domain`` nodes per domain, the last domain partial."""
    g = cluster.gpus_per_node
    return [
        list(range(start * g, min(start + per_domain, nodes) * g)) for start in range(0, nodes, per_domain)
    ]


def synth_domains(cluster: Cluster, alloc: Allocation) -> list[list[int]]:
    """The domains a job of ``alloc`` gets: ranks node-major, ``nodes_per_domain`` per domain."""
    return _domain_chunks(cluster, alloc.nodes, alloc.nodes_per_domain)


def naive_domains(cluster: Cluster, nodes: int) -> list[list[int]]:
    """What Slurm gives without a plan: racks filled in order, the last one partial."""
    return _domain_chunks(cluster, nodes, cluster.nodes_per_domain)


def _segment_alloc(cluster: Cluster, nodes: int, ep: int) -> Allocation | None:
    """The largest --segment keeping EP groups inside (or made of whole) segments."""
    g, npd, dsize = cluster.gpus_per_node, cluster.nodes_per_domain, cluster.domain_size
    for s in range(min(npd, nodes), 0, -1):
        gpus = s * g
        fits = gpus % ep == 0 if ep <= dsize else ep % gpus == 0
        if nodes % s or not fits:
            continue
        if ep <= gpus:
            spare = f"{npd - s} of {npd} nodes per domain spare" if s < npd else "no spare nodes"
            what = f"each holding {_count(gpus // ep, 'EP group')} of {ep}; {spare}"
        else:
            what = f"each EP group of {ep} spans {ep // gpus} whole segments (domain-major)"
            if s < npd:
                what += "; planned as separate domains (conservative: two may share a rack)"
        reason = (
            f"--segment={s}: {_count(nodes // s, 'segment')} of {s} nodes ({gpus} GPUs), "
            f"each inside one NVLink domain, {what}"
        )
        return Allocation(nodes, s, nodes // s, s, reason)
    return None


def _domain_alloc(cluster: Cluster, nodes: int, ep: int) -> Allocation | None:
    """Without --segment: racks in order; None when EP groups would straddle them."""
    npd, g = cluster.nodes_per_domain, cluster.gpus_per_node
    sizes = [npd * g] * (nodes // npd) + ([nodes % npd * g] if nodes % npd else [])
    if not _fits(sizes, ep):
        return None
    unit = f"{_count(npd, 'node')} ({cluster.domain_size} GPUs)"
    if all(s % ep == 0 for s in sizes):
        what = f"each EP group of {ep} inside one domain"
    else:
        what = f"each EP group of {ep} spans {-(-ep // max(sizes))} domains (domain-major)"
    reason = (
        f"no --segment: {_count(nodes, 'node')} in {_count(len(sizes), 'NVLink domain')} of {unit}, {what}"
    )
    return Allocation(nodes, None, len(sizes), min(npd, nodes), reason)


def _try_allocation(cluster: Cluster, nodes: int, ep: int) -> Allocation | None:
    if nodes < 1 or ep < 1 or (nodes * cluster.gpus_per_node) % ep:
        return None
    if cluster.slurm.segment:
        return _segment_alloc(cluster, nodes, ep)
    return _domain_alloc(cluster, nodes, ep)


def valid_node_counts(cluster: Cluster, ep: int, near: int, count: int = 4) -> list[int]:
    """Up to ``count`` node counts nearest ``near`` on which EP groups of ``ep`` fit."""
    top = 2 * max(near, 1) + 4 * max(ep, cluster.nodes_per_domain)
    step = max(ep, 1) // math.gcd(max(ep, 1), cluster.gpus_per_node)  # nodes*gpus % ep == 0
    ok = [n for n in range(step, top + 1, step) if _try_allocation(cluster, n, ep)]
    return sorted(sorted(ok, key=lambda n: (abs(n - near), n))[:count])


def valid_eps_for_nodes(cluster: Cluster, nodes: int, num_experts: int | None = None) -> list[int]:
    """EP sizes (dividing ``num_experts`` when given) that fit ``nodes`` nodes of ``cluster``."""
    total = nodes * cluster.gpus_per_node
    return [
        e
        for e in range(1, total + 1)
        if (num_experts is None or num_experts % e == 0) and _try_allocation(cluster, nodes, e)
    ]


def allocation(
    cluster: Cluster, nodes: int, ep: int, *, num_experts: int | None = None, allow_straddle: bool = False
) -> Allocation:
    """The Slurm shape for ``nodes`` nodes with EP groups of ``ep`` kept inside NVLink domains.

    Segment presets (NVL72 racks) get the largest --segment that holds whole EP groups (or of
    which a group spans whole ones), is at most one domain and divides ``nodes``; others
    get the racks in order. Refusals name valid node counts and EP sizes (those dividing
    ``num_experts`` when given); ``allow_straddle`` returns racks in order instead.
    """
    if nodes < 1:
        raise PlacementError(f"nodes must be >= 1, got {nodes}")
    if ep < 1:
        raise PlacementError(f"ep must be >= 1, got {ep}")
    alloc = _try_allocation(cluster, nodes, ep)
    if alloc is not None:
        return alloc
    total = nodes * cluster.gpus_per_node
    if allow_straddle and total % ep == 0:
        npd = cluster.nodes_per_domain
        reason = (
            f"no --segment: EP groups of {ep} cannot stay inside NVLink domains of "
            f"{cluster.domain_size} GPUs on {nodes} nodes; straddling allowed, racks "
            f"filled in order"
        )
        return Allocation(nodes, None, -(-nodes // npd), min(npd, nodes), reason)
    why = (
        f"ep {ep} does not divide the {total} GPUs"
        if total % ep
        else f"EP groups of {ep} would straddle NVLink domains of {cluster.domain_size} GPUs"
    )
    raise PlacementError(
        f"{nodes} {cluster.name} nodes ({total} GPUs): {why}; valid node counts for ep {ep}: "
        f"{_join(valid_node_counts(cluster, ep, nodes))}; valid ep for {nodes} nodes: "
        f"{_join(valid_eps_for_nodes(cluster, nodes, num_experts))}"
    )
