"""``python -m moe_train.planner.memory --model M --cluster C --nodes N [--ep N] [--set k=v ...]``.

Prints the per-GPU estimate, the verdict and the alternatives (``--json``: one JSON object
with ``per_device_bytes``, ``device_bytes``, ``usable_bytes``, ``fits``, ...). Exit code 0
whether or not it fits (``--check`` makes "does not fit" exit 1); bad input is one line
``error: ...`` naming the valid choices, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from moe_train.base.calls import from_names
from moe_train.config import ConfigError
from moe_train.config.cli import command_parser, job_arguments, job_config, json_argument, usage_error
from moe_train.planner.memory import ALL_ITEMS, GIB, Plan, bucket_label, plan
from topology.presets import TopologyError, list_presets

EXIT_DOES_NOT_FIT = 1


def parser() -> argparse.ArgumentParser:
    p = command_parser("python -m moe_train.planner.memory", __doc__)
    job_arguments(p, "--cluster", f"cluster preset ({', '.join(list_presets())}) or a site .toml path")
    p.add_argument("--devices", type=int, default=None, help="GPUs in the job when not whole nodes (e.g. 1)")
    p.add_argument(
        "--reserve-gib",
        type=float,
        default=None,
        help="GiB per GPU kept free (default: the preset's XLA memory fraction)",
    )
    json_argument(p)
    p.add_argument("--check", action="store_true", help="exit 1 when it does not fit")
    return p


def _unit(total: int) -> tuple[str, int]:
    """GiB, or MiB for plans under one GiB (CPU presets, tiny models)."""
    return ("GiB", GIB) if total >= GIB else ("MiB", 2**20)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _notes(pl: Plan) -> dict[str, str]:
    """One note per item, saying what it is made of."""
    s, est = pl.estimate.setup, pl.estimate
    name, unit = _unit(est.per_device["total"])
    step = est.per_device["step_weights"] > 0
    buckets = ", ".join(f"{bucket_label(k)} {v / unit:.2f}" for k, v in est.moe_buffers_by_bucket.items())
    return {
        "params": f"{_count(est.params_total)} parameters: routed experts / {s.ep * s.dp} "
        f"(EP {s.ep} x FSDP {s.dp}), other matrices / {s.devices}, norms replicated",
        "grads": (
            "as the parameters (reduce-scattered)"
            if not step
            else "as the parameters, plus a micro-batch's gradient of the step's copy"
        ),
        "optimizer": "AdamW mu and nu",
        "activations": f"remat {s.remat}, {s.tokens} tokens per GPU",
        "moe_buffers": f"bucket {bucket_label(est.bucket)} "
        f"({s.dispatcher}, {s.backend}); by bucket: {buckets}",
        "precision_copies": (
            f"{s.compute} weights gathered per use inside the EP group"
            if step
            else f"{s.compute} weights gathered over FSDP"
        ),
        "other": "expert bias, batch, counters",
        "step_weights": (
            f"{s.compute} copy of the weights gathered once per step (parallel.weight_gather=step)"
            if step
            else "none (parallel.weight_gather=micro_batch)"
        ),
    }


def render(pl: Plan, model: str) -> str:
    """The human-readable report."""
    s, v, b = pl.estimate.setup, pl.verdict, pl.budget
    head = (
        f"{model} on {pl.nodes} node(s) of {pl.cluster.name}: {s.devices} GPU(s) of "
        f"{pl.cluster.gpu_memory_gib:g} GiB, ep {s.ep} x FSDP {s.dp}, {s.dispatcher} dispatch, "
        f"{s.tokens} tokens per GPU, remat {s.remat}, {s.compute} compute"
    )
    notes = _notes(pl)
    name, unit = _unit(v.total_bytes)
    num = lambda b: f"{b / unit:10.2f}"  # noqa: E731
    lines = [head, f"  {'per GPU':<18}{name:>10}"]
    lines += [f"  {k:<18}{num(pl.estimate.per_device[k])}   {notes[k]}" for k in ALL_ITEMS]
    lines.append(
        f"  {'total':<18}{num(v.total_bytes)}   usable {v.usable_bytes / unit:.2f} of "
        f"{v.device_bytes / unit:g} ({b.reserve})"
    )
    lines.append(f"verdict: {v.message}")
    if v.alternatives:
        lines.append(f"alternatives (per-GPU total, {name}):")
        lines += [
            f"  {a.change:<44}{num(a.total_bytes)}   {'fits' if a.fits else 'does not fit'}"
            for a in v.alternatives
        ]
    return "\n".join(lines)


def to_json(pl: Plan, model: str) -> dict:
    """The machine-readable report."""
    s, v = pl.estimate.setup, pl.verdict
    return {
        "model": model,
        "cluster": pl.cluster.name,
        "nodes": pl.nodes,
        "devices": s.devices,
        "ep": s.ep,
        "dp": s.dp,
        "tokens_per_device": s.tokens,
        "remat": s.remat,
        "compute": s.compute,
        "dispatcher": s.dispatcher,
        "backend": s.backend,
        "per_device_bytes": dict(pl.estimate.per_device),
        "moe_buffers_by_bucket": dict(pl.estimate.moe_buffers_by_bucket),
        "bucket": pl.estimate.bucket,
        "device_bytes": v.device_bytes,
        "usable_bytes": v.usable_bytes,
        "reserve": pl.budget.reserve,
        "fits": v.fits,
        "spare_bytes": v.spare_bytes,
        "largest": v.largest,
        "change": v.change,
        "bucket_fits": v.bucket_fits,
        "worst_case_bytes": v.worst_case_bytes,
        "message": v.message,
        "alternatives": [
            {"change": a.change, "total_bytes": a.total_bytes, "fits": a.fits, "available": a.available}
            for a in v.alternatives
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        pl = from_names(plan, args, cfg=job_config(args))  # plan loads the --cluster preset
    except (ConfigError, TopologyError) as err:
        return usage_error(err)
    print(json.dumps(to_json(pl, args.model), indent=1) if args.json else render(pl, args.model))
    return EXIT_DOES_NOT_FIT if args.check and not pl.verdict.fits else 0


if __name__ == "__main__":
    sys.exit(main())
