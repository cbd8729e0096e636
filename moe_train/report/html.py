"""The report page: one self-contained HTML file (inline CSS, PNGs as base64 data URIs, no
scripts, no external requests), readable in any browser.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
from collections.abc import Iterable, Sequence
from typing import Any

from moe_train.report.plots import Figure
from moe_train.telemetry.files import RunData
from topology import presets

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;padding:0 16px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f4f4f4}td.n{text-align:right}
figure{margin:16px 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;font-size:12px}.warn{background:#fff4e0;border:1px solid #f0c070;padding:8px}
.ok{color:#287028}.grid{display:flex;flex-wrap:wrap;gap:16px}code{font-size:12px}
"""


def esc(value: Any) -> str:
    """HTML-escaped text of ``value``."""
    return html.escape(str(value))


def fmt(value: Any, digits: int = 4) -> str:
    """A table cell's text: numbers to ``digits`` significant digits, None as "n/a"."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if 1e3 <= abs(value) < 1e15:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def table(rows: Iterable[Sequence[Any]], header: Sequence[str] | None = None) -> str:
    """An HTML table of already formatted cells (escaped here)."""
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        out.append(
            "<tr>"
            + "".join(
                f"<td class=n>{esc(fmt(c))}</td>"
                if isinstance(c, (int, float)) and not isinstance(c, bool)
                else f"<td>{esc(fmt(c))}</td>"
                for c in row
            )
            + "</tr>"
        )
    out.append("</table>")
    return "".join(out)


def _stat(s: dict | None, unit: str = "%") -> str:
    return "n/a" if not s else f"{s['mean']:.1f}{unit} (p5 {s['p5']:.1f}, p95 {s['p95']:.1f})"


RANK_KEYS = ("rank", "host", "nvml", "samples")  # the per-rank table's first columns, shown as they are


def summary_section(summary: dict[str, Any]) -> str:
    """Job-wide figures, per-rank table and stragglers."""
    j = summary["job"]
    mfu = j["mfu"]
    rows = [
        ("tokens/s (median, steady steps)", j["tokens_per_s"]),
        ("step time s (median, steady steps)", j["step_time_s"]),
        ("TFLOP/s per device", j["tflops_per_device"]),
        ("peak TFLOP/s per device", j["peak_tflops_per_device"]),
        ("MFU", None if mfu is None else f"{100 * mfu:.2f}%"),
        ("GPU utilization", _stat(j["gpu_util_pct"])),
        ("host CPU utilization", _stat(j["host_cpu_pct"])),
        ("mean power per GPU (W)", j["mean_power_w"]),
        ("total power (W)", j["total_power_w"]),
        ("energy (J)", j["energy_j"]),
        ("energy per token (J/token)", j["energy_per_token_j"]),
        ("tokens trained", j["tokens"]),
        ("steps (steady / compiled)", f"{j['steps']} ({j['steady_steps']} / {len(j['compiled_steps'])})"),
        (
            "ranks found / expected",
            f"{j['ranks_found']} / {j['ranks_expected']}"
            + (f", missing {j['missing_ranks']}" if j["missing_ranks"] else ""),
        ),
    ]
    ranks = [
        (
            *(r[k] for k in RANK_KEYS),
            _stat(r["gpu_util_pct"]),
            _stat(r["host_cpu_pct"]),
            r["power_w_mean"],
            r["energy_per_token_j"],
            r["step_time_s_median"],
            r["sample_ms_mean"],
        )
        for r in summary["ranks"]
    ]
    header = (
        *RANK_KEYS,
        "GPU util",
        "host CPU",
        "power W",
        "J/token",
        "median step s",
        "sample ms",
    )
    strag = summary["stragglers"]
    lines = "".join(f"<li>rank {s['rank']}: {esc(s['why'])}</li>" for s in strag)
    return (
        "<h2 id=summary>Summary</h2>"
        + table(rows, ("figure", "value"))
        + "<h3>Per rank</h3>"
        + table(ranks, header)
        + "<h3>Stragglers</h3>"
        + (f"<ul>{lines}</ul>" if strag else "<p class=ok>none</p>")
    )


def quality_section(data: RunData, summary: dict[str, Any]) -> str:
    """Skipped lines, missing files and ranks, NVML status and unsupported fields."""
    items = [
        f"{n} line(s) skipped in <code>{esc(f)}</code> (cut or unreadable)" for f, n in data.skipped.items()
    ]
    items += [esc(p) for p in data.problems]
    missing = summary["job"]["missing_ranks"]
    if missing:
        items.append(f"no telemetry from rank(s) {esc(missing)}")
    for r in summary["ranks"]:
        for field, error in r["unsupported"].items():
            items.append(f"rank {r['rank']}: <code>{esc(field)}</code> unsupported ({esc(error)})")
        items += [f"rank {r['rank']}: sampling stopped: {esc(e)}" for e in r["errors"]]
    total = sum(data.skipped.values())
    head = f"<p>Skipped lines: <b id=skipped-lines>{total}</b></p>"
    if not items:
        return "<h2 id=quality>Data quality</h2>" + head + "<p class=ok>all files complete</p>"
    return (
        "<h2 id=quality>Data quality</h2>"
        + head
        + "<div class=warn><ul>"
        + "".join(f"<li>{i}</li>" for i in items)
        + "</ul></div>"
    )


def figure_html(fig: Figure) -> str:
    """A figure with its PNG embedded as a base64 data URI."""
    data = base64.b64encode(fig.path.read_bytes()).decode("ascii")
    return (
        f"<figure><h3>{esc(fig.title)}</h3>"
        f'<img id="fig-{esc(fig.name)}" alt="{esc(fig.title)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{esc(fig.caption)} &middot; <code>report/{esc(fig.path.name)}</code>"
        f"</figcaption></figure>"
    )


def config_section(config: dict[str, Any] | None) -> str:
    """The resolved config, one table per section."""
    if not config:
        return "<h2 id=config>Config</h2><p>config.json is missing or unreadable.</p>"
    parts = []
    for section, values in config.items():
        rows = values.items() if isinstance(values, dict) else [("", values)]
        parts.append(f"<div><h3>[{esc(section)}]</h3>{table(rows)}</div>")
    return "<h2 id=config>Config</h2><div class=grid>" + "".join(parts) + "</div>"


def cluster_section(config: dict[str, Any] | None, layout: dict[str, Any] | None) -> str:
    """The cluster preset named by ``parallel.cluster`` and the run's mesh and EP groups."""
    out = ["<h2 id=cluster>Cluster and layout</h2>"]
    name = ((config or {}).get("parallel") or {}).get("cluster")
    if name:
        out.append(_preset_table(name))
    else:
        out.append("<p>No cluster preset (<code>parallel.cluster</code> is empty).</p>")
    if layout:
        rows = [
            ("mesh", layout.get("mesh")),
            ("EP groups", layout.get("ep_groups")),
            ("NVLink domains", layout.get("domains")),
            ("straddling", layout.get("straddling")),
            ("notes", "; ".join(layout.get("notes") or [])),
            ("warnings", "; ".join(layout.get("warnings") or []) or "none"),
        ]
        out.append("<h3>Layout (layout.json)</h3>" + table(rows))
    return "".join(out)


def _preset_table(name: str) -> str:
    try:
        c = presets.load(name)
    except presets.TopologyError as err:
        return f"<p class=warn>cluster preset {esc(name)!r} does not load: {esc(err)}</p>"
    rows = [
        ("name", c.name),
        ("description", c.description),
        ("source", c.source),
        ("nominal numbers", c.nominal),
        ("GPUs per node", c.gpus_per_node),
        ("NVLink domain (GPUs)", c.domain_size),
        ("NVLink GB/s per GPU", c.nvlink_gbps_per_gpu),
        ("network GB/s per GPU", c.nic_gbps_per_gpu),
        ("peak bf16 TFLOP/s", c.peak_bf16_flops / 1e12),
        ("peak fp8 TFLOP/s", c.peak_fp8_flops / 1e12),
        ("sbatch", " ".join(c.sbatch_args())),
    ]
    return f"<h3>Cluster preset {esc(name)}</h3>" + table(rows)


def page(data: RunData, summary: dict[str, Any], figures: list[Figure]) -> str:
    """The whole report page."""
    progress = summary["progress"]
    done = progress["last_step"] is not None and progress["last_step"] == progress["total_steps"]
    state = "complete" if done else "partial (still running, stopped or crashed)"
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    nav = " &middot; ".join(
        f"<a href=#{a}>{t}</a>"
        for a, t in (
            ("summary", "summary"),
            ("quality", "data quality"),
            ("figures", "figures"),
            ("config", "config"),
            ("cluster", "cluster"),
        )
    )
    return "".join(
        [
            "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
            '<link rel=icon href="data:,">',
            f"<title>moe-train report: {esc(data.run_dir.name)}</title><style>{CSS}</style></head><body>",
            f"<h1>moe-train run report: <code>{esc(data.run_dir)}</code></h1>",
            f"<p>Step {esc(progress['last_step'])} of {esc(progress['total_steps'])}: {state}. "
            f"Generated {now}. {len(figures)} figures.</p><p>{nav}</p>",
            summary_section(summary),
            quality_section(data, summary),
            "<h2 id=figures>Figures</h2>",
            "".join(figure_html(f) for f in figures) or "<p>no data yet</p>",
            config_section(data.config),
            cluster_section(data.config, data.layout),
            "</body></html>\n",
        ]
    )
