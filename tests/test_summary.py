"""summary.json from recorded files: utilization, energy, MFU, stragglers, missing ranks."""

import json
import statistics

import pytest

from moe_train.telemetry import summary
from moe_train.telemetry.files import load_run, read_jsonl

TOKENS_PER_STEP = 4 * 16


def _write_jsonl(path, records, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def _metrics(steps=6):
    return [
        {
            "step": s,
            "loss": 5.0 - 0.1 * s,
            "aux_loss": 1.0,
            "lr": 1e-3,
            "step_time_s": 5.0 if s == 1 else 0.1 + 0.01 * s,
            "tokens_per_s": TOKENS_PER_STEP / (5.0 if s == 1 else 0.1 + 0.01 * s),
            "tflops_per_device": 100.0 * s,
            "mfu": None,
            "compiled": s == 1,
            "tokens_per_expert": [[10, 20, 30, 4]],
            "max_over_mean_load": 1.875,
        }
        for s in range(1, steps + 1)
    ]


def _telemetry(rank, util, step_s, power=500.0, t0=1000.0, steps=6, sessions=1):
    """One rank's lines: a start, then samples every 0.05 s while steps 1..steps run."""
    lines, t, energy = [], t0, 0.0
    for _ in range(sessions):
        lines.append(
            {
                "kind": "start",
                "time": t,
                "rank": rank,
                "process_count": 3,
                "nvml": "ok",
                "host": f"node{rank}",
                "device_kind": "NVIDIA H100 80GB HBM3",
            }
        )
        energy = 0.0
        for step in range(1, steps + 1):
            duration = 2.0 if step == 1 else step_s
            lines.append(
                {
                    "kind": "sample",
                    "time": t,
                    "step": step,
                    "steps": [[step, t]],
                    "gpu_util_pct": 5.0 if step == 1 else util,
                    "power_w": power,
                    "energy_j": energy,
                    "host_cpu_pct": 50.0,
                    "sample_ms": 0.5,
                }
            )
            t += duration
            energy += power * duration
        lines.append(
            {
                "kind": "sample",
                "time": t,
                "step": None,
                "steps": [[None, t]],
                "gpu_util_pct": 0.0,
                "power_w": power,
                "energy_j": energy,
                "sample_ms": 0.5,
            }
        )
    return lines, energy


@pytest.fixture
def run_dir(tmp_path):
    _write_jsonl(tmp_path / "metrics.jsonl", _metrics(), tail='{"step": 7, "loss": 4.')
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "train": {"batch_size": 4, "seq_len": 16, "steps": 10},
                "precision": {"compute": "bf16"},
                "parallel": {"cluster": "h100-dgx"},
            }
        )
    )
    energies = {}
    for rank, util, step_s in ((0, 90.0, 0.1), (1, 60.0, 0.2)):
        lines, energies[rank] = _telemetry(rank, util, step_s)
        _write_jsonl(tmp_path / "telemetry" / f"rank{rank}.jsonl", lines, tail='{"kind": "sam')
    return tmp_path, energies


def test_throughput_is_the_median_of_steps_that_did_not_compile(run_dir):
    path, _ = run_dir
    s = summary.build(load_run(path))
    steady = [r for r in _metrics() if not r["compiled"]]
    assert s["job"]["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s"] for r in steady))
    assert s["job"]["tflops_per_device"] == pytest.approx(400.0)
    assert s["job"]["peak_tflops_per_device"] == pytest.approx(989.0)  # the h100-dgx preset, bf16
    assert s["job"]["mfu"] == pytest.approx(400.0 / 989.0)
    assert s["job"]["tokens"] == 6 * TOKENS_PER_STEP and s["job"]["compiled_steps"] == [1]


def test_utilization_energy_and_power_per_rank_and_job(run_dir):
    path, energies = run_dir
    s = summary.build(load_run(path))
    r0, r1 = s["ranks"]
    assert r0["gpu_util_pct"]["mean"] == 90.0 and r0["window"] == "steps that did not compile"
    assert r0["energy_j"] == pytest.approx(energies[0])
    assert r0["step_time_s_median"] == pytest.approx(0.1) and r1["step_time_s_median"] == pytest.approx(0.2)
    job = s["job"]
    assert job["gpu_util_pct"]["p5"] == 60.0 and job["gpu_util_pct"]["p95"] == 90.0
    assert job["mean_power_w"] == 500.0 and job["total_power_w"] == 1000.0
    assert job["energy_j"] == pytest.approx(energies[0] + energies[1])
    assert job["energy_per_token_j"] is None  # rank 2 is missing: the total would undercount
    assert r0["energy_per_token_j"] == pytest.approx(energies[0] / (6 * TOKENS_PER_STEP / 3))


def test_missing_ranks_stragglers_and_skipped_lines(run_dir):
    path, _ = run_dir
    s = summary.build(load_run(path))
    assert s["job"]["ranks_expected"] == 3 and s["job"]["missing_ranks"] == [2]
    assert [x["rank"] for x in s["stragglers"]] == [1, 1]  # low utilization and slow steps
    assert "GPU utilization 60%" in s["stragglers"][0]["why"]
    assert s["data_quality"]["skipped_lines"] == {
        "metrics.jsonl": 1,
        "telemetry/rank0.jsonl": 1,
        "telemetry/rank1.jsonl": 1,
    }
    assert s["progress"] == {"last_step": 6, "total_steps": 10}


def test_energy_adds_up_over_resumed_sessions(tmp_path):
    lines, energy = _telemetry(0, 80.0, 0.1, sessions=2)
    assert summary._energy(lines) == pytest.approx(2 * energy)


def test_peak_follows_the_trainer_rules():
    bf16 = {"precision": {"compute": "bf16"}, "parallel": {"cluster": ""}}
    assert summary.peak_for(bf16, "NVIDIA H200") == 989e12
    assert summary.peak_for(bf16, "cpu") is None
    assert summary.peak_for({**bf16, "parallel": {"cluster": "cpu-local"}}, "NVIDIA H200") is None
    assert summary.peak_for({"precision": {"compute": "fp32"}, "parallel": {}}, "NVIDIA H200") is None


def test_stats_ignore_missing_values():
    assert summary.stats([None, "x", float("nan")]) is None
    s = summary.stats(range(101))
    assert s is not None and (s["mean"], s["p5"], s["p95"], s["n"]) == (50.0, 5.0, 95.0, 101)


def test_cli_writes_summary_json(run_dir, capsys):
    path, _ = run_dir
    assert summary.main([str(path)]) == 0
    written = json.loads((path / "summary.json").read_text())
    assert written["job"]["missing_ranks"] == [2]
    out = capsys.readouterr().out
    assert "stragglers: rank 1" in out and "MFU 40.4%" in out
    assert summary.main([str(path / "nope")]) == 2


def test_an_empty_directory_gives_a_summary_not_an_error(tmp_path):
    s = summary.build(load_run(tmp_path))
    assert s["job"]["tokens_per_s"] is None and s["ranks"] == []
    assert any("metrics.jsonl: missing" in p for p in s["data_quality"]["problems"])


def test_read_jsonl_counts_garbage(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n[1, 2]\n\xff\xfe\n\n{"b": 2}\n{"c"')
    records, skipped = read_jsonl(p)
    assert records == [{"a": 1}, {"b": 2}] and skipped == 3


@pytest.mark.parametrize(
    "config, peak_tflops",
    [
        ({"precision": {"compute": "fp8"}, "parallel": {"cluster": "h100-dgx"}}, 1979.0),
        ({"precision": {"compute": "bf16"}, "parallel": {"cluster": "h100-dgx"}}, 989.0),
        ({"precision": {"compute": "fp32"}, "parallel": {"cluster": "h100-dgx"}}, None),
        ({"model": {"dtype": "bfloat16"}, "parallel": {"cluster": "h100-dgx"}}, None),  # no such key: fp32
    ],
)
def test_mfu_peak_follows_precision_compute(config, peak_tflops):
    peak = summary.peak_for(config, None)
    assert (peak is None) if peak_tflops is None else peak == pytest.approx(peak_tflops * 1e12)
