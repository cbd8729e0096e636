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
from collections.abc import Callable
from pathlib import Path

from moe_train.planner.compile import hlo, overlap, peak
from moe_train.planner.compile.job import Job, planner_total
from moe_train.planner.compile.kernels import Kernel
from moe_train.planner.compile.lower import Compiled
from moe_train.planner.memory import ALL_ITEMS, GIB, bucket_label
from moe_train.planner.steptime import link_bytes_per_s

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


Row = tuple[tuple[str, ...], Callable[[overlap.Window], bool]]  # (collective kinds, which windows)


def rows(devices: int, ep: int, step: bool) -> dict[str, Row]:
    """Report row -> (collective kinds, which windows): by the devices a collective runs over.
    A collective over the EP group (its replica group within one group's device-id span)
    is the step-time model's in-group traffic; one over ``data`` crosses the groups; one over
    every device (a gradient the partitioner all-reduces whole) is in no part of the model."""

    def group(w: overlap.Window) -> bool:
        return 0 < w.span <= ep and 0 < w.size < devices

    def every(w: overlap.Window) -> bool:
        return w.size in (0, devices)

    out: dict[str, Row] = {"all-to-all": (("all-to-all",), lambda w: True)}
    if step:
        out["gather_data"] = (("all-gather",), lambda w: not group(w))
        out["gather_group"] = (("all-gather",), group)
        out["reduce_scatter_group"] = (("reduce-scatter",), group)
        out["reduce_scatter_data"] = (("reduce-scatter",), lambda w: not group(w))
        out["all_reduce"] = (("all-reduce",), lambda w: not group(w) and not every(w))
    else:
        out["fsdp"] = (("all-gather", "reduce-scatter"), lambda w: True)
    out["all_reduce_every_device"] = (("all-reduce",), every)
    return out


def schedule_vs_model(job: Job, windows: list[overlap.Window]) -> dict:
    """Per step, at the step-time model's rates (each collective at the link its replica group
    spans): each row's (``rows``) transfer seconds and the most the GEMMs the schedule placed
    in its windows can hide (``overlap.hidden``), beside the model's seconds and share of that
    part (the FSDP parts: ``moe_train/planner/compute.toml``'s shares, before the cap at the step's
    compute; None where the model has no such part); {} where the model predicts nothing."""
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
    step = inp["weight_gather"] == "step"
    model: dict[str, tuple[float | None, float | None]] = {
        "all-to-all": (st.a2a_s, 1 - st.a2a_exposed_s / st.a2a_s if st.a2a_s else None),
        "fsdp": (st.fsdp_s, eff["fsdp_hidden_micro_batch"]),
        **{k: (t, inp["fsdp_part_shares"][k]) for k, t in inp["fsdp_parts"].items()},
    }
    rate = lambda span: link_bytes_per_s(job.cluster, span)  # noqa: E731
    out = {}
    for row, (kinds, keep) in rows(job.devices, job.cfg.parallel.ep, step).items():
        ws = [w for w in windows if keep(w)]
        h = [overlap.hidden(ws, k, rate, gemm, job.devices) for k in kinds]
        comm, hid = sum(x["comm_s"] for x in h), sum(x["hidden_s"] for x in h)
        if comm:
            model_s, model_share = model.get(row, (None, None))
            out[row] = {
                "comm_s": round(comm, 6),
                "hidden_s": round(hid, 6),
                "share": round(hid / comm, 3),
                "model_s": None if model_s is None else round(model_s, 6),
                "model_share": model_share,
            }
    return out


def result(
    job: Job,
    kernels: list[Kernel],
    records: list[dict],
    jax_version: str,
    same: dict[str, str] | None = None,
    notes: list[str] | None = None,
) -> dict:
    """Everything ``--json`` prints. ``same``: {bucket not compiled: the compiled bucket whose
    step it is}; ``notes``: lines about the whole compile (XLA's warnings, said)."""
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
        "same_as": dict(same or {}),
        "notes": list(notes or []),
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
        f"collectives per step at bucket {rec['bucket']} (the step-time model's rates, each at "
        f"the link its group spans; hidden: at most min(transfer, GEMMs inside) per window):"
    ]
    for row, h in rows.items():
        model = (
            "the step-time model has no such part"
            if h["model_s"] is None or h["model_share"] is None
            else f"the step-time model: {h['model_s'] * 1e3:.1f} ms, {h['model_share']:.0%} hidden"
        )
        lines.append(
            f"  {row:<24}{h['hidden_s'] * 1e3:10.1f} of {h['comm_s'] * 1e3:10.1f} ms hidden "
            f"({h['share']:.0%}); {model}"
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
        label = bucket_label(b["bucket"])
        lines.append(
            f"{label:<8}{num(m['argument'])}{num(m['temp'])}"
            f"{num(m['output'] - m['alias'])}{num(m['peak'])} {num(b['planner']['total'])}"
            f"{b['xla_over_planner']:8.2f}  {'fits' if b['fits'] else 'DOES NOT FIT':<13}"
            f"{b['trace_s']:8.1f}{b['compile_s']:10.1f}"
        )
    for bucket, twin in r.get("same_as", {}).items():
        lines.append(
            f"{bucket_label(bucket):<8}= {twin}x: the same receive buffers "
            f"(capped at the worst case), so a step never overflows {twin}x onto it: not compiled again"
        )
    notes = [f"note at bucket {b['bucket']}: {b['note']}" for b in r["buckets"] if b.get("note")]
    notes += [f"note: {n}" for n in r.get("notes", [])]
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
