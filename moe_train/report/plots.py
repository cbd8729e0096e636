"""The report's figures, drawn with matplotlib's Agg backend into ``<run>/report/*.png``.

Each function takes what it plots (metrics records or telemetry lines), writes zero or more
PNGs and returns ``Figure``s; a figure with nothing to show is left out, never drawn empty.
Records lacking a field are skipped point by point.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

from moe_train.base.tomlfile import read_toml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

MAX_LEGEND_RANKS = 8  # more ranks than this: thin unlabelled lines, no legend
MAX_LAYER_LINES = 12  # more MoE layers than this: plot the median and worst layer only
DPI = 100


@dataclass(frozen=True)
class Figure:
    """One PNG of the report."""

    name: str  # file stem under <run>/report/ and the HTML element id ("fig-<name>")
    title: str  # heading above it
    path: Path  # the PNG file
    caption: str  # one line under it


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _series(records: Iterable[dict[str, Any]], key: str, x: str = "step") -> tuple[list, list]:
    """(x values, y values) of the records where both are numbers."""
    xs, ys = [], []
    for r in records:
        a, b = _num(r.get(x)), _num(r.get(key))
        if a is not None and b is not None and np.isfinite(b):
            xs.append(a)
            ys.append(b)
    return xs, ys


def _save(fig: Any, out_dir: Path, name: str, title: str, caption: str) -> Figure:
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return Figure(name, title, path, caption)


def _step_panels(rows: int, height: float) -> tuple[Any, Any]:
    """A figure of ``rows`` panels, one above the other, over a shared step axis."""
    fig, axes = plt.subplots(rows, 1, figsize=(9, height), sharex=True)
    axes[-1].set_xlabel("step")
    return fig, axes


def training(metrics: list[dict[str, Any]], out_dir: Path) -> list[Figure]:
    """Loss, auxiliary losses and learning rate over steps."""
    if not metrics:
        return []
    fig, axes = _step_panels(3, 6.5)
    for ax, keys, label in (
        (axes[0], ("loss", "eval_loss", "mtp_loss", "total_loss"), "loss"),
        (axes[1], ("aux_loss", "seq_aux_loss"), "aux loss"),
        (axes[2], ("lr",), "learning rate"),
    ):
        for key in keys:
            xs, ys = _series(metrics, key)
            if xs:
                sparse = len(xs) < 50 or key == "eval_loss"  # evaluated every N steps
                ax.plot(xs, ys, marker="." if sparse else None, label=key)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(loc="upper right", fontsize=8)
    caption = (
        "loss is the next-token cross-entropy; eval_loss (with train.eval_every) the "
        "same on held-out data; mtp_loss (with multi-token prediction) "
        "the mean cross-entropy of the MTP depths; total_loss adds the weighted MTP, "
        "aux and z losses"
    )
    return [_save(fig, out_dir, "training", "Loss, aux loss and learning rate", caption)]


def _loads(metrics: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps [S], tokens per expert [S, L, E]) of the records whose shapes agree."""
    shaped = [(r["step"], np.asarray(r.get("tokens_per_expert") or [], dtype=float)) for r in metrics]
    shaped = [(s, a) for s, a in shaped if a.ndim == 2 and a.size]
    if not shaped:
        return None
    shape = shaped[-1][1].shape
    shaped = [(s, a) for s, a in shaped if a.shape == shape]
    return np.array([s for s, _ in shaped]), np.stack([a for _, a in shaped])


def experts(metrics: list[dict[str, Any]], out_dir: Path) -> list[Figure]:
    """The per-expert load figures: the heatmaps, then the balance plot; none without loads."""
    loaded = _loads(metrics)
    if loaded is None:
        return []
    return [*expert_heatmaps(*loaded, out_dir), *load_balance(*loaded, out_dir)]


def expert_heatmaps(steps: np.ndarray, loads: np.ndarray, out_dir: Path) -> list[Figure]:
    """One heatmap per MoE layer: each expert's load over steps, as a multiple of the mean."""
    figures = []
    for layer in range(loads.shape[1]):
        rel = loads[:, layer, :] / np.maximum(loads[:, layer, :].mean(axis=1, keepdims=True), 1e-9)
        fig, ax = plt.subplots(figsize=(9, 2.2 + 0.02 * rel.shape[1]))
        im = ax.imshow(
            rel.T,
            aspect="auto",
            origin="lower",
            cmap="viridis",
            interpolation="nearest",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, rel.shape[1] - 0.5),
        )
        fig.colorbar(im, ax=ax, label="load / mean")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
        figures.append(
            _save(
                fig,
                out_dir,
                f"experts_layer{layer}",
                f"Tokens per expert, MoE layer {layer}",
                f"{rel.shape[1]} experts; 1.0 is a perfectly balanced expert",
            )
        )
    return figures


def load_balance(steps: np.ndarray, loads: np.ndarray, out_dir: Path) -> list[Figure]:
    """Max/mean expert load over steps, per MoE layer (or median and worst when many)."""
    ratio = loads.max(axis=2) / np.maximum(loads.mean(axis=2), 1e-9)  # [S, L]
    fig, ax = plt.subplots(figsize=(9, 3.2))
    if ratio.shape[1] <= MAX_LAYER_LINES:
        for layer in range(ratio.shape[1]):
            ax.plot(steps, ratio[:, layer], lw=1, label=f"MoE layer {layer}")
    else:
        ax.plot(steps, np.median(ratio, axis=1), lw=1, label="median over layers")
    ax.plot(steps, ratio.max(axis=1), color="black", lw=1.5, ls="--", label="worst layer")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return [
        _save(
            fig,
            out_dir,
            "load_balance",
            "Expert load balance",
            "the busiest expert's tokens over the mean; 1.0 is perfect balance",
        )
    ]


def throughput(metrics: list[dict[str, Any]], out_dir: Path) -> list[Figure]:
    """Step time and tokens/s over steps; steps that compiled are marked."""
    if not metrics:
        return []
    compiled = [r for r in metrics if r.get("compiled")]
    fig, axes = _step_panels(2, 5)
    for ax, key, scale, label in (
        (axes[0], "step_time_s", 1e3, "step time (ms)"),
        (axes[1], "tokens_per_s", 1.0, "tokens/s"),
    ):
        xs, ys = _series(metrics, key)
        ax.plot(xs, np.array(ys) * scale, marker="." if len(xs) < 50 else None, label=key)
        cx, cy = _series(compiled, key)
        if cx:
            ax.scatter(
                cx, np.array(cy) * scale, color="red", marker="x", s=60, zorder=3, label="step compiled"
            )
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if any(v > 0 for v in _series(metrics, "step_time_s")[1]):
        axes[0].set_yscale("log")
    caption = f"{len(compiled)} step(s) compiled (red x); step time on a log scale"
    return [_save(fig, out_dir, "throughput", "Step time and throughput", caption)]


def _rank_lines(
    ax: Any,
    telemetry: dict[int, list[dict]],
    key: str,
    t0: float,
    scale: float = 1.0,
    style: str = "-",
    label: str = "",
) -> bool:
    """Plot ``key`` over time for every rank; False when no rank has it."""
    drawn = False
    many = len(telemetry) > MAX_LEGEND_RANKS
    for i, (rank, recs) in enumerate(telemetry.items()):
        xs, ys = _series(recs, key, x="time")
        if xs:  # one colour per rank in every panel; tx/rx differ by line style
            ax.plot(
                np.array(xs) - t0,
                np.array(ys) * scale,
                style,
                color=f"C{i % 10}",
                lw=0.6 if many else 1.2,
                label=None if many else f"rank {rank}{label}",
            )
            drawn = True
    return drawn


def compile_spans(records: list[dict[str, Any]], compiled: Set[int]) -> list[tuple[float, float]]:
    """(start, end) times of the steps in ``compiled``, from one rank's step marks."""
    marks = [
        m
        for r in records
        if r.get("kind") == "sample"
        for m in (r.get("steps") or ())
        if isinstance(m, list) and len(m) == 2 and _num(m[1]) is not None
    ]
    return [(a[1], b[1]) for a, b in zip(marks, marks[1:]) if a[0] in compiled and b[1] >= a[1]]


def _time_panels(
    telemetry: dict[int, list[dict]], figure: dict[str, Any], out_dir: Path, compiled: Set[int] = frozenset()
) -> list[Figure]:
    """One of the ``TIME_FIGURES``: a panel per panel of it with data; x = seconds."""
    times = [
        r["time"]
        for recs in telemetry.values()
        for r in recs
        if r.get("kind") == "sample" and _num(r.get("time")) is not None
    ]
    present = [
        panel
        for panel in figure["panel"]
        if any(_series(recs, key, x="time")[0] for recs in telemetry.values() for key, *_ in panel["lines"])
    ]
    if not times or not present:
        return []
    t0 = min(times)
    fig, axes = plt.subplots(
        len(present), 1, figsize=(9, 1.9 * len(present) + 0.8), sharex=True, squeeze=False
    )
    spans = compile_spans(next(iter(telemetry.values())), compiled)
    for ax, panel in zip(axes[:, 0], present):
        for i, (a, b) in enumerate(spans):
            ax.axvspan(a - t0, b - t0, color="red", alpha=0.08, label=None if i else "compiling step")
        for key, style, suffix in panel["lines"]:
            _rank_lines(ax, telemetry, key, t0, panel["scale"], style, suffix)
        ax.set_ylabel(panel["label"], fontsize=8)
        ax.grid(alpha=0.3)
        if len(telemetry) <= MAX_LEGEND_RANKS:
            ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the first sample")
    return [_save(fig, out_dir, figure["name"], figure["title"], figure["caption"])]


# The figures over time, one line per rank, each {name, title, caption, panel: [{label, lines,
# scale}]} (the file says what they mean).
TIME_FIGURES_FILE = Path(__file__).with_name("time_figures.toml")
TIME_FIGURES: list[dict[str, Any]] = read_toml(TIME_FIGURES_FILE, ValueError)["figure"]


def over_time(
    telemetry: dict[int, list[dict]], out_dir: Path, compiled: Set[int] = frozenset()
) -> list[Figure]:
    """The ``TIME_FIGURES``: GPU utilization, power, memory, NVLink and GPM activity, then host
    CPU, process CPU, resident memory and load, over time per rank."""
    return [fig for figure in TIME_FIGURES for fig in _time_panels(telemetry, figure, out_dir, compiled)]


def all_figures(metrics: list[dict], telemetry: dict[int, list[dict]], out_dir: Path) -> list[Figure]:
    """Every figure the data allows, in report order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    compiled = {r["step"] for r in metrics if r.get("compiled")}
    return [
        *training(metrics, out_dir),
        *experts(metrics, out_dir),
        *throughput(metrics, out_dir),
        *over_time(telemetry, out_dir, compiled),
    ]
