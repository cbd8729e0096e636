"""Experiment tracking: TensorBoard event files read back from disk, failures that only warn,
the W&B fallback, the ETA of the progress line, and a real run writing its events."""

import json
import re
import struct
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import records, sets, train_cli

from moe_train import config
from moe_train.train import metrics, tracking

tensorboardX = pytest.importorskip("tensorboardX", reason="tensorboardX (a base dependency) is not installed")
event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
masked_crc32c = pytest.importorskip("tensorboardX.record_writer").masked_crc32c

LOADS = [[167, 149, 83, 80, 296, 63, 64, 122], [48, 83, 147, 182, 192, 52, 60, 260]]


# --- reading event files back: TFRecord framing (length, crc, data, crc), then Event protos ---


def _records(path: Path):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
        body = data[pos + 12 : pos + 12 + length]
        (crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        assert crc == masked_crc32c(body)
        yield body
        pos += 16 + length


def event_files(out: Path) -> list[Path]:
    """The event files of a run in the order TensorBoard reads them (by name)."""
    return sorted((out / tracking.TB_DIR).glob("events.out.tfevents.*"))


def events(path: Path) -> list[event_pb2.Event]:
    return [event_pb2.Event.FromString(body) for body in _records(path)]


def scalars(evs) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for ev in evs:
        for v in ev.summary.value:
            if v.WhichOneof("value") == "simple_value":
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def histograms(evs) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for ev in evs:
        for v in ev.summary.value:
            if v.WhichOneof("value") == "histo":
                out.setdefault(v.tag, []).append(ev.step)
    return out


# --- records and trackers ---


def step_record(step: int, loss: float = 2.5) -> dict:
    """A record as the loop writes it: ``metrics.step_record`` of host-side step outputs plus
    the loop's fields (compiled memory on a start's first step, the non-finite guard's)."""
    raw = {
        "loss": np.float32(loss),
        "total_loss": np.float32(loss + 0.02),
        "aux_loss": np.float32(1.03),
        "seq_aux_loss": np.float32(1.04),
        "z_loss": np.float32(4.5),
        "grad_norm": np.float32(1.87),
        "lr": np.float32(6e-4),
        "tokens_per_expert": np.array(LOADS, np.int32),
        "recv_buffer_fill": np.float32(1.0),
        "dropped_tokens": np.int32(0),
        "ep_slow_link_rows": np.float32(0.0),
        "ep_bucket": 1.25,
        "ep_overflow_reruns": 0,
    }
    rec = metrics.step_record(
        step,
        raw,
        step_time_s=0.02,
        tokens=512,
        flops_per_token=1e6,
        devices=1,
        peak_flops=989e12,
        compilations=1,
    )
    rec.update(compiled=step == 1, skipped=False, nonfinite_skips=0)
    if step == 1:
        rec.update(compiled_peak_bytes=22188003, compiled_temp_bytes=16762424, selftest_s=2.5)
    return json.loads(json.dumps(rec))  # as read back from metrics.jsonl


def train_cfg(**fields) -> config.TrainConfig:
    return config.TrainConfig(**{"steps": 100, "log_every": 1, **fields})


def track(out: Path, recs, start_step: int = 0, log=None, **fields) -> list[str]:
    logged = [] if log is None else log
    tracker = tracking.Tracker(out, start_step, train_cfg(**fields), log=logged.append)
    for rec in recs:
        tracker.write(rec)
    tracker.close()
    return logged


def numeric(value) -> bool:
    return isinstance(value, (int, float))


# --- what is written ---


def test_every_numeric_key_of_a_step_record_is_a_scalar_at_its_step(tmp_path):
    rec = step_record(1)
    track(tmp_path, [rec])
    got = scalars(events(event_files(tmp_path)[0]))
    for key, value in rec.items():
        if key not in ("step", "tokens_per_expert") and numeric(value):
            assert got[tracking.tag_of(key)] == [(1, pytest.approx(float(value), rel=1e-6))], key


def test_tags_are_grouped_by_what_they_measure():
    tags = {
        key: tracking.tag_of(key)
        for key in (
            "loss",
            "mtp_loss",
            "grad_norm",
            "tokens_per_s",
            "mfu",
            "compiled_peak_bytes",
            "max_over_mean_load",
            "ep_overflow_reruns",
            "eval_loss",
            "something_new",
        )
    }
    assert tags == {
        "loss": "train/loss",
        "mtp_loss": "train/mtp_loss",
        "grad_norm": "train/grad_norm",
        "tokens_per_s": "perf/tokens_per_s",
        "mfu": "perf/mfu",
        "compiled_peak_bytes": "memory/compiled_peak_bytes",
        "max_over_mean_load": "moe/max_over_mean_load",
        "ep_overflow_reruns": "moe/ep_overflow_reruns",
        "eval_loss": "eval/loss",
        "something_new": "other/something_new",
    }


def test_none_and_strings_are_left_out_and_booleans_are_0_or_1():
    rec = {**step_record(2), "mfu": None, "ep_bucket": "worst", "mtp_loss": None}
    got = tracking.scalars(rec)
    assert "perf/mfu" not in got and "moe/ep_bucket" not in got and "train/mtp_loss" not in got
    assert got["perf/compiled"] == 0.0 and got["train/skipped"] == 0.0


def test_each_moe_layer_gets_its_load_scalars(tmp_path):
    track(tmp_path, [step_record(1)])
    got = scalars(events(event_files(tmp_path)[0]))
    for layer, loads in enumerate(LOADS):
        top, mean = max(loads), sum(loads) / len(loads)
        assert got[f"moe/layer_{layer}/max_load"] == [(1, top)]
        assert got[f"moe/layer_{layer}/mean_load"] == [(1, pytest.approx(mean))]
        assert got[f"moe/layer_{layer}/max_over_mean_load"] == [(1, pytest.approx(top / mean))]


def test_load_histograms_at_the_first_every_50th_and_last_step(tmp_path):
    track(tmp_path, [step_record(n) for n in range(1, 101)])
    got = histograms(events(event_files(tmp_path)[0]))
    assert got == {f"moe/layer_{layer}/tokens_per_expert": [1, 50, 100] for layer in (0, 1)}


def test_a_load_histogram_counts_every_expert(tmp_path):
    track(tmp_path, [step_record(1)])
    (ev,) = [e for e in events(event_files(tmp_path)[0]) if e.step == 1 and e.summary.value]
    histo = next(v.histo for v in ev.summary.value if v.tag == "moe/layer_1/tokens_per_expert")
    assert (histo.num, histo.min, histo.max, sum(histo.bucket)) == (8, 48, 260, 8)


def test_one_record_is_one_event(tmp_path):
    track(tmp_path, [step_record(n) for n in (1, 2, 3)])
    steps = [e.step for e in events(event_files(tmp_path)[0]) if e.summary.value]
    assert steps == [1, 2, 3]


# --- resume ---


def test_a_resumed_start_writes_session_start_at_the_step_after_the_resumed_one(tmp_path):
    track(tmp_path, [step_record(n) for n in range(1, 8)])  # a start that crashed after step 7
    track(tmp_path, [step_record(n, loss=1.0) for n in (6, 7)], start_step=5)
    first, second = event_files(tmp_path)
    starts = [e.step for e in events(second) if e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [6]
    assert scalars(events(second))["train/loss"] == [(6, 1.0), (7, 1.0)]


def test_a_resumed_start_keeps_the_earlier_file_and_sorts_after_it(tmp_path):
    track(tmp_path, [step_record(n) for n in (1, 2, 3)])
    before = event_files(tmp_path)[0].read_bytes()
    track(tmp_path, [step_record(3, loss=1.0)], start_step=2)
    first, second = event_files(tmp_path)
    assert first.read_bytes() == before
    assert [s for s, _ in scalars(events(second))["train/loss"]] == [3]


# --- failures only warn ---


def test_missing_tensorboardX_is_one_warning_and_no_directory(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` fails
    logged = track(tmp_path, [step_record(1), step_record(2)])
    assert len(logged) == 1 and logged[0].startswith("WARNING: TensorBoard is off")
    assert "tensorboardX cannot be imported" in logged[0]
    assert not (tmp_path / tracking.TB_DIR).exists()


def test_an_unwritable_tensorboard_directory_is_one_warning(tmp_path):
    (tmp_path / tracking.TB_DIR).write_text("a file where the directory should be")
    logged = track(tmp_path, [step_record(1), step_record(2)])
    assert len(logged) == 1 and "TensorBoard is off for the rest of this run" in logged[0]
    assert str(tmp_path / tracking.TB_DIR) in logged[0]


def test_a_dead_writer_thread_is_one_warning_not_a_hang(tmp_path):
    logged = []
    tracker = tracking.Tracker(tmp_path, 0, train_cfg(), log=logged.append)
    tracker.write(step_record(1))
    assert tracker._tb is not None
    tracker._tb._writer.file_writer.event_writer._worker.stop()  # the thread ends
    done = threading.Event()

    def write_more():  # without the check, the queue fills and the 101st write blocks
        for n in range(2, 2 + 2 * tracking.MAX_QUEUE):
            tracker.write(step_record(n))
        done.set()

    threading.Thread(target=write_more, daemon=True).start()
    assert done.wait(30), "writing after the writer thread died blocked"
    tracker.close()
    assert len(logged) == 1 and "writer thread died" in logged[0] and not tracker.active


def test_tensorboard_false_writes_no_directory(tmp_path):
    assert track(tmp_path, [step_record(1)], tensorboard=False) == []
    assert not (tmp_path / tracking.TB_DIR).exists()


def test_missing_wandb_is_one_warning_and_tensorboard_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    logged = track(tmp_path, [step_record(1), step_record(2)], wandb_project="moe")
    assert len(logged) == 1 and logged[0].startswith("WARNING: W&B is off")
    assert "train.wandb_project='moe'" in logged[0]
    assert [s for s, _ in scalars(events(event_files(tmp_path)[0]))["train/loss"]] == [1, 2]


def test_wandb_run_id_is_stable_per_run_directory_and_valid(tmp_path):
    a = tracking.run_id(tmp_path / "my run:7")
    assert a == tracking.run_id(tmp_path / "my run:7") != tracking.run_id(tmp_path / "other")
    assert re.fullmatch(r"my-run-7-[0-9a-f]{8}", a)


# --- progress line ---


def _timed(step: int, seconds: float, compiled: bool = False) -> dict:
    return {**step_record(step), "step_time_s": seconds, "compiled": compiled}


def test_eta_is_steps_left_times_the_median_step_time_without_compiling_steps():
    recent = [_timed(1, 90.0, compiled=True), _timed(2, 1.0), _timed(3, 3.0), _timed(4, 2.0)]
    line = metrics.progress_line(recent[-1], 100, recent)
    assert line.endswith("| eta 3m12s")  # 96 steps left x 2 s


def test_no_eta_before_a_step_that_did_not_compile():
    rec = _timed(1, 90.0, compiled=True)
    assert "eta" not in metrics.progress_line(rec, 100, [rec])


def test_the_last_step_has_eta_zero():
    recent = [_timed(1, 9.0, compiled=True), _timed(2, 1.0)]
    assert metrics.progress_line(recent[-1], 2, recent).endswith("| eta 0s")


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0s"),
        (0.4, "<1s"),
        (45, "45s"),
        (192, "3m12s"),
        (7500, "2h05m"),
        (273600, "3d04h"),
        (float("nan"), "?"),
    ],
)
def test_format_duration(seconds, text):
    assert metrics.format_duration(seconds) == text


# --- a real run ---


@pytest.mark.slow
def test_a_real_run_writes_every_metric_to_tensorboard(tmp_path):
    out = tmp_path / "run"
    proc = train_cli(out, *sets("train.steps=3", "parallel.devices=1"), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING: TensorBoard" not in proc.stdout + proc.stderr
    (path,) = event_files(out)
    got = scalars(events(path))
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3]
    for rec in records(out):
        for key, value in rec.items():
            if key not in ("step", "tokens_per_expert") and numeric(value):
                assert (rec["step"], pytest.approx(float(value), rel=1e-6, nan_ok=True)) in got[
                    tracking.tag_of(key)
                ], key
    assert re.search(r"step 3/3 .*\| eta 0s", proc.stdout)
