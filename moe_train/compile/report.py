"""The compile's result: one record per capacity bucket beside the memory planner, the table
it prints, and the run directory it writes.

Peak per GPU = arguments + temp + outputs - aliased outputs (+ generated code):
``moe_train.train.step.CompiledMemory.peak``, the figure the trainer logs after its first step.
The train state is donated, so its new value is written over the old (the aliased outputs).
The verdict compares it with the usable memory of the memory planner (the preset's GPU memory
times its XLA_PYTHON_CLIENT_MEM_FRACTION). The planner's total at a bucket is its total with
``moe_buffers`` replaced by that bucket's (``moe_buffers_by_bucket``).

``runs/compile/<UTC>/``: ``step-<bucket>.hlo`` (the optimized, scheduled HLO of each bucket),
``memory.txt`` (XLA's memory analysis of each bucket beside the planner's items) and
``result.json`` (what ``--json`` prints).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from moe_train.compile import hlo, overlap, peak
from moe_train.compile.job import Job, planner_total
from moe_train.compile.kernels import Kernel
from moe_train.compile.lower import Compiled
from moe_train.memory import ALL_ITEMS, GIB
from topology.steptime import link_bytes_per_s

NAMES = {
    "triton_gemm": "Triton GEMM",
    "triton_fusion": "Triton other",
    "cublas": "cuBLAS",
    "cublaslt": "cuBLASLt",
    "cudnn": "cuDNN",
    "fp8_gemm": "fp8 GEMM",
    "mosaic_gpu": "Mosaic GPU",
    "pallas_triton": "Pallas Triton",
}


def bucket_record(job: Job, c: Compiled) -> dict:
    """One bucket: XLA's memory, the verdict, the planner beside it, kernels, collectives."""
    usable, mem = job.plan.budget.usable_bytes, c.memory
    planned = planner_total(job, c.bucket)
    windows = overlap.windows(c.hlo)
    return {
        "bucket": c.bucket,
        "dispatcher": None if c.plan is None else c.plan.dispatcher,
        "trace_s": round(c.trace_s, 2),
        "compile_s": round(c.compile_s, 2),
        "memory": {**dataclasses.asdict(mem), "peak": mem.peak},
        "fits": mem.peak <= usable,
        "planner": {"moe_buffers": job.plan.estimate.moe_buffers_by_bucket[c.bucket], "total": planned},
        "xla_over_planner": round(mem.peak / planned, 3),
        "hlo": f"step-{c.bucket}.hlo",
        "note": c.note,
        **hlo.inventory(c.hlo),
        "overlap": overlap.summary(windows),
        "hidden": schedule_vs_model(job, windows),
        **({"peak_live": c.peak} if c.peak else {}),
    }


def schedule_vs_model(job: Job, windows: list[overlap.Window]) -> dict:
    """Per step, at the step-time model's rates: each collective kind's transfer seconds and
    the most the GEMMs the schedule placed in its windows can hide (``overlap.hidden``),
    beside the share the model hides of that kind (the FSDP kinds: ``topology/compute.toml``'s
    shares, before the cap at the step's compute); {} where the model predicts nothing."""
    st = job.step
    if st is None:
        return {}
    eff, inp = st.inputs["efficiency"], st.inputs
    fp8 = inp["compute"] == "fp8"
    gemm = (
        inp["peak_fp8_tflops"] * eff["fp8_gemm_efficiency"]
        if fp8
        else inp["peak_bf16_tflops"] * eff["grouped_gemm_efficiency"]
    ) * 1e12
    step = inp["weight_gather"] == "step"  # step mode: a share per collective kind
    model = {
        "all-to-all": 1 - st.a2a_exposed_s / st.a2a_s if st.a2a_s else None,
        "all-gather": eff["fsdp_hidden_step_gather" if step else "fsdp_hidden_micro_batch"],
        "reduce-scatter": eff["fsdp_hidden_step_reduce_scatter" if step else "fsdp_hidden_micro_batch"],
    }
    spans = {"all-to-all": job.cfg.parallel.ep, "all-gather": job.devices, "reduce-scatter": job.devices}
    out = {}
    for kind, span in spans.items():
        h = overlap.hidden(windows, kind, link_bytes_per_s(job.cluster, span), gemm)
        if h["comm_s"]:
            out[kind] = {
                **{k: round(v, 6) for k, v in h.items()},
                "share": round(h["hidden_s"] / h["comm_s"], 3),
                "model_share": model[kind],
            }
    return out


def result(job: Job, kernels: list[Kernel], records: list[dict], jax_version: str) -> dict:
    """Everything ``--json`` prints."""
    s, b, est = job.plan.estimate.setup, job.plan.budget, job.plan.estimate
    return {
        "model": job.model,
        "cluster": job.cluster.name,
        "nodes": job.nodes,
        "devices": job.devices,
        "gpu": job.target.description,
        "target": job.target.name,
        "sm": job.target.sm,
        "ep": s.ep,
        "dp": s.dp,
        "dispatcher": s.dispatcher,
        "num_layers": job.cfg.model.num_layers,
        "reduced_depth": job.layers is not None,
        "jax": jax_version,
        "xla_flags": job.cluster.env.get("XLA_FLAGS", ""),
        "launcher_choices": list(job.notes),
        "kernels": [dataclasses.asdict(k) for k in kernels],
        "device_bytes": b.device_bytes,
        "usable_bytes": b.usable_bytes,
        "reserve": b.reserve,
        "planner_items": dict(est.per_device),
        "planner_bucket": est.bucket,
        "peak": "argument + temp + output - alias + code (CompiledMemory.peak)",
        "buckets": records,
    }


def size(n: int) -> str:
    """Bytes as GiB, or MiB under one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def _unit(r: dict) -> tuple[str, int]:
    """GiB, or MiB when every peak is under one GiB (toy models)."""
    big = max(b["memory"]["peak"] for b in r["buckets"]) >= GIB
    return ("GiB", GIB) if big else ("MiB", 2**20)


def _head(r: dict) -> list[str]:
    n = r["num_layers"]
    depth = f"{n} layer{'s' if n != 1 else ''}" + (" (--layers: reduced depth)" if r["reduced_depth"] else "")
    return [
        f"{r['model']} on {r['nodes']} {r['cluster']} node(s): {r['devices']} simulated "
        f"{r['gpu']} ({r['sm']}), EP {r['ep']} x FSDP {r['dp']}, {r['dispatcher']} "
        f"dispatch, {depth}; XLA:GPU of jax {r['jax']} with the preset's XLA_FLAGS",
        *[f"kernel: {Kernel(**k).line()}" for k in r["kernels"]],
        *[f"launcher: {n}" for n in r["launcher_choices"]],
    ]


def _inventory(rec: dict) -> list[str]:
    k = rec["kernels"]
    named = ", ".join(f"{NAMES[n]} {k[n]}" for n in NAMES)
    other = ", ".join(f"{n.split(':', 1)[1]} {v}" for n, v in k.items() if n not in NAMES)
    lines = [
        f"kernels at bucket {rec['bucket']}: {named}" + (f"; other custom calls: {other}" if other else "")
    ]
    lines.append(
        f"collectives at bucket {rec['bucket']} (instances in the HLO; loop bodies "
        f"run once per iteration; MiB: their results summed):"
    )
    for kind, c in rec["collectives"].items():
        lines.append(
            f"  {kind:<20}{c['count']:5d}  {c['async']:4d} async {c['sync']:4d} sync  "
            f"{c['in_loops']:4d} in loops  {c['bytes'] / 2**20:12.2f} MiB"
        )
    lines.append(
        f"overlap at bucket {rec['bucket']} (kernels the schedule places between each "
        f"async start and its done):"
    )
    for kind, o in rec.get("overlap", {}).items():
        lines.append(
            f"  {kind:<20}{o['pairs']:5d} async  {o['with_gemm']:4d} with a GEMM inside  "
            f"{o['gemm_kernels']:5d} GEMM + {o['other_kernels']:5d} other kernels inside"
        )
    return lines + _hidden_lines(rec) + peak.lines(rec.get("peak_live") or {})


def _hidden_lines(rec: dict) -> list[str]:
    """What the schedule can hide per step, beside what the step-time model assumes."""
    rows = rec.get("hidden") or {}
    if not rows:
        return []
    lines = [
        f"hidden per step at bucket {rec['bucket']} (the step-time model's link and GEMM "
        f"rates; at most min(transfer, GEMMs inside) per window):"
    ]
    for kind, h in rows.items():
        model = "-" if h["model_share"] is None else f"{h['model_share']:.0%}"
        lines.append(
            f"  {kind:<20}{h['hidden_s'] * 1e3:10.1f} of {h['comm_s'] * 1e3:10.1f} ms "
            f"({h['share']:.0%}); the step-time model assumes {model}"
        )
    return lines


def render(r: dict) -> str:
    """The readable report: the head, one row per bucket, the judged bucket's inventory."""
    name, unit = _unit(r)
    num = lambda n: f"{n / unit:8.2f}"  # noqa: E731
    lines = _head(r) + [
        f"per GPU, {name}; peak = arguments + temp + outputs - aliased (donated state) outputs; "
        f"usable {r['usable_bytes'] / GIB:.2f} of {r['device_bytes'] / GIB:.2f} GiB "
        f"({r['reserve']})",
        f"{'bucket':<8}{'args':>8}{'temp':>8}{'out-al':>8}{'peak':>8}{'planner':>9}"
        f"{'XLA/pl':>8}  {'verdict':<13}{'trace s':>8}{'compile s':>10}",
    ]
    for b in r["buckets"]:
        m = b["memory"]
        label = b["bucket"] + ("x" if b["bucket"] != "worst" else "")
        lines.append(
            f"{label:<8}{num(m['argument'])}{num(m['temp'])}"
            f"{num(m['output'] - m['alias'])}{num(m['peak'])} {num(b['planner']['total'])}"
            f"{b['xla_over_planner']:8.2f}  {'fits' if b['fits'] else 'DOES NOT FIT':<13}"
            f"{b['trace_s']:8.1f}{b['compile_s']:10.1f}"
        )
    notes = [f"note at bucket {b['bucket']}: {b['note']}" for b in r["buckets"] if b.get("note")]
    judged = next((b for b in r["buckets"] if b["bucket"] == r["planner_bucket"]), r["buckets"][-1])
    return "\n".join(lines + notes + _inventory(judged))


def _memory_text(r: dict) -> str:
    out = [
        f"{r['model']} on {r['nodes']} {r['cluster']} node(s), {r['gpu']}: bytes per GPU",
        "planner items (its total uses bucket "
        + r["planner_bucket"]
        + "): "
        + ", ".join(f"{k} {r['planner_items'][k]}" for k in ALL_ITEMS),
    ]
    for b in r["buckets"]:
        m = b["memory"]
        out.append(
            f"bucket {b['bucket']}: XLA argument {m['argument']} output {m['output']} "
            f"alias {m['alias']} temp {m['temp']} code {m['code']} peak {m['peak']}; "
            f"planner moe_buffers {b['planner']['moe_buffers']} total "
            f"{b['planner']['total']}"
        )
    return "\n".join(out) + "\n"


def write(out_dir: Path, r: dict, compiled: list[Compiled]) -> Path:
    """``out_dir``: each bucket's scheduled HLO, memory.txt, result.json."""
    out_dir.mkdir(parents=True, exist_ok=(out_dir / "xla").is_dir())  # the dumps went first
    for c in compiled:
        (out_dir / f"step-{c.bucket}.hlo").write_text(c.hlo)
    (out_dir / "memory.txt").write_text(_memory_text(r))
    (out_dir / "result.json").write_text(json.dumps(r, indent=1) + "\n")
    return out_dir
