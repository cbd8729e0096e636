"""Markdown tables and the targets summary of the GEMM, layer, compile and GPU sections."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_train.bench import common
from moe_train.bench.common import fmt_ms, markdown_table
from moe_train.bench.gemm import realistic

TARGETS = {
    "padding": 1.1,
    "gemm_uniform": 1.3,
    "gemm_skewed": 1.6,
    "layer_dense": 1.5,
    "layer_ragged": 5.0,
    "loss_vocab": 1.3,
    "plan_seq": 1.05,
}  # memory ratios (the loss section)


def _split_unavailable(rows: list[dict]) -> tuple[list[dict], str]:
    """(rows without 'unavailable' skips, one note line naming those backends and why)."""
    why = {}
    for r in rows:
        if (r.get("skipped") or "").startswith("unavailable"):
            why.setdefault(r["backend"], r["skipped"].split(": ", 1)[-1])
    note = "; ".join(f"`{b}` not run: {w}" for b, w in why.items())
    return [r for r in rows if not (r.get("skipped") or "").startswith("unavailable")], note


def _rows_table(
    rows: list[dict], header: list[str], skipped: Callable[[dict], list], timed: Callable[[dict], list]
) -> str:
    """Markdown table of a section's rows, cells by ``skipped`` for a skipped row and ``timed``
    for the others, then the note naming the backends not run ('unavailable' skips, left out)."""
    kept, note = _split_unavailable(rows)
    table = markdown_table(header, [skipped(r) if r["skipped"] else timed(r) for r in kept])
    return table + (f"\n\n{note}." if note else "")


def _cpu(r: dict) -> str:
    return f"{r['cpu_ratio']:.2f}" if "cpu_ratio" in r else ""


def gemm_md(sec: dict[str, Any]) -> str:
    """The grouped GEMM section's Markdown: setup line and one row per candidate x routing."""
    s = sec["sizes"]
    head = (
        f"## {sec['title']}\n\nThe experts' SwiGLU (three GEMMs) on routed rows, H={s['hidden']}, "
        f"F={s['ffn']}, top-{s['top_k']}, {s['dtype']}, {s['rows_per_expert']} rows per expert on "
        f"average (tokens scale with E, up to {s.get('max_assignments', 'any')} rows). "
        f"*time / dense*: median time over the median of a dense "
        f"SwiGLU on the same N useful rows, timed in the same interleaved rounds (1.0 is the "
        f"limit), with the min-max of the per-round ratios; *CPU time / dense*: the same with process "
        f"CPU time (steadier on a shared machine). *waste*: executed / useful FLOPs. "
        f"`capacity`: GShard buffers at factor {s['capacity_factor']} (drops); `dense-all`: every "
        f"expert on every token. Routing: `uniform`, `zipf` (s=1.1), `hot` (expert 0 in every "
        f"token's top-k).\n"
    )
    header = [
        "E",
        "tokens x k",
        "routing (max/mean)",
        "mode",
        "backend",
        "tile/block rows",
        "median ms",
        "dense ms",
        "time / dense (min-max)",
        "CPU time / dense",
        "waste",
        "drop rate",
    ]

    def skipped(r: dict) -> list:
        return [
            r["experts"],
            "",
            "",
            r["mode"],
            r["backend"],
            "",
            "",
            "",
            "skipped: " + r["skipped"],
            "",
            "",
            "",
        ]

    def timed(r: dict) -> list:
        routing = "-" if r["routing"] == "-" else f"{r['routing']} ({r['max_over_mean_load']:.2f})"
        tile = f"{r['tile_rows']}/{r['block_rows']}" if r["tile_rows"] else ""
        return [
            r["experts"],
            f"{r['tokens']} x {r['top_k']}",
            routing,
            r["mode"],
            r["backend"],
            tile,
            fmt_ms(r["time"])[0],
            fmt_ms(r["dense_time"])[0],
            common.ratio_cell(r),
            _cpu(r),
            f"{r['padding_waste']:.3f}",
            f"{r['drop_rate']:.1%}" if r["backend"] == "capacity" else "",
        ]

    return head + "\n" + _rows_table(sec["rows"], header, skipped, timed)


def layer_md(sec: dict[str, Any]) -> str:
    """The layer section's Markdown: the layer table and the train-step line."""
    header = [
        "T",
        "H",
        "F",
        "E",
        "k",
        "backend",
        "router",
        "median ms",
        "tokens/s",
        "time / dense (min-max)",
        "CPU time / dense",
        "drop rate",
        "max/mean load",
    ]
    shape = lambda r: [r["tokens"], r["hidden"], r["ffn"], r["experts"], r["top_k"], r["backend"]]

    def skipped(r: dict) -> list:
        return shape(r) + ["", "", "", "skipped: " + r["skipped"], "", "", ""]

    def timed(r: dict) -> list:
        load = "" if r["max_over_mean_load"] is None else f"{r['max_over_mean_load']:.2f}"
        return shape(r) + [
            r["router"],
            fmt_ms(r["time"])[0],
            f"{r['tokens_per_s']:,.0f}",
            common.ratio_cell(r),
            _cpu(r),
            f"{r['drop_rate']:.1%}" if r["backend"] == "capacity" else "",
            load,
        ]

    table = _rows_table(sec["rows"], header, skipped, timed)
    t = sec["train_step"]
    step = (
        f"**Train step** of the `{t['preset']}` preset ({t['layers']} layers, E={t['experts']} "
        f"top-{t['top_k']}, H={t['hidden']}, F={t['ffn']}, {t['tokens_per_step']} tokens/step, "
        f"`{t['backend']}`): {fmt_ms(t['time'])[0]} ms/step ({fmt_ms(t['time'])[1]}), "
        f"{t['tokens_per_s']:,.0f} tokens/s; MoE layers {t['moe_fraction']:.0%} of the step "
        f"(ablation: the same step with every MoE block's routed experts replaced by a zero stub runs in "
        f"{fmt_ms(t['time_moe_removed'])[0]} ms; fraction = 1 - stub / full)."
    )
    return (
        f"## {sec['title']}\n\n`dropless_moe` forward+backward (gradients for x, gate and experts) "
        f"next to `capacity_moe` (factor {sec['sizes']['capacity_factor']}) and a dense SwiGLU on "
        f"the T*k useful rows (*time / dense*), timed side by side. Routers: `softmax` top-k; "
        f"`sigmoid-groups` (DeepSeek-V3 style: 4 groups, top-2 groups, scaling 2.5, bias).\n\n"
        + table
        + "\n\n"
        + step
    )


def compiles_md(sec: dict[str, Any]) -> str:
    """The compile section's Markdown table."""
    d, e = sec["dropless"], sec["ep"]
    lines = [
        f"## {sec['title']}",
        "",
        f"{d['steps']} steps; routing drifts uniform -> Zipf (hottest experts on EP rank 0) -> "
        f"uniform, fresh tokens each step.",
        "",
        markdown_table(
            [
                "run",
                "compilations (traces / XLA)",
                "expected",
                "compile s",
                "buckets touched",
                "reruns",
                "ok",
            ],
            [
                [
                    "dropless_moe, 1 device",
                    f"{d['traces']} / {d['compilations']}",
                    d["expected"],
                    f"{d['compile_s']:.1f}",
                    "",
                    "",
                    d["ok"],
                ],
                [
                    "dropless_moe a2a, BucketedStep, 8 devices",
                    f"{e['traces']} / {e['compilations']}",
                    e["expected"],
                    f"{e['compile_s']:.1f}",
                    ", ".join(map(str, e["buckets_touched"])),
                    e["reruns"],
                    e["ok"],
                ],
            ],
        ),
    ]
    return "\n".join(lines)


def targets(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue with the measured number and met / not met."""
    out = []
    g = sections.get("gemm")
    if g:
        tiled = [r for r in g["rows"] if not r["skipped"] and r["backend"] == "tiled"]
        real = [r for r in tiled if realistic(r)]
        if real:
            waste = max(r["padding_waste"] for r in real)
            out.append(_t("padding waste at realistic shapes (any routing)", waste, "<=", TARGETS["padding"]))
        for kind, routings, key in (
            ("uniform", ("uniform",), "gemm_uniform"),
            ("worst skew", ("zipf", "hot"), "gemm_skewed"),
        ):
            sel = [r for r in real if r["mode"] == "fwd+bwd" and r["routing"] in routings]
            if sel:
                worst = max(sel, key=lambda r: r["ratio"])
                out.append(
                    _t(
                        f"grouped GEMM fwd+bwd / dense, {kind}, realistic shapes (worst: "
                        f"E={worst['experts']} {worst['routing']})",
                        worst["ratio"],
                        "<=",
                        TARGETS[key],
                        max(r.get("cpu_ratio", float("nan")) for r in sel),
                    )
                )
    lay = sections.get("layer")
    if lay:
        out += _layer_targets(lay["rows"])
    if sections.get("loss"):
        out += _memory_targets(sections["loss"])
    return out


def _memory_targets(sec: dict[str, Any]) -> list[dict]:
    """Loss temp memory flat in V (up to 32,768) and planner activations flat in S at equal
    tokens per micro-batch where the attention stores no [S, S] array (the loss section)."""
    out = []
    rows = [r for r in sec["rows"] if r["vs_first_vocab"] and r["vocab"] <= 32768]
    if len(rows) > 1:
        worst = max(rows, key=lambda r: (round(r["vs_first_vocab"], 6), r["vocab"]))
        out.append(
            _t(
                f"loss compiled temp, V={worst['vocab']} / V={rows[0]['vocab']} at "
                f"T={sec['sizes']['tokens']}",
                worst["vs_first_vocab"],
                "<=",
                TARGETS["loss_vocab"],
            )
        )
    flat = [r for r in sec.get("plan_rows", []) if r["equal_tokens"] and r["memory"] == "flash"]
    if flat:
        worst = max(flat, key=lambda r: (round(r["vs_first_seq"], 6), r["seq_len"]))
        first = sec["sizes"]["seq_lens"][0]
        out.append(
            _t(
                f"planner activations, S={worst['seq_len']} / S={first} at equal tokens "
                f"per micro-batch ({worst['runs']})",
                worst["vs_first_seq"],
                "<=",
                TARGETS["plan_seq"],
            )
        )
    return out


def _t(name: str, value: float, op: str, target: float, cpu: float | None = None) -> dict[str, Any]:
    """A target row; ``cpu`` is the same quantity from process CPU times (informative)."""
    met = {"<=": value <= target, "<": value < target, ">=": value >= target}[op]
    return {"target": name, "value": value, "op": op, "limit": target, "met": bool(met), "cpu_value": cpu}


def _layer_targets(rows: list[dict]) -> list[dict]:
    out = []
    timed = [r for r in rows if not r["skipped"]]
    get = lambda T, b, router="softmax": next(
        (r for r in timed if r["tokens"] == T and r["backend"] == b and r["router"] == router), None
    )
    for T in sorted({r["tokens"] for r in timed}, reverse=True):
        tiled, ragged, cap = get(T, "tiled"), get(T, "ragged_dot"), get(T, "capacity")
        if tiled and T == 8192:
            out.append(
                _t(
                    "layer fwd+bwd / dense SwiGLU at T=8192 H=512 F=1024 E=32 k=2",
                    tiled["ratio"],
                    "<=",
                    TARGETS["layer_dense"],
                    tiled.get("cpu_ratio"),
                )
            )
        if tiled and ragged:
            out.append(
                _t(
                    f"layer tokens/s tiled / ragged_dot at T={T}",
                    tiled["tokens_per_s"] / ragged["tokens_per_s"],
                    ">=",
                    TARGETS["layer_ragged"],
                )
            )
        if tiled and cap:
            out.append(
                _t(
                    f"layer time tiled / capacity(1.25) at T={T} (capacity drops {cap['drop_rate']:.1%})",
                    tiled["time"]["median_s"] / cap["time"]["median_s"],
                    "<",
                    1.0,
                    tiled.get("cpu_ratio", 0) / cap["cpu_ratio"] if "cpu_ratio" in cap else None,
                )
            )
    return out


def targets_md(items: list[dict]) -> str:
    if not items:
        return ""
    cpu = lambda t: "" if t.get("cpu_value") is None else f"{t['cpu_value']:.3f}"
    rows = [
        [
            t["target"],
            f"{t['value']:.3f}",
            cpu(t),
            f"{t['op']} {t['limit']}",
            "met" if t["met"] else "not met",
        ]
        for t in items
    ]
    return (
        "## Targets\n\nMeasured on wall-clock medians (met / not met); the CPU-time column "
        "is the same ratio from process CPU time, for shared machines.\n\n"
        + markdown_table(["target", "measured", "CPU time", "target", ""], rows)
    )
