"""What a request becomes before anything Slurm- or image-specific: the job ``make plan`` shows
and ``make submit`` runs, built once (``decide``) for both.

The trainer's config (``moe_train.planner.layout.model_config``: the model preset, the user's ``--set``
items, ``--ep``, ``--steps``), the batch against the job's GPUs and micro-batches
(``moe_train.parallel.jobplan.check_batch``: a batch that does not split names the nearest
sizes that do, with their tokens per step), the planner's choices (``moe_train.planner.choices``: the
fastest job of its search, ``moe_train.planner.search``, that fits), the placement (``--segment``) and
the memory plan (``moe_train.planner.memory``), whose verdict XLA:GPU's compiled peak decides where
the submit preflight's cache holds one for the job (``moe_train.planner.preflight.cached_peak``; the
estimate beside it). No site file, no image, no Slurm: ``slurm.plan.plan`` (the launcher) adds those to
make the JobSpec, ``moe_train.planner.show`` prints this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_train import config
from moe_train.base.calls import from_names
from moe_train.parallel import jobplan
from moe_train.planner import choices, compute, layout, memory, preflight, search
from moe_train.planner.memory import Plan as MemoryPlan
from moe_train.planner.request import LaunchError, Request, check_text, load_cluster, smoke_request
from topology import presets
from topology.placement import valid_eps_for_nodes


@dataclass(frozen=True)
class Decision(choices.Decided):
    """What ``decide`` made of a request: the job both ``make plan`` and ``make submit`` show.
    Its ``choices.Decided`` part: the request (the smoke job's, for --smoke) and the trainer's
    config with the planner's choices applied, each key's value and who chose it, the search
    (``found``; None: nothing predicted) and its line (``search_note``, make submit prints it)."""

    cluster: presets.Cluster  # the cluster preset
    ep: int  # expert-parallel size (the planner's where the user left it open)
    segment: int | None  # the --segment the placement asks for (None: none)
    placement: tuple[str, ...]  # placement notes (its reason; a straddle warning)
    memory: MemoryPlan  # the job's memory plan: estimate, budget, verdict
    per_task: int  # devices each task drives

    @property
    def fits(self) -> bool:
        return self.memory.verdict.fits


def decide(req: Request, top: int = 1) -> Decision:
    """Everything about the job that needs neither a site file nor an image: the config, the
    planner's choices (``top``: how many jobs its search ranks, ``Decision.found``), the
    placement and the memory plan; LaunchError for a job the trainer would refuse (a batch
    that does not split over the GPUs names the nearest sizes that do)."""
    cluster = load_cluster(req.preset)
    req = smoke_request(req, cluster) if req.smoke else req
    if req.nodes < 1:
        raise LaunchError(f"--nodes must be at least 1, got {req.nodes}")
    if req.compute:
        _check_compute(req.compute)
    req, cfg = _model_config(req, cluster)
    chosen = choices.decided(req, cluster, cfg, top)  # rendered as the launcher's --set
    req, cfg, ep = chosen.req, chosen.cfg, chosen.cfg.parallel.ep
    segment, placement = layout.placement(req, cluster, ep, cfg)
    per_task, rest = divmod(cluster.gpus_per_node, cluster.slurm.ntasks_per_node)
    if rest or not per_task:
        raise LaunchError(
            f"cluster preset {cluster.name}: slurm.ntasks_per_node "
            f"{cluster.slurm.ntasks_per_node} does not divide its "
            f"{cluster.gpus_per_node} devices per node"
        )
    try:
        mem = memory.plan(cfg, cluster, req.nodes, compiled=preflight.cached_peak(req, cluster, cfg))
    except memory.PlanError as err:  # sizes the trainer would refuse too (e.g. width vs dp)
        raise LaunchError(str(err)) from None
    return from_names(  # req, cfg, choices, found, search_note: the chosen job's
        Decision,
        chosen,
        cluster=cluster,
        ep=ep,
        segment=segment,
        placement=placement,
        memory=mem,
        per_task=per_task,
    )


def with_compiled(d: Decision) -> Decision:
    """``d`` with its memory verdict decided by XLA:GPU's compiled peak where the cache holds
    one for the job now (the submit preflight has just compiled it); else ``d`` itself."""
    peak = preflight.cached_peak(d.req, d.cluster, d.cfg)
    if peak is None or peak == d.memory.verdict.compiled:
        return d
    return dataclasses.replace(d, memory=memory.plan(d.cfg, d.cluster, d.req.nodes, compiled=peak))


def _check_compute(path: str) -> None:
    try:
        compute.load(check_text("compute calibration", path))
    except presets.TopologyError as err:
        raise LaunchError(str(err)) from None


def _model_config(req: Request, cluster: presets.Cluster) -> tuple[Request, config.Config]:
    """``layout.model_config``, then the batch against the GPUs and micro-batches
    (``jobplan.check_batch``, whose message names the nearest batch sizes that split). A
    model preset's ``parallel.ep`` that does not divide the job's GPUs (the user set no EP)
    gives way to the largest valid EP below it (``Request.ep_fitted``), which the search
    then treats as the preset's."""
    gpus = req.nodes * cluster.gpus_per_node
    try:
        cfg, _ = layout.model_config(req, cluster)
    except LaunchError:
        bare = _bare_config(req)  # the layout's refusal may be the batch: name the sizes
        fault = None if bare is None else jobplan.ep_fault(gpus, bare.parallel.ep, bare.moe.num_experts)
        if bare is not None and not fault:
            _check_batch(bare, gpus)
        fitted = _fitted_ep(req, cluster, bare) if fault == "devices" and bare is not None else None
        if fitted is None or bare is None:
            raise
        req = dataclasses.replace(req, ep=fitted, ep_fitted=bare.parallel.ep)
        cfg, _ = layout.model_config(req, cluster)
    _check_batch(cfg, gpus)
    return req, cfg


def _fitted_ep(req: Request, cluster: presets.Cluster, bare: config.Config) -> int | None:
    """The largest EP below the model preset's that the job's GPUs and the experts allow,
    where the user fixed no EP (None: the user did, or none is valid)."""
    if req.ep is not None or "parallel.ep" in search.user_keys(req) or "parallel.dp" in search.user_keys(req):
        return None
    valid = [e for e in valid_eps_for_nodes(cluster, req.nodes, bare.moe.num_experts) if e < bare.parallel.ep]
    return max(valid) if valid else None


def _bare_config(req: Request) -> config.Config | None:
    """The model preset with the user's --set items and --ep, or None where it does not build."""
    ep = [] if req.ep is None else [f"parallel.ep={req.ep}"]
    try:
        return config.build(req.model, [*req.sets, *ep])
    except config.ConfigError:
        return None


def _check_batch(cfg: config.Config, gpus: int) -> None:
    """LaunchError unless the batch splits over the ``gpus`` and then into micro-batches."""
    t = cfg.train
    if t.batch_size % gpus:
        raise LaunchError(
            f"train.batch_size={t.batch_size} is not divisible by the job's {gpus} "
            f"GPUs; nearest that are: "
            f"{jobplan.batches_text(t.batch_size, gpus, t.seq_len)} "
            f"(--set train.batch_size=N)"
        )
    try:
        jobplan.check_batch(t.batch_size, gpus, t.micro_batches, seq_len=t.seq_len)
        config.for_devices(cfg, gpus)  # train.micro_batch_size against the sequences per GPU
    except config.ConfigError as err:
        raise LaunchError(str(err)) from None
