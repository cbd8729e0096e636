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
``decided`` says, for both keys, the job's value and who chose it (``make plan`` shows it);
``planned`` is its notes only (``make submit``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_train import config
from slurm import layout
from topology import presets

if TYPE_CHECKING:
    from slurm.plan import Request
    from topology.plan import Plan
    from topology.steptime import StepTime

GATHER_KEY = "parallel.weight_gather"
CHUNKS_KEY = "moe.overlap_chunks"
GiB = 1024**3
USER, PLANNER, PRESET = "user", "planner", "preset"  # Choice.source


@dataclass(frozen=True)
class Choice:
    """One key the planner decides, as the job has it."""

    key: str  # GATHER_KEY or CHUNKS_KEY
    value: str  # the job's value
    source: str  # USER: a --set item; PLANNER: the launcher's --set item; PRESET: left as it was
    note: str | None  # the line make submit prints about it; None: nothing to say

    @property
    def item(self) -> str:
        return f"{self.key}={self.value}"


def _value(cfg: config.Config, key: str) -> str:
    return str(cfg.parallel.weight_gather if key == GATHER_KEY else cfg.moe.overlap_chunks)


def decided(req: "Request", cluster: presets.Cluster,
            cfg: config.Config) -> tuple["Request", config.Config, tuple[Choice, ...]]:
    """(``req`` with the planner's choices appended to its ``--set`` items, its config, one
    Choice per key in the order above)."""
    out = []
    for key, choose in ((GATHER_KEY, _gather), (CHUNKS_KEY, _chunks)):
        if _user_set(req, key):
            out.append(Choice(key, _value(cfg, key), USER, None))
            continue
        item, note = choose(req, cluster, cfg)
        if item:
            req = dataclasses.replace(req, sets=(*req.sets, item))
            cfg, _ = layout.model_config(req, cluster)
        out.append(Choice(key, _value(cfg, key), PLANNER if item else PRESET, note))
    return req, cfg, tuple(out)


def planned(req: "Request", cluster: presets.Cluster,
            cfg: config.Config) -> tuple["Request", config.Config, list[str]]:
    """(``req`` with the planner's choices appended to its ``--set`` items, its config, the
    notes)."""
    req, cfg, chosen = decided(req, cluster, cfg)
    return req, cfg, [c.note for c in chosen if c.note]


def _user_set(req: "Request", key: str) -> bool:
    return any(item.partition("=")[0].strip() == key for item in req.sets)


def prediction(req: "Request", cfg: config.Config) -> "Plan":
    """The placement, all-to-all and predicted step of this job as its ``--set`` items make
    it (``topology.plan``); TopologyError, ConfigError or ValueError where it cannot be made."""
    from topology import plan as topo_plan

    return topo_plan.make_plan(req.preset, req.nodes, req.model, cfg.parallel.ep,
                               allow_straddle=req.allow_straddle, overrides=tuple(req.sets),
                               compute=req.compute or None)


def _step(req: "Request", cfg: config.Config) -> "StepTime | None":
    """The predicted step of this job as the user's ``--set`` items make it, or None."""
    try:
        return prediction(req, cfg).step
    except (presets.TopologyError, config.ConfigError, ValueError):
        return None  # the launcher's own checks already passed; predict nothing


def _seconds(by: dict) -> str:
    return ", ".join(f"{k}: {s:.3f}" for k, s in by.items())


def _gather(req: "Request", cluster: presets.Cluster,
            cfg: config.Config) -> tuple[str | None, str | None]:
    """(``parallel.weight_gather=MODE`` to add or None, the note or None)."""
    from moe_train import memory

    step = _step(req, cfg)
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
    step = _step(req, cfg)
    if step is None or step.best_chunks == cfg.moe.overlap_chunks:
        return None, None
    item = f"{CHUNKS_KEY}={step.best_chunks}"
    return item, (f"overlap: {item}, the planner's choice (predicted step s by chunks: "
                  f"{_seconds(step.by_chunks)}); --set {CHUNKS_KEY}=N to choose")
