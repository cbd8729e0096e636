"""A real CPU run's telemetry, summary and report; the report rendered in headless Chromium."""

import json
import shutil
import statistics

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="the report extra (matplotlib) is not installed")

from moe_train import config, report  # noqa: E402
from moe_train.report import browser, plots  # noqa: E402
from moe_train.report.__main__ import main as report_main  # noqa: E402
from moe_train.telemetry import summary
from moe_train.telemetry.files import load_run  # noqa: E402
from moe_train.train.loop import EXIT_OK, run  # noqa: E402

STEPS = 6
FIGURES = {"training", "experts_layer0", "experts_layer1", "load_balance", "throughput", "host"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The tiny preset, 6 steps, sampling every 0.2 s: what `make smoke` does, in-process."""
    out = tmp_path_factory.mktemp("smoke")
    cfg = config.build(
        "tiny",
        [
            f"train.steps={STEPS}",
            "parallel.devices=1",
            "train.log_every=100",
            "train.telemetry_interval_s=0.2",
        ],
    )
    assert run(cfg, out, log=lambda s: None) == EXIT_OK
    return out


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cpu_run_writes_host_telemetry(smoke):
    lines = _lines(smoke / "telemetry" / "rank0.jsonl")
    start, stop = lines[0], lines[-1]
    assert start["kind"] == "start" and start["platform"] == "cpu"
    assert start["nvml"].startswith(("unavailable: ", "unused: JAX platform is cpu"))
    samples = [l for l in lines if l["kind"] == "sample"]
    assert samples and all("rss_bytes" in s and "load1" in s for s in samples)
    marks = [m[0] for s in samples for m in s.get("steps", [])]
    assert marks == [*range(1, STEPS + 1), None]
    assert stop["kind"] == "stop" and stop["samples"] == len(samples)


def test_summary_agrees_with_metrics(smoke):
    written = json.loads((smoke / "summary.json").read_text())
    metrics = _lines(smoke / "metrics.jsonl")
    steady = [r for r in metrics if not r["compiled"]]
    job = written["job"]
    assert job["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s"] for r in steady))
    assert job["tflops_per_device"] == pytest.approx(
        statistics.median(r["tflops_per_device"] for r in steady)
    )
    assert job["mfu"] is None and job["gpu_util_pct"] is None  # CPU: no peak, no GPU
    assert job["host_cpu_pct"] is not None and job["ranks_found"] == 1 and job["missing_ranks"] == []
    assert job["tokens"] == STEPS * 8 * 64 and written["progress"]["last_step"] == STEPS
    again = summary.build(load_run(smoke))  # offline recomputation gives the same figures
    assert again["job"]["tokens_per_s"] == job["tokens_per_s"]


def test_report_figures_agree_with_metrics(smoke, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(smoke, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    rep = report.build(run_dir)
    assert {f.name for f in rep.figures} == FIGURES and rep.skipped_lines == 0
    assert sorted(p.stem for p in (run_dir / "report").glob("*.png")) == sorted(FIGURES)
    metrics = _lines(run_dir / "metrics.jsonl")
    drawn = plots._loads(metrics)  # what the heatmaps and balance plot draw
    assert drawn is not None
    steps, loads = drawn
    assert steps.tolist() == list(range(1, STEPS + 1))
    np.testing.assert_array_equal(loads, [r["tokens_per_expert"] for r in metrics])
    page = rep.html_path.read_text()
    assert page.count("data:image/png;base64,") == len(FIGURES)
    assert "http://" not in page and "https://" not in page and "<script" not in page
    tok_s = statistics.median(r["tokens_per_s"] for r in metrics if not r["compiled"])
    assert f"{tok_s:,.0f}" in page  # the summary table shows the median from metrics.jsonl
    assert "unavailable: " in page or "unused: " in page


def test_report_of_a_crashed_or_running_run_skips_cut_lines(smoke, tmp_path, capsys):
    run_dir = tmp_path / "cut"
    shutil.copytree(smoke, run_dir, ignore=shutil.ignore_patterns("checkpoints", "summary.json"))
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(metrics[:3]) + "\n" + metrics[3][:40])
    with (run_dir / "telemetry" / "rank0.jsonl").open("a") as f:
        f.write('not json\n{"kind": "sample", "time": 1')
    (run_dir / "telemetry" / "rank1.jsonl").write_text("")  # a rank that had not sampled yet
    assert report_main([str(run_dir)]) == 0
    assert "3 cut or unreadable line(s) skipped" in capsys.readouterr().out
    page = (run_dir / "report.html").read_text()
    assert "<b id=skipped-lines>3</b>" in page and "Step 3 of 6: partial" in page


def test_report_of_an_almost_empty_directory(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    rep = report.build(tmp_path)
    assert rep.figures == () and "config.json: unreadable" in rep.html_path.read_text()
    assert report_main([str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("content", [{}, {"notes.txt": "mine"}])
def test_report_of_a_directory_that_is_no_run_exits_2_with_one_line(tmp_path, capsys, content):
    for name, text in content.items():
        (tmp_path / name).write_text(text)
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {tmp_path} is not a run directory: it holds none of config.json, "
        "metrics.jsonl, telemetry, summary.json, layout.json, kernels.json, "
        "checkpoints; give a training run's --out"
    ]


def test_report_of_a_directory_that_is_no_run_writes_nothing(tmp_path):
    report_main([str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def _odd_metrics_line(smoke, tmp_path, edit) -> tuple:
    """A copy of the smoke run whose fourth metrics line is ``edit(record)``; (report, page)."""
    run_dir = tmp_path / "odd"
    shutil.copytree(smoke, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[3] = edit(json.loads(lines[3]))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rep = report.build(run_dir)
    return rep, rep.html_path.read_text()


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: json.dumps({**r, "tokens_per_expert": "many"}),
        lambda r: json.dumps({**r, "tokens_per_expert": [[1, 2], [3]]}),
        lambda r: json.dumps({**r, "tokens_per_expert": [[1, "2"], [3, 4]]}),
        lambda r: json.dumps({**r, "tokens_per_s": "fast"}),
        lambda r: json.dumps({**r, "step_time_s": 10**30}),
        lambda r: json.dumps({**r, "compiled": "yes"}),
        lambda r: json.dumps({**r, "step": 4.0}),
        lambda r: json.dumps(r)[:-20],
    ],
    ids=[
        "string-loads",
        "ragged-loads",
        "string-load",
        "string-rate",
        "huge-int",
        "string-flag",
        "float-step",
        "truncated",
    ],
)
def test_an_odd_metrics_line_is_counted_and_skipped(smoke, tmp_path, edit):
    rep, page = _odd_metrics_line(smoke, tmp_path, edit)
    assert rep.skipped_lines == 1 and "<b id=skipped-lines>1</b>" in page


def test_the_records_around_an_odd_line_are_still_drawn(smoke, tmp_path):
    rep, _ = _odd_metrics_line(smoke, tmp_path, lambda r: json.dumps({**r, "tokens_per_expert": "many"}))
    assert {f.name for f in rep.figures} == FIGURES


@pytest.mark.parametrize(
    "line",
    [
        {"kind": "sample", "time": 5.0, "steps": 7},
        {"kind": "start", "time": 5.0, "rank": 0, "process_count": 2**21},  # ranks listed below it
        {"kind": "sample", "time": "later"},
    ],
    ids=["steps-not-a-list", "process-count-beyond-2**20", "string-time"],
)
def test_an_odd_telemetry_line_is_counted_and_skipped(smoke, tmp_path, line):
    run_dir = tmp_path / "odd"
    shutil.copytree(smoke, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    with (run_dir / "telemetry" / "rank0.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")
    assert report.build(run_dir).skipped_lines == 1


@pytest.mark.parametrize(
    "edit,problem",
    [
        (lambda c: {**c, "train": None}, "config.json: [train] is None, not a table"),
        (
            lambda c: {**c, "train": {**c["train"], "batch_size": "8"}},
            "config.json: train.batch_size is &#x27;8&#x27;, not int",
        ),
        (
            lambda c: {**c, "parallel": {**c["parallel"], "cluster": ["h100-dgx"]}},
            "config.json: parallel.cluster is [&#x27;h100-dgx&#x27;], not str",
        ),
    ],
    ids=["section-not-a-table", "string-batch-size", "list-cluster"],
)
def test_an_odd_config_is_named_on_the_page_and_not_used(smoke, tmp_path, edit, problem):
    run_dir = tmp_path / "odd"
    shutil.copytree(smoke, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps(edit(config)))
    page = report.build(run_dir).html_path.read_text()
    assert problem in page and "config.json is missing or unreadable" in page


@pytest.mark.skipif(
    browser.find_browser() is None, reason="no chromium on PATH (Debian: apt-get install chromium)"
)
def test_report_renders_in_headless_chromium(smoke):
    rep = report.build(smoke)
    shot = smoke / "report" / "screenshot.png"
    result = browser.render(rep.html_path, shot)
    assert result.errors == (), result.errors
    assert result.title.startswith("moe-train report")
    shown = {i["id"]: i for i in result.images}
    assert set(shown) == {f"fig-{name}" for name in FIGURES}
    for img in shown.values():
        assert img["complete"] and img["width"] > 100 and img["height"] > 100 and img["shown"] > 0, img
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.build(smoke).figures  # a rebuild keeps the screenshot
    assert shot.exists()


def test_gpu_telemetry_gets_the_gpu_figure(tmp_path):
    """Recorded NVML samples of two ranks (as a GPU run writes them) give the GPU panels."""
    lines = {0: [], 1: []}
    for rank in lines:
        lines[rank].append({"kind": "start", "time": 0.0, "rank": rank, "process_count": 2, "nvml": "ok"})
        lines[rank].append(
            {
                "kind": "unsupported",
                "time": 0.0,
                "field": "temp_c",
                "error": "NVMLError_NotSupported: Not Supported",
            }
        )
        for i in range(40):
            lines[rank].append(
                {
                    "kind": "sample",
                    "time": float(i),
                    "step": i // 4 + 1,
                    "steps": [[i // 4 + 1, float(i)]] if i % 4 == 0 else [],
                    "gpu_util_pct": 90 - 30 * rank,
                    "power_w": 600.0 + 10 * rank,
                    "mem_used_bytes": 8e10,
                    "nvlink_tx_gbps": 100.0 + i,
                    "nvlink_rx_gbps": 90.0 + i,
                    "gpm_sm_active_pct": 70.0,
                    "gpm_tensor_active_pct": 40.0,
                    "energy_j": 600.0 * i,
                }
            )
        path = tmp_path / "telemetry" / f"rank{rank}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(l) + "\n" for l in lines[rank]))
    rep = report.build(tmp_path)
    assert [f.name for f in rep.figures] == ["gpu"]
    page = rep.html_path.read_text()
    assert "<code>temp_c</code> unsupported" in page and "GPU utilization 60%" in page
