"""The job a compile is for, built as ``make submit`` builds it; no jax here.

``configure`` takes the command line's model, cluster preset, nodes, EP and ``--set`` items,
and builds the trainer's config with the launcher's own code (``moe_train.planner.layout.model_config``:
the preset, the overrides, ``parallel.cluster``; ``moe_train.planner.choices.planned``: the step-time
planner's ``parallel.weight_gather`` and ``moe.overlap_chunks`` where the user left them
open), then the memory planner's estimate of it (``moe_train.planner.memory.plan``). ``--layers N``
is ``model.num_layers=N`` (a reduced-depth compile). Every refusal is the launcher's or the
planner's one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_train import config
from moe_train.config import Config, ConfigError
from moe_train.planner import choices, memory
from moe_train.planner import layout as launch_layout
from moe_train.planner.request import LaunchError, Request
from moe_train.planner.steptime import StepTime
from topology import presets, targets
from topology.presets import Cluster, TopologyError
from topology.targets import Target

ERRORS = (ConfigError, TopologyError, LaunchError)  # bad input: one line, exit 2


@dataclass(frozen=True)
class Job:
    """A model on whole nodes of a cluster preset, as the launcher would submit it."""

    model: str  # model preset name
    cluster: Cluster  # the cluster preset
    target: Target  # its GPU's XLA:GPU target config
    nodes: int  # nodes in the job
    layers: int | None  # --layers: reduced depth, or None (the preset's)
    cfg: Config  # the trainer's config (kernel keys as configured, e.g. auto)
    notes: tuple[str, ...]  # the launcher's planner choices, as make submit prints them
    plan: memory.Plan  # the memory planner's estimate and budget
    step: StepTime | None  # the step-time model's prediction of it (None: nothing predicted)

    @property
    def devices(self) -> int:
        return self.nodes * self.cluster.gpus_per_node


def target_of(cluster: Cluster) -> Target:
    """The target config the preset names (``gpu``); TopologyError naming those that have one."""
    if not cluster.gpu:
        with_gpu = [n for n in presets.list_presets() if presets.load(n).gpu]
        raise TopologyError(
            f"cluster preset {cluster.name!r} names no GPU with an XLA:GPU "
            f"target config (key gpu); presets that do: {', '.join(with_gpu)}; "
            f"targets: {', '.join(targets.list_targets())}"
        )
    return targets.load(cluster.gpu)


def configure(
    model: str,
    preset: str,
    nodes: int,
    ep: int | None = None,
    overrides: tuple[str, ...] = (),
    layers: int | None = None,
    steps: int | None = None,
) -> Job:
    """The job; ConfigError / TopologyError / LaunchError for bad input. ``ep``, ``layers``
    and ``steps`` are flags: a ``--set`` of the same key with another value is an error."""
    cluster = presets.load(preset)
    target = target_of(cluster)
    if nodes < 1:
        raise LaunchError(f"--nodes must be at least 1, got {nodes}")
    if layers is not None and layers < 1:
        raise LaunchError(f"--layers must be at least 1, got {layers}")
    given = {
        "--ep": ("parallel.ep", ep),
        "--layers": ("model.num_layers", layers),
        "--steps": ("train.steps", steps),
    }
    flags = {flag: (key, str(v)) for flag, (key, v) in given.items() if v is not None}
    sets = tuple(config.merge_flags(list(overrides), flags))
    req = Request(preset=preset, model=model, nodes=nodes, sets=sets)
    cfg, _ = launch_layout.model_config(req, cluster)
    req, cfg, notes = choices.planned(req, cluster, cfg)
    plan = memory.plan(cfg, cluster, nodes)
    return Job(
        model=model,
        cluster=cluster,
        target=target,
        nodes=nodes,
        layers=layers,
        cfg=cfg,
        notes=notes,
        plan=plan,
        step=_predicted(req, cfg),
    )


def _predicted(req: Request, cfg: Config) -> StepTime | None:
    """The step-time model's prediction of the job as configured (with the choices)."""
    try:
        return choices.prediction(req, cfg).step
    except (TopologyError, ConfigError, ValueError):
        return None


def planner_total(job: Job, bucket: str) -> int:
    """The planner's per-GPU total with its MoE buffers at ``bucket`` ("1", ..., "worst")."""
    est = job.plan.estimate
    return est.per_device["total"] - est.per_device["moe_buffers"] + est.moe_buffers_by_bucket[bucket]


def planner_lines(job: Job) -> list[str]:
    """``--plan-only``: the job and the planner's per-GPU total at every capacity bucket (the
    report's planner column), computed without compiling anything."""
    est, budget, gib = job.plan.estimate, job.plan.budget, float(memory.GIB)
    s = est.setup
    buckets = est.moe_buffers_by_bucket
    cells = ", ".join(f"{memory.bucket_label(b)} {planner_total(job, b) / gib:.2f}" for b in buckets)
    return [
        f"{job.model} on {job.nodes} {job.cluster.name} node(s): {job.devices} GPUs, EP {s.ep} x FSDP "
        f"{s.dp}, {s.dispatcher} dispatch, {job.cfg.model.num_layers} layers, "
        f"parallel.weight_gather={job.cfg.parallel.weight_gather}, "
        f"train.micro_batch_size={job.cfg.train.micro_batch_size}",
        *[f"launcher: {n}" for n in job.notes],
        f"planner per GPU, GiB, by capacity bucket (the planner column make compile prints; usable "
        f"{budget.usable_bytes / gib:.2f}, judged at {memory.bucket_label(est.bucket)}): "
        f"{cells}",
    ]
