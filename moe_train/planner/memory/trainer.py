"""The memory planner as the trainer asks it before starting (``moe_train.train.fits.MemoryModel``):
the entry points pass this module in, so the trainer core never imports the planner."""

from __future__ import annotations

from moe_train.config import Config, ConfigError
from moe_train.planner.memory.estimate import Estimate, estimate
from moe_train.planner.memory.job import PlanError, setup_for
from moe_train.planner.memory.verdict import alternatives


def need(cfg: Config, cluster, n: int) -> Estimate | None:
    """The planner's per-device ``Estimate`` of ``cfg`` on ``n`` devices of ``cluster`` (None
    where the planner cannot model the job; the trainer's own checks report those)."""
    try:
        return estimate(cfg, setup_for(cfg, cluster, 1, devices=n))
    except (PlanError, ConfigError):
        return None


def local_change(cfg: Config, est: Estimate, cluster, usable: int) -> str | None:
    """The cheapest single change of ``train.*``/``parallel.*`` keys that fits in ``usable``
    bytes per device on these devices (``verdict.alternatives``; more nodes are ``make plan``'s)."""
    try:
        alts = alternatives(cfg, cluster, 1, est.setup.devices, usable, est.per_device["total"])
    except ConfigError:
        return None
    return next((a.change for a in alts if a.fits and a.available and "nodes=" not in a.change), None)
