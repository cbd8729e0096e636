"""The trainer's device mesh: where each device sits in it, the topology plan applied to a job.

0. Read the cluster preset ``parallel.cluster`` names, if any (``topology.presets``): a name
   or file that is no valid preset is refused here (exit 2, naming the key), before the run
   writes anything; the config does not read presets.
1. Discover the NVLink domain of every device of the job (``topology.discovery``: NVML
   fabric info, JAX's partition index, the Slurm block, the host; or, with
   ``parallel.domain_size=N``, fake domains of N consecutive devices for CPU runs and tests).
2. Check the domains against the cluster preset (``parallel.cluster``) and warn loudly when
   the job did not land as planned (e.g. a one-rack job spread over two racks).
3. Place the EP groups (``topology.placement``): every group inside one domain when it fits,
   else across the fewest domains, packed domain-major; a request that would straddle
   domains is refused (exit 2) unless ``parallel.allow_straddle=true``.
4. Build the mesh ``(data, expert_x, expert)`` from that device order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
from jax.sharding import Mesh

from moe_train.config import Config, ConfigError
from moe_train.parallel import sharding
from topology import discovery, placement, presets


@dataclass(frozen=True)
class Layout:
    """The mesh of a run and what to tell the user about it."""

    mesh: Mesh  # devices in placement order, shape (dp, expert_x, expert)
    placement: placement.Placement  # EP groups as device ids, and why
    lines: tuple[str, ...]  # discovery summary and placement notes, for the log
    warnings: tuple[str, ...]  # mismatches against the cluster preset, for the log


def domains(
    cfg: Config,
    devices: Sequence[jax.Device],
    preset: presets.Cluster | None = None,
) -> tuple[list[list[int]], str, list[str]]:
    """(device ids per domain, one-line summary, warnings against ``preset``) for the chosen
    ``devices``."""
    ids = {d.id for d in devices}
    size = cfg.parallel.domain_size
    if size:
        order = sorted(ids)
        if len(order) % size:
            raise ConfigError(
                f"parallel.domain_size={size} does not divide the {len(order)} "
                f"devices; choose one of "
                f"{', '.join(str(s) for s in range(1, len(order) + 1) if len(order) % s == 0)}"
            )
        groups = [order[i : i + size] for i in range(0, len(order), size)]
        return groups, f"{len(order)} devices in {len(groups)} fake domains of {size}", []
    records = [r for r in discovery.discover() if r.device_id in ids]
    warnings = [] if preset is None else discovery.check_against(preset, records)
    return discovery.domains_of(records), discovery.summary(records), warnings


def cluster_of(cfg: Config) -> presets.Cluster | None:
    """The preset ``parallel.cluster`` names (None when it names none); a ConfigError naming
    the key for a name or file that is no valid preset."""
    if not cfg.parallel.cluster:
        return None
    try:
        return presets.load(cfg.parallel.cluster)
    except presets.TopologyError as err:
        raise ConfigError(f"parallel.cluster: {err}") from None


def build(cfg: Config, devices: Sequence[jax.Device]) -> Layout:
    """The mesh for ``devices`` (every process calls this together: discovery gathers)."""
    preset = cluster_of(cfg)
    dp, ep = sharding.mesh_shape(cfg.parallel, len(devices), cfg.moe.num_experts, cfg.model.hidden)
    groups, summary, warnings = domains(cfg, devices, preset)
    try:
        plan = placement.place(groups, ep, dp, allow_straddle=cfg.parallel.allow_straddle)
    except placement.PlacementError as err:
        raise ConfigError(f"parallel.ep={ep}: {err} (parallel.allow_straddle=true)") from None
    by_id = {d.id: d for d in devices}
    ordered = [by_id[i] for i in plan.order]
    mesh = sharding.make_mesh(ordered, (dp, plan.expert_x, plan.expert))
    return Layout(mesh=mesh, placement=plan, lines=(summary, *plan.notes), warnings=tuple(warnings))
