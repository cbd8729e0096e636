"""An expert-parallel plan for a cluster preset and a model preset, with its predicted cost.

``make_plan`` picks the Slurm allocation (``placement.allocation``), places EP groups on the
domains that allocation gets (``placement.place`` on ``synth_domains``) and prices one MoE
layer's all-to-alls with ``cost.placement_layer_time`` -- hierarchical when a group spans
domains -- next to the topology-blind baseline: what Slurm gives without the plan (racks
filled in order, ``naive_domains``) with the default device order and a flat all-to-all.

Inputs from the model preset (``moe_train/config/presets``): hidden size H, expert FFN width F,
top-k, routed experts, MoE layers (num_layers - first_dense_layers, plus the MTP
modules' blocks) and, unless given,
tokens per GPU = train.batch_size * train.seq_len / GPUs. Elements are bf16 (2 bytes).
Figures are per GPU; "per layer" is one MoE layer of one training step, i.e. 4 all-to-alls
(dispatch and combine, forward and backward) as in ``cost.layer_time``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Any

from moe_train import config as model_config
from moe_train.base.calls import from_names
from moe_train.config.cli import (
    command_parser,
    ep_argument,
    job_config,
    json_argument,
    nodes_argument,
    print_out,
    set_argument,
    usage_error,
)
from moe_train.planner import compute as compute_calibration
from moe_train.planner import cost, steptime
from moe_train.planner.request import Request
from topology import calibration as topology_calibration
from topology import presets
from topology.placement import (
    Allocation,
    Placement,
    allocation,
    compress,
    domain_index,
    naive_domains,
    naive_placement,
    place,
    synth_domains,
    valid_eps_for_nodes,
)
from topology.presets import Cluster, TopologyError

BYTES_PER_ELEM = 2  # bf16 activations in the all-to-all
MAX_GROUPS_SHOWN = 8  # human output lists this many EP groups, then a count
# parallel.weight_gather -> how the FSDP line says the weights travel
GATHERED = {"micro_batch": "per micro-batch", "step": "once per step, gradients per micro-batch"}


class PlanError(TopologyError):
    """A plan request that does not fit the model (e.g. ep not dividing the expert count)."""


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs from a model preset."""

    name: str  # model preset name
    hidden: int  # H, model width
    expert_ffn: int  # F, routed expert SwiGLU width
    top_k: int  # k, experts per token
    num_experts: int  # routed experts; ep must divide it
    moe_layers: int  # MoE blocks: num_layers - first_dense_layers (+ MTP modules' blocks)
    batch_tokens: int  # train.batch_size * train.seq_len, tokens per global step


@dataclass(frozen=True)
class Side:
    """One placement and its predicted per-GPU communication cost."""

    placement: Placement  # the EP groups and mesh order
    hierarchical: bool  # True: dispatch modelled hierarchical, else flat
    layer: cost.LayerCost  # one MoE layer per step: 4 all-to-alls plus expert GEMMs
    network_bytes_layer: float  # worst GPU's network bytes per MoE layer (4 all-to-alls)
    network_bytes_step: float  # network_bytes_layer times the MoE layers
    comm_s_step: float  # all-to-all seconds per step over all MoE layers
    dispatch: str  # how the all-to-all is done, in words


@dataclass(frozen=True)
class Plan:
    """The planned placement against the topology-blind one."""

    cluster: Cluster  # the cluster preset
    model: ModelShape  # the model's MoE shape
    allocation: Allocation  # what to ask Slurm for
    tokens_per_gpu: int  # T of the cost model
    tokens_from: str  # where T comes from, in words
    step: steptime.StepTime | None  # predicted step of the planned side; None: fp32 compute
    anchors: tuple[compute_calibration.Anchor, ...]  # published figures for this model and preset
    planned: Side  # placement on the allocation's domains
    naive: Side  # default order on racks filled in order

    @property
    def speedup(self) -> float:
        """Naive over planned all-to-all time per layer."""
        return self.naive.layer.comm_s / self.planned.layer.comm_s


def model_config_of(name: str, overrides: tuple[str, ...] = ()) -> model_config.Config:
    """The model preset with ``--set`` overrides; PlanError naming the presets if unknown."""
    try:
        return model_config.build(name, list(overrides))
    except model_config.ConfigError as e:
        raise PlanError(str(e).replace("unknown preset", "unknown model preset")) from None


def model_shape(name: str, cfg: model_config.Config | None = None) -> ModelShape:
    """The MoE shape of a model preset (or of ``cfg``, the preset with overrides)."""
    cfg = cfg or model_config_of(name)
    m, tr = cfg.model, cfg.train
    layers, tokens = model_config.moe_layer_count(m), tr.batch_size * tr.seq_len
    # expert_ffn, top_k, num_experts: the MoE section's
    return from_names(ModelShape, cfg.moe, name=name, hidden=m.hidden, moe_layers=layers, batch_tokens=tokens)


def _tokens(shape: ModelShape, devices: int, tokens: int | None) -> tuple[int, str]:
    """(T, where it comes from)."""
    if tokens is not None:
        if tokens < 1:
            raise PlanError(f"--tokens must be >= 1, got {tokens}")
        return tokens, "--tokens"
    t = shape.batch_tokens // devices
    if t < 1:
        raise PlanError(
            f"{shape.name}'s batch of {shape.batch_tokens} tokens is smaller than "
            f"{devices} GPUs; pass --tokens"
        )
    return t, (
        f"{shape.name} train batch of {shape.batch_tokens} tokens / {devices} GPUs; --tokens to change"
    )


def _side(
    cluster: Cluster, shape: ModelShape, p: Placement, T: int, hierarchical: bool, dispatch: str
) -> Side:
    """Price ``p``: one layer, and a step over all MoE layers."""
    traffic = cost.Traffic(T, shape.hidden, shape.top_k, BYTES_PER_ELEM)
    args = (cluster, p.ep_groups, domain_index(p.domains), traffic, shape.expert_ffn)
    try:
        layer = cost.placement_layer_time(*args, hierarchical)
    except ValueError:  # groups not evenly packed: price the flat all-to-all instead
        hierarchical, dispatch = False, "flat all-to-all (groups uneven across domains)"
        layer = cost.placement_layer_time(*args, False)
    per_layer = cost.ALL_TO_ALLS_PER_LAYER * layer.all_to_all.v_network_bytes
    return Side(
        placement=p,
        hierarchical=hierarchical,
        layer=layer,
        network_bytes_layer=per_layer,
        network_bytes_step=per_layer * shape.moe_layers,
        comm_s_step=layer.comm_s * shape.moe_layers,
        dispatch=dispatch,
    )


def make_plan(
    preset: str,
    nodes: int,
    model: str,
    ep: int,
    dp: int | None = None,
    tokens: int | None = None,
    allow_straddle: bool = False,
    calibration: str | None = None,
    overrides: tuple[str, ...] = (),
    compute: str | None = None,
) -> Plan:
    """The plan; TopologyError (one line, naming valid choices) for anything that cannot fit.

    ``calibration``: a file from ``python -m topology probe`` whose measured link numbers
    replace the preset's; ``compute``: a compute calibration (``moe_train.planner.compute``; None: the
    shipped defaults); ``overrides``: the model config's ``--set`` values.
    """
    cluster = presets.load(preset)
    if calibration:
        cluster = topology_calibration.apply(cluster, calibration)
    efficiency = compute_calibration.load(compute, model=model)
    cfg = model_config_of(model, overrides)
    shape = model_shape(model, cfg)
    if nodes < 1:
        raise PlanError(f"--nodes must be >= 1, got {nodes}")
    if ep < 1 or shape.num_experts % ep:
        valid = valid_eps_for_nodes(cluster, nodes, shape.num_experts)
        raise PlanError(
            f"ep {ep} does not divide {model}'s {shape.num_experts} experts; valid "
            f"ep for {nodes} {cluster.name} nodes: {', '.join(map(str, valid))}"
        )
    alloc = allocation(cluster, nodes, ep, num_experts=shape.num_experts, allow_straddle=allow_straddle)
    devices = nodes * cluster.gpus_per_node
    T, tokens_from = _tokens(shape, devices, tokens)
    planned = place(synth_domains(cluster, alloc), ep, dp, allow_straddle=allow_straddle)
    hier = planned.expert_x > 1
    how = (
        "hierarchical all-to-all (each token crosses the network once per remote domain)"
        if hier
        else "flat all-to-all" + ("" if planned.straddling else " inside each domain")
    )
    naive = naive_placement(devices, ep, dp, domains=naive_domains(cluster, nodes))
    side = _side(cluster, shape, planned, T, hier, how)
    return Plan(
        cluster=cluster,
        model=shape,
        allocation=alloc,
        tokens_per_gpu=T,
        tokens_from=tokens_from,
        planned=side,
        naive=_side(cluster, shape, naive, T, False, "flat all-to-all, default order"),
        step=_step(cfg, cluster, efficiency, devices, planned, T, side),
        anchors=tuple(compute_calibration.anchors(model, cluster.name)),
    )


def request_plan(req: Request, ep: int) -> Plan:
    """``make_plan`` of a launcher request at EP ``ep`` (its preset, nodes, model and
    --allow-straddle by name), with its ``--set`` items and its compute file."""
    return from_names(make_plan, req, ep=ep, overrides=tuple(req.sets), compute=req.compute or None)


def _step(
    cfg, cluster: Cluster, efficiency, devices: int, p: Placement, T: int, side: Side
) -> steptime.StepTime | None:
    try:
        cfg = model_config.for_devices(cfg, devices)
    except model_config.ConfigError as e:
        raise PlanError(str(e)) from None
    return steptime.predict(cfg, cluster, efficiency, _job(devices, p, T, side))


def _job(devices: int, p: Placement, T: int, side: Side) -> steptime.Job:
    return steptime.Job(
        gpus=devices,
        ep=p.ep,
        dp=p.dp,
        tokens_per_gpu=T,
        a2a=side.layer.all_to_all,
        hierarchical=side.hierarchical,
    )


def step_job(plan: Plan) -> steptime.Job:
    """The step-time model's job of the planned side: any config with the plan's EP size and
    batch predicts on it (``steptime.predict``; ``moe_train.planner.search`` times its variants so)."""
    p = plan.planned.placement
    return _job(len(p.order), p, plan.tokens_per_gpu, plan.planned)


def _pair(plan: Plan, fn) -> dict[str, Any]:
    return {"planned": fn(plan.planned), "naive": fn(plan.naive)}


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as one JSON-ready object (seconds, bytes; per GPU)."""
    p, a = plan.planned.placement, plan.allocation
    dom = domain_index(p.domains)
    return {
        "preset": plan.cluster.name,
        "model": plan.model.name,
        "nodes": a.nodes,
        "gpus": len(p.order),
        "ep": p.ep,
        "dp": p.dp,
        "tokens_per_gpu": plan.tokens_per_gpu,
        "tokens_from": plan.tokens_from,
        "allocation": {
            "nodes": a.nodes,
            "segment": a.segment,
            "domains": a.domains,
            "nodes_per_domain": a.nodes_per_domain,
            "reason": a.reason,
        },
        "mesh": {"data": p.dp, "expert_x": p.expert_x, "expert": p.expert},
        "order": p.order,
        "ep_groups": p.ep_groups,
        "ep_group_domains": [sorted({dom[r] for r in g}) for g in p.ep_groups],
        "domains": p.domains,
        "naive_ep_groups": plan.naive.placement.ep_groups,
        "naive_domains": plan.naive.placement.domains,
        "straddling": _pair(plan, lambda s: s.placement.straddling),
        "hierarchical": _pair(plan, lambda s: s.hierarchical),
        "a2a_seconds": _pair(plan, lambda s: s.layer.comm_s),
        "a2a_seconds_per_step": _pair(plan, lambda s: s.comm_s_step),
        "bytes_over_network": _pair(plan, lambda s: s.network_bytes_layer),
        "bytes_over_network_per_step": _pair(plan, lambda s: s.network_bytes_step),
        "bytes_over_nvlink": _pair(
            plan, lambda s: cost.ALL_TO_ALLS_PER_LAYER * s.layer.all_to_all.v_nvlink_bytes
        ),
        "gemm_seconds": plan.planned.layer.gemm_s,
        "comm_fraction": _pair(plan, lambda s: s.layer.comm_fraction),
        "speedup": plan.speedup,
        "step": steptime.as_json(plan.step) if plan.step else None,
        "anchors": [dataclasses.asdict(a) for a in plan.anchors],
        "notes": p.notes + plan.naive.placement.notes,
        "units": "per GPU; a2a_seconds, bytes_* and gemm_seconds per MoE layer per step "
        "(4 all-to-alls: dispatch and combine, forward and backward); *_per_step "
        "over all MoE layers",
    }


def _group_lines(p: Placement) -> list[str]:
    """One line per EP group (the first few and the last when there are many)."""
    dom = domain_index(p.domains)
    idx = list(range(len(p.ep_groups)))
    if len(idx) > MAX_GROUPS_SHOWN:
        idx = idx[: MAX_GROUPS_SHOWN - 1] + [idx[-1]]
    lines = []
    for n, g in enumerate(idx):
        if n and g != idx[n - 1] + 1:
            lines.append(f"  ... {g - idx[n - 1] - 1} more groups")
        doms = sorted({dom[r] for r in p.ep_groups[g]})
        word = "domain" if len(doms) == 1 else "domains"
        lines.append(f"  group {g}: ranks {compress(p.ep_groups[g])}  in {word} {compress(doms)}")
    return lines


def _table(plan: Plan) -> list[str]:
    rows = [
        ("all-to-all ms per MoE layer (4 a2a)", lambda s: f"{s.layer.comm_s * 1e3:.3f}"),
        ("network MB per GPU per MoE layer", lambda s: f"{s.network_bytes_layer / 1e6:.1f}"),
        ("network GB per GPU per step", lambda s: f"{s.network_bytes_step / 1e9:.2f}"),
        ("all-to-all s per step", lambda s: f"{s.comm_s_step:.3f}"),
        ("comm share of MoE layer time", lambda s: f"{s.layer.comm_fraction:.1%}"),
    ]
    out = [f"  {'':38}{'planned':>12}{'naive':>12}"]
    out += [f"  {name:38}{fn(plan.planned):>12}{fn(plan.naive):>12}" for name, fn in rows]
    out.append(f"  {'speedup of the all-to-all':38}{plan.speedup:>11.2f}x")
    return out


def render(plan: Plan, timed: bool = True) -> str:
    """The plan for humans; ``timed``: with the step for each ``moe.overlap_chunks`` and
    ``parallel.weight_gather`` (``make plan`` shows those as its alternatives instead)."""
    p, a, m = plan.planned.placement, plan.allocation, plan.model
    n = plan.naive.placement
    seg = f" --segment={a.segment}" if a.segment else ""
    lines = [
        f"plan: {m.name} on {a.nodes} {plan.cluster.name} nodes ({len(p.order)} GPUs), EP {p.ep} x DP {p.dp}",
        f"model: {m.num_experts} experts top-{m.top_k}, hidden {m.hidden}, expert ffn "
        f"{m.expert_ffn}, {m.moe_layers} MoE layers, bf16",
        f"tokens per GPU: {plan.tokens_per_gpu} ({plan.tokens_from})",
        f"allocation: sbatch --nodes={a.nodes}{seg}",
        f"  {a.reason}",
        f"mesh (data, expert_x, expert): {p.mesh}",
        f"EP groups (planned, {_count_domains(p)}):",
        *_group_lines(p),
        *[f"  note: {x}" for x in p.notes],
        f"dispatch: planned {plan.planned.dispatch}; naive {plan.naive.dispatch}",
        f"naive: default order on racks filled in order ({_count_domains(n)}); {n.notes[-1]}",
        f"cost per GPU, T={plan.tokens_per_gpu} tokens, {plan.cluster.name} preset bandwidths:",
        *_table(plan),
        *_step_lines(plan, timed),
    ]
    return "\n".join(lines)


def _step_lines(plan: Plan, timed: bool = True) -> list[str]:
    """The predicted step of the planned side, with the published figures beside it."""
    st = plan.step
    if st is None:
        return [
            "predicted step: none for precision.compute=fp32 (no single matmul peak: TF32 "
            "or FP32); --set precision.compute=bf16"
        ]
    i, c = st.inputs, st.compute_s
    names = {
        "experts": "expert GEMMs",
        "attn_proj": "attention proj",
        "scores": "attention scores",
        "heads": "heads",
        "other": "dense MLP/shared/router",
    }
    k = i["overlap_chunks"]
    hidden = f"{i['a2a_hidden']:.0%} hideable under the GEMMs with {k} chunk{'s' if k > 1 else ''}"
    where = i["compute_file"]
    if where == str(compute_calibration.DEFAULTS):
        where = "moe_train/planner/compute.toml, shipped defaults"
    if i["overlap_model"]:
        where += f", overlap shares measured on {i['overlap_model']}"
    lines = [
        f"predicted step per GPU (balanced routing; {i['compute']} matmuls, remat "
        f"{i['remat']}, {i['micro_batches']} micro-batches; efficiencies: {where}):",
        f"  compute     {sum(c.values()):9.3f} s  " + ", ".join(f"{names[k]} {v:.3f}" for k, v in c.items()),
        f"  all-to-all  {st.a2a_s:9.3f} s  {st.a2a_exposed_s:.3f} exposed ({hidden}; "
        f"{i['a2a_per_moe_layer']} per MoE layer"
        + (f", {i['fp8_dispatches']} of them fp8 dispatches)" if i["fp8_dispatches"] else ")"),
        f"  FSDP        {st.fsdp_s:9.3f} s  {st.fsdp_exposed_s:.3f} exposed (weights gathered "
        f"{GATHERED[i['weight_gather']]}; {i['fsdp_hidden']:.0%} hideable)",
        f"  optimizer   {st.optimizer_s:9.3f} s",
        f"  step        {st.step_s:9.3f} s  {st.tokens_per_s:,.0f} tokens/s/GPU, "
        f"{st.model_tflops:,.0f} model TFLOP/s/GPU, MFU {st.mfu:.1%} of the dense "
        f"{i['compute']} peak {st.peak_tflops:,.0f} TFLOP/s",
        f"  exposed communication: {st.comm_share:.1%} of the step",
    ]
    lines += (
        [
            f"  moe.overlap_chunks: {st.best_chunks} is the planner's choice (step s by chunks: "
            + ", ".join(f"{c}: {s:.3f}" for c, s in st.by_chunks.items())
            + ")",
            "  parallel.weight_gather: step s by mode: "
            + ", ".join(f"{g}: {s:.3f}" for g, s in st.by_gather.items())
            + " (step holds each weight's EP-group shard in the compute dtype; make submit takes "
            "the fastest mode that fits the memory plan)",
        ]
        if timed
        else []
    )
    return lines + [a.line("; forced balance") for a in plan.anchors]


def _count_domains(p: Placement) -> str:
    sizes = [len(d) for d in p.domains]
    if len(set(sizes)) == 1:
        return f"{len(sizes)} domain{'s' if len(sizes) > 1 else ''} of {sizes[0]} GPUs"
    return f"domains of {' + '.join(map(str, sizes))} GPUs"


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m moe_train.planner.ep_plan``."""
    p = command_parser("python -m moe_train.planner.ep_plan", __doc__)
    p.add_argument(
        "--preset", required=True, help="cluster preset name (topology/presets/*.toml) or a site .toml path"
    )
    nodes_argument(p)
    p.add_argument("--model", required=True, help="model preset (moe_train/config/presets/*.toml)")
    ep_argument(p, "expert-parallel group size (default: the model's parallel.ep after --set)")
    set_argument(
        p,
        help="model config override, as for training (batch, remat, precision, "
        "micro-batches, moe.overlap_chunks change the predicted step)",
    )
    p.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)  # make plan's STEPS
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default GPUs / ep)")
    p.add_argument(
        "--tokens", type=int, default=None, help="tokens per GPU (default: the model's train batch / GPUs)"
    )
    p.add_argument(
        "--allow-straddle",
        action="store_true",
        help="place EP groups across NVLink domains instead of refusing",
    )
    p.add_argument(
        "--calibration",
        default=None,
        help="calibration file from `python -m topology probe` (measured link numbers)",
    )
    p.add_argument(
        "--compute", default=None, help="compute calibration file (default: moe_train/planner/compute.toml)"
    )
    json_argument(p)
    return p


def run(args: argparse.Namespace) -> int:
    """The plan of ``args`` printed (text or ``--json``); TopologyError for bad input."""
    ep = args.ep
    if ep is None or args.overrides:  # the model's parallel.ep, after --set; --ep must agree
        try:
            ep = job_config(args).parallel.ep
        except model_config.ConfigError as err:
            raise TopologyError(str(err)) from None
    result = from_names(make_plan, args, ep=ep, overrides=tuple(args.overrides))
    print_out(json.dumps(plan_json(result)) if args.json else render(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_train.planner.ep_plan``: exit 2 with one ``error:`` line on bad input."""
    args = parser().parse_args(argv)
    try:
        return run(args)
    except TopologyError as err:
        return usage_error(err)


if __name__ == "__main__":
    sys.exit(main())
