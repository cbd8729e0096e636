"""What the step-time planner chooses for a job the user left open, as the launcher's own
``--set`` items, each with a note saying so (``make submit`` prints the notes; the job script
carries the items like any ``--set``, so the trainer validates them again).

Two keys, in this order, each only where the user did not ``--set`` it:

- ``parallel.weight_gather``: the mode of the shortest predicted step (``topology.steptime``:
  ``step`` gathers the weights once per step instead of once per micro-batch), only when it
  beats the current mode by more than 1% and the memory planner says the job still fits
  (``step`` holds a compute-dtype copy of the weights; otherwise the note says what it would
  need and the mode stays);
- ``moe.overlap_chunks``: the fewest chunks within 1% of the shortest predicted step, for the
  weight gathering chosen above.

Nothing is chosen where nothing can be predicted (fp32 compute, a nominal CPU preset).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from moe_train import config
from slurm import layout
from topology import presets

if TYPE_CHECKING:
    from slurm.plan import Request
    from topology.steptime import StepTime

GATHER_KEY = "parallel.weight_gather"
CHUNKS_KEY = "moe.overlap_chunks"
GiB = 1024**3


def planned(req: "Request", cluster: presets.Cluster,
            cfg: config.Config) -> tuple["Request", config.Config, list[str]]:
    """(``req`` with the planner's choices appended to its ``--set`` items, its config, the
    notes)."""
    notes = []
    for choose in (_gather, _chunks):
        item, note = choose(req, cluster, cfg)
        if note:
            notes.append(note)
        if item:
            req = dataclasses.replace(req, sets=(*req.sets, item))
            cfg, _ = layout.model_config(req, cluster)
    return req, cfg, notes


def _user_set(req: "Request", key: str) -> bool:
    return any(item.partition("=")[0].strip() == key for item in req.sets)


def _step(req: "Request", cfg: config.Config) -> "StepTime | None":
    """The predicted step of this job as the user's ``--set`` items make it, or None."""
    from topology import plan as topo_plan

    try:
        return topo_plan.make_plan(req.preset, req.nodes, req.model, cfg.parallel.ep,
                                   allow_straddle=req.allow_straddle,
                                   overrides=tuple(req.sets)).step
    except (presets.TopologyError, config.ConfigError, ValueError):
        return None  # the launcher's own checks already passed; predict nothing


def _seconds(by: dict) -> str:
    return ", ".join(f"{k}: {s:.3f}" for k, s in by.items())


def _gather(req: "Request", cluster: presets.Cluster,
            cfg: config.Config) -> tuple[str | None, str | None]:
    """(``parallel.weight_gather=MODE`` to add or None, the note or None)."""
    from moe_train import memory

    step = None if _user_set(req, GATHER_KEY) else _step(req, cfg)
    if step is None or not step.by_gather:
        return None, None
    now = cfg.parallel.weight_gather
    best = min(step.by_gather, key=step.by_gather.get)
    if best == now or step.by_gather[best] > 0.99 * step.by_gather[now]:
        return None, None
    chosen = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                  weight_gather=best))
    try:
        verdict = memory.check_fits(chosen, cluster, req.nodes)
    except memory.PlanError:
        return None, None
    used = f"{verdict.total_bytes / GiB:.1f} of {verdict.usable_bytes / GiB:.1f} GiB"
    by = _seconds(step.by_gather)
    if not verdict.fits:
        return None, (f"fsdp: {GATHER_KEY}={now} kept: {best} predicts a shorter step "
                      f"(s by mode: {by}) but needs {used} per GPU")
    return (f"{GATHER_KEY}={best}",
            f"fsdp: {GATHER_KEY}={best}, the planner's choice (predicted step s by mode: {by}; "
            f"memory {used} per GPU); --set {GATHER_KEY}={now} to choose")


def _chunks(req: "Request", cluster: presets.Cluster,
            cfg: config.Config) -> tuple[str | None, str | None]:
    """(``moe.overlap_chunks=N`` to add or None, the note or None)."""
    step = None if _user_set(req, CHUNKS_KEY) else _step(req, cfg)
    if step is None or step.best_chunks == cfg.moe.overlap_chunks:
        return None, None
    item = f"{CHUNKS_KEY}={step.best_chunks}"
    return item, (f"overlap: {item}, the planner's choice (predicted step s by chunks: "
                  f"{_seconds(step.by_chunks)}); --set {CHUNKS_KEY}=N to choose")
