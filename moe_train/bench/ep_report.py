"""Markdown report of the expert-parallel benchmark section (``moe_train.bench.ep``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_train.bench.common import fmt_ms, markdown_table, mib


def buffer_ratios(steps: list[dict]) -> dict[str, float]:
    """fill and buffer/received over batches (ratios of sums); with a hierarchical stage 1,
    over both stages' buffers, and each stage's buffer/received on its own."""

    def total(key):
        return sum(r.get(key, 0) for r in steps)

    rows, slots = total("recv_rows") + total("stage1_rows"), total("recv_slots") + total("stage1_slots")
    out = {"fill": rows / slots, "buffer_over_received": slots / rows}
    if total("stage1_rows"):
        out["stage1_buffer_over_received"] = total("stage1_slots") / total("stage1_rows")
        out["stage2_buffer_over_received"] = total("recv_slots") / total("recv_rows")
    return out


def skew_summary(s, dense_rows: list[dict]) -> dict[str, dict]:
    """Realized load skew of each timed routing (batch 0): expert and EP-rank max/mean."""
    out = {}
    for row in dense_rows:
        loads = np.asarray(row["tokens_per_expert"])
        entry = {"expert_max_over_mean": float(loads.max() / loads.mean())}
        for ep in sorted({mc.ep for mc in s.meshes}):
            rank = loads.reshape(ep, -1).sum(axis=1)
            entry[f"ep{ep}_rank_max_over_mean"] = float(rank.max() / rank.mean())
        out[row["routing"]] = entry
    return out


def beside_balanced(sec: dict[str, Any]) -> list[dict]:
    """Per mesh and dispatcher, each dropless routing's time over forced balance's (the
    first timed row of each: the bucket that held, or allgather's one row)."""
    first: dict[tuple, dict] = {}
    for r in sec["timing"]:
        first.setdefault((r["mesh"], r["dispatcher"], r["routing"]), r)
    out = []
    for (mesh, disp, routing), r in first.items():
        base = first.get((mesh, disp, "balanced"))
        if base is None or routing == "balanced":
            continue
        out.append(
            {
                "mesh": mesh,
                "dispatcher": disp,
                "routing": routing,
                "bucket": r.get("bucket"),
                "balanced_bucket": base.get("bucket"),
                "over_balanced": r["time"]["median_s"] / base["time"]["median_s"],
            }
        )
    return out


def _balanced_lines(sec: dict[str, Any]) -> list[str]:
    rows = beside_balanced(sec)
    if not rows:
        return []
    table = markdown_table(
        ["mesh", "dispatcher", "routing", "bucket", "balanced bucket", "time / balanced"],
        [
            [
                r["mesh"],
                r["dispatcher"],
                r["routing"],
                r["bucket"] or "",
                r["balanced_bucket"] or "",
                f"{r['over_balanced']:.2f}x",
            ]
            for r in rows
        ],
    )
    return [
        "",
        "### Dropless beside forced balance",
        "",
        "`balanced` is `study.router=balanced` (benchmarks only): every device's token t takes "
        "experts (t*K + j) mod E, so every expert and every (source, destination) pair gets "
        "the same load, as published forced-balance tables are measured. Each dropless "
        "routing's median time over the balanced row's, same mesh and dispatcher:",
        "",
        table,
    ]


KEY_COLUMNS = ["mesh", "dispatcher", "routing"]  # the first columns of both tables


def _keys(r: dict[str, Any]) -> list[Any]:
    """A timing or bucket row's ``KEY_COLUMNS`` cells."""
    return [r[k] for k in KEY_COLUMNS]


def _timing_table(sec: dict[str, Any]) -> str:
    """The forward+backward time and bytes-moved table."""
    header = [
        *KEY_COLUMNS,
        "bucket",
        "chunks",
        "median ms",
        "min-max ms",
        "reps",
        "fill",
        "fwd exchange MiB/dev",
        "cross-domain buffer MiB/dev",
        "slow-link MiB/dev (rows)",
    ]
    rows = []
    for r in sec["timing"]:
        med, spread = fmt_ms(r["time"])
        if r["kind"] == "dense":
            bucket, chunks, moved = "", 1, ["", "", "", ""]
        else:
            by = r["fwd_bytes_per_device"]
            bucket, chunks = r["bucket"] or "", r["chunks"]
            moved = [
                f"{r['fill']:.3f}",
                mib(by["total"]),
                mib(by["cross_domain"]),
                mib(r["slow_link_bytes_per_device"]),
            ]
        rows.append([*_keys(r), bucket, chunks, med, spread, r["time"]["reps"], *moved])
    return markdown_table(header, rows)


def _bucket_table(sec: dict[str, Any]) -> str:
    """The capacity-bucket table (stepper emulation)."""
    header = [
        *KEY_COLUMNS,
        "bucket held",
        "reruns",
        "fill",
        "buffer/received",
        "hierarchical stage 1 / 2",
        "worst-case fill",
        "worst buffer/received",
        "max/mean pair load",
        f"<= {sec['target_ratio']}x?",
    ]

    def stages(b, pre=""):
        if f"{pre}stage1_buffer_over_received" not in b:
            return ""
        return f"{b[pre + 'stage1_buffer_over_received']:.2f} / {b[pre + 'stage2_buffer_over_received']:.2f}"

    rows = [
        [
            *_keys(b),
            b["held_bucket"],
            b["reruns"],
            f"{b['fill']:.3f}",
            f"{b['buffer_over_received']:.2f}",
            stages(b),
            f"{b['worst_fill']:.3f}",
            f"{b['worst_buffer_over_received']:.2f}",
            f"{b['pair_load_bound']:.2f}",
            "met" if b["target_met"] else "not met",
        ]
        for b in sec["buckets"]
    ]
    return markdown_table(header, rows)


def markdown(sec: dict[str, Any]) -> str:
    """The section's Markdown: setup, timing table, bucket table and the target line."""
    s = sec["sizes"]
    lines = [
        f"## {sec['title']}",
        "",
        f"Global batch {s['tokens']} tokens, H={s['hidden']}, F={s['ffn']}, E={s['experts']}, "
        f"top-k={s['top_k']}; {sec['dtype']}, `{sec['backend']}` grouped GEMM, softmax router. "
        f"Mesh `EPn dpA GBxDC` = (data, expert_x, expert) = (A, B fast-link domains, C "
        f"shards per domain), n = B*C. Time: forward+backward of the whole layer under `jit` "
        f"(compiled first, "
        f"one warm-up run), median of `reps` runs with min-max; all 8 fake devices share "
        f"the machine's {sec['cpu_count']} CPU cores, so EP rows measure "
        f"work and memory traffic, not a network.",
        "",
        f"Routing (top-k drawn without replacement, Gumbel-top-k, made by the gate kernel): "
        f"`uniform`; `zipf`: p(expert) ~ 1/rank^{sec['zipf_exponent']} with ranks shuffled "
        f"over experts (fixed permutation)"
        + (
            "; `zipf-sorted` (bucket table only): the same with the hottest experts on EP rank 0"
            if "zipf-sorted" in s["bucket_routings"]
            else ""
        )
        + (
            "; `balanced`: forced balance (`study.router=balanced`) on the uniform tokens"
            if "balanced" in s["routings"]
            else ""
        )
        + ". Realized on batch 0:",
    ]
    for routing, sk in sec["realized_skew"].items():
        lines.append(f"- {routing}: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in sk.items()))
    lines += ["", "### Forward+backward time and bytes moved", "", _timing_table(sec), ""]
    lines += [
        "Bytes are per device for one forward pass (the backward pass repeats the same "
        "exchanges transposed). *fwd exchange*: all-to-all buffers (dispatch, combine and "
        "the small id/weight/count exchanges) or all-gather + reduce-scatter, from the "
        "lowered HLO's collective shapes, own block included; *cross-domain buffer*: the "
        "part of those buffers that crosses domains (padding included); *slow-link "
        "(rows)*: the token rows that really cross domains (stats `slow_rows`) x H x "
        "itemsize x 2 (dispatch + combine). fill = recv_rows / recv_slots of that run "
        "(allgather: rows for local experts / gathered rows; hierarchical: the in-domain "
        "stage only).",
        "",
        "### Capacity buckets (stepper emulation)",
        "",
    ]
    lines += [_bucket_table(sec), ""]
    zipf = [b for b in sec["buckets"] if b["routing"].startswith("zipf")]
    met = [b for b in zipf if b["target_met"]]
    step_down = (
        f"(the trainer's BucketPolicy: a smaller one after {s['step_down_after']} quieter batches) "
        if "step_down_after" in s
        else ""
    )
    lines += [
        f"{s['steps']} routing batches per row; "
        f"buckets {', '.join(f'{f:g}' for f in sec['capacity_buckets'])} "
        f"x balanced load, then worst case; the bucket that held carries over to the next batch "
        f"{step_down}and reruns are summed. fill and buffer/received are over all devices and batches "
        f"(buffer/received = 1/fill). hierarchical has two receive buffers: its fill and "
        f"buffer/received count both (stage 1, cross-domain: one row per token and domain "
        f"used, counted from the batch's routing; stage 2, in-domain: dropless_moe's "
        f"recv_rows/recv_slots), each stage's ratio is shown on its own. With a dense "
        f"all_to_all every (source, destination) pair gets the same C slots, so an a2a "
        f"buffer/received >= max pair load / mean pair load (the `max_pair_load` stat, mean "
        f"over batches; for hierarchical it is the larger of its two stages' ratios to the "
        f"uniform-routing load).",
        "",
        f"**Target** (mean receive buffer <= {sec['target_ratio']}x the rows received on "
        f"Zipf-skewed routing): met in {len(met)} of {len(zipf)} Zipf rows"
        + (
            f" ({', '.join(b['mesh'] + ' ' + b['dispatcher'] + ' ' + b['routing'] for b in met)})"
            if met
            else ""
        )
        + ". Where the pair-load lower bound exceeds the target, no bucket of a dense "
        "all_to_all can meet it; that needs ragged (per-pair sized) exchanges.",
    ]
    lines += _balanced_lines(sec)
    if any(r["chunks"] > 1 for r in sec["timing"]):
        lines += [
            "",
            "chunks=2 rows: timing only. On CPU fake devices the collectives are memory "
            "copies that cannot overlap the expert GEMMs, so chunking only adds work here; "
            "its benefit (overlapping one chunk's exchange with another's GEMMs) is a GPU "
            "matter.",
        ]
    return "\n".join(lines)
