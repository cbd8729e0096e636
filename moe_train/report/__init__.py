"""The run report: ``python -m moe_train.report RUN_DIR`` (``make report RUN=<dir>``).

Writes ``<RUN_DIR>/report.html``, one self-contained page (PNGs embedded as base64, no scripts,
no network), and the same PNGs under ``<RUN_DIR>/report/``:

* loss, aux loss and learning rate over steps;
* tokens per expert over steps, one heatmap per MoE layer, and max/mean load over steps;
* step time and tokens/s over steps, compile steps marked;
* GPU utilization, power, memory, NVLink, PCIe and GPM activity over time per rank (when a
  GPU was sampled), and host CPU, RSS and load per rank (always; the whole timeline on CPU);
* the summary (``moe_train.telemetry.summary``, recomputed from the files), data quality (skipped lines,
  missing files and ranks, unsupported NVML fields), the resolved config, the cluster preset
  and the layout (mesh, EP groups, NVLink domains).

It reads whatever is there: a running, finished or crashed run. Cut or unreadable lines are
skipped and counted on the page. ``moe_train.report.browser`` renders the page in headless
Chromium to check it (the tests do).

May import: ``moe_train.telemetry`` (the run's files and summary), ``topology`` (presets,
peaks) and matplotlib (the ``report`` extra). Nothing of the training path imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_train.report import html, plots
from moe_train.telemetry import summary as run_summary
from moe_train.telemetry.files import load_run

KEEP = ("screenshot.png",)  # files under <run>/report/ that are not figures


@dataclass(frozen=True)
class Report:
    """What ``build`` wrote."""

    html_path: Path  # <run>/report.html
    figures: tuple[plots.Figure, ...]  # the PNGs, in page order
    skipped_lines: int  # lines skipped as cut or unreadable, over all files


def build(run_dir: Path | str) -> Report:
    """Read ``run_dir`` and write its report page and PNGs."""
    run_dir = Path(run_dir)
    data = load_run(run_dir)
    summary = run_summary.build(data)
    fig_dir = run_dir / "report"
    fig_dir.mkdir(exist_ok=True)
    for old in fig_dir.glob("*.png"):  # figures of an earlier report that may not recur
        if old.name not in KEEP:
            old.unlink()
    figures = plots.all_figures(data.metrics, data.telemetry, fig_dir)
    path = run_dir / "report.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(html.page(data, summary, figures), encoding="utf-8")
    tmp.replace(path)
    return Report(path, tuple(figures), sum(data.skipped.values()))
