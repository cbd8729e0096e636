"""The trainer side of a job: its config, EP size, Slurm shape (``--segment``) and arguments.

``model_config`` builds the trainer's config exactly as the trainer will (preset + ``--set``
overrides + what the launcher adds) so unknown keys and bad values are refused before
submitting. ``check_ep`` and ``placement`` make sure the EP size fits the job's GPUs and the
model's experts and keeps EP groups inside NVLink domains (``topology.placement.allocation``
chooses ``--segment``); a layout that straddles domains needs ``--allow-straddle`` and comes
with a warning stating its predicted all-to-all cost (``moe_train.planner.ep_plan``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from moe_train import config
from moe_train.parallel import jobplan
from moe_train.planner import cost
from moe_train.planner.request import LaunchError, check_text
from topology import presets
from topology.placement import (
    PlacementError,
    allocation,
    domain_index,
    place,
    synth_domains,
    valid_eps_for_nodes,
)

if TYPE_CHECKING:
    from moe_train.planner.request import Request

# --set keys the launcher decides; a user value would contradict the job's shape
LAUNCHER_KEYS = (
    "parallel.devices",
    "parallel.coordinator",
    "parallel.num_processes",
    "parallel.process_id",
    "parallel.cluster",
    "parallel.allow_straddle",
)


def _error(message: str) -> Exception:
    return LaunchError(message)


def cluster_ref(preset: str) -> str:
    """How the trainer names the cluster: the preset name, or the site file's absolute path."""
    if preset.endswith(".toml") or "/" in preset:
        return str(Path(preset).expanduser().absolute())
    return preset


def trainer_cluster_overrides(preset: str, allow_straddle: bool) -> list[str]:
    """``parallel.cluster`` (and ``parallel.allow_straddle``) for the trainer.

    On while ``moe_train.config.ParallelConfig`` has the fields (the trainer uses them for
    MFU peaks and its own topology checks); an older trainer gets neither.
    """
    fields = {f.name for f in dataclasses.fields(config.ParallelConfig)}
    out = [f"parallel.cluster={cluster_ref(preset)}"] if "cluster" in fields else []
    if allow_straddle and "allow_straddle" in fields:
        out.append("parallel.allow_straddle=true")
    return out


def model_config(req: Request, cluster: presets.Cluster) -> tuple[config.Config, int]:
    """(the trainer's validated config, EP size); LaunchError for any bad key or value."""
    for item in req.sets:
        check_text("--set", item)
        key = item.partition("=")[0].strip()
        if key in LAUNCHER_KEYS:
            raise _error(
                f"--set {key} is chosen by the launcher from the cluster preset and "
                f"--nodes; drop it (use --ep for parallel.ep)"
            )
    extra = list(req.sets)
    if req.ep is not None:
        extra.append(f"parallel.ep={req.ep}")
    if req.steps is not None:
        extra.append(f"train.steps={req.steps}")
    extra += trainer_cluster_overrides(req.preset, req.allow_straddle)
    try:
        cfg = config.build(check_text("model preset", req.model), extra)
    except config.ConfigError as err:
        raise _error(str(err).replace("unknown preset", "unknown model preset")) from None
    check_ep(cfg, cluster, req.nodes, cfg.parallel.ep)
    return cfg, cfg.parallel.ep


def check_ep(cfg: config.Config, cluster: presets.Cluster, nodes: int, ep: int) -> None:
    """EP divides the job's GPUs and the experts; the batch divides over the GPUs."""
    gpus = nodes * cluster.gpus_per_node
    experts = cfg.moe.num_experts
    fault = jobplan.ep_fault(gpus, ep, experts)  # the trainer's rule, in the launcher's words
    if fault:
        why = (
            f"does not divide the {gpus} GPUs of {nodes} {cluster.name} node(s)"
            if fault == "devices"
            else f"does not divide the model's {experts} experts"
        )
        valid = valid_eps_for_nodes(cluster, nodes, experts) if ep >= 1 else []
        raise _error(f"ep {ep} {why}; valid ep: {', '.join(map(str, valid)) or 'none'}")
    try:
        jobplan.check_batch(cfg.train.batch_size, gpus)
    except config.ConfigError:
        raise _error(
            f"train.batch_size={cfg.train.batch_size} is not divisible by the job's "
            f"{gpus} GPUs; use a multiple of {gpus} (--set train.batch_size=...)"
        ) from None


def placement(
    req: Request, cluster: presets.Cluster, ep: int, cfg: config.Config
) -> tuple[int | None, tuple[str, ...]]:
    """(the --segment value or None, lines telling the user what was chosen and why)."""
    experts = cfg.moe.num_experts
    notes: list[str] = []
    try:
        alloc = allocation(cluster, req.nodes, ep, num_experts=experts)
    except PlacementError as err:
        if not req.allow_straddle:
            raise _error(
                f"{err}; or pass --allow-straddle to accept EP groups across NVLink domains"
            ) from None
        alloc = allocation(cluster, req.nodes, ep, num_experts=experts, allow_straddle=True)
        notes.append(straddle_warning(cluster, alloc, ep, cfg))
    return alloc.segment, (f"placement: {alloc.reason}", *notes)


def straddle_warning(cluster: presets.Cluster, alloc, ep: int, cfg: config.Config) -> str:
    """One line: EP groups cross NVLink domains, and the all-to-all's predicted cost.

    Priced with ``moe_train.planner.cost`` on the domains the allocation gets (flat all-to-all, bf16,
    tokens per GPU from the config's batch), per GPU.
    """
    head = (
        f"warning: EP groups of {ep} straddle {cluster.name}'s NVLink domains of "
        f"{cluster.domain_size} GPUs (--allow-straddle)"
    )
    m, e, t = cfg.model, cfg.moe, cfg.train
    try:
        p = place(synth_domains(cluster, alloc), ep, allow_straddle=True)
        tokens = max(1, t.batch_size * t.seq_len // len(p.order))
        traffic, dom = cost.Traffic(tokens, m.hidden, e.top_k, 2), domain_index(p.domains)
        layer = cost.placement_layer_time(cluster, p.ep_groups, dom, traffic, e.expert_ffn)
    except (presets.TopologyError, ValueError):
        return head + "; its all-to-all traffic crosses the scale-out network"
    moe_layers = config.moe_layer_count(m)  # the MTP modules' MoE blocks too
    net_gb = cost.ALL_TO_ALLS_PER_LAYER * layer.all_to_all.v_network_bytes * moe_layers / 1e9
    return (
        f"{head}: predicted all-to-all {layer.comm_s * 1e3:.3f} ms per MoE layer "
        f"({layer.comm_fraction:.0%} of its time), {layer.comm_s * moe_layers:.3f} s and "
        f"{net_gb:.2f} GB over the network per GPU per step ({tokens} tokens per GPU, "
        f"preset bandwidths, flat all-to-all)"
    )


def trainer_args(
    req: Request, cluster: presets.Cluster, cfg: config.Config, ep: int, run_dir: Path, per_task: int
) -> tuple[str, ...]:
    """``python -m moe_train`` arguments of every task (the user's --set first, ours last)."""
    args = ["--preset", req.model, "--out", str(run_dir), "--steps", str(cfg.train.steps)]
    if cluster.nominal:  # fake CPU devices: each process drives its share of the node
        args += ["--devices", str(per_task)]
    for item in [*req.sets, f"parallel.ep={ep}", *trainer_cluster_overrides(req.preset, req.allow_straddle)]:
        args += ["--set", item]
    return tuple(args)
