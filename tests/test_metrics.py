"""MetricsWriter on resume: later steps and torn lines are dropped, the rewrite is atomic."""

import json
import os

import pytest

from moe_train.train import metrics


def _lines(*steps):
    return "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps)


@pytest.fixture
def path(tmp_path):
    return tmp_path / "metrics.jsonl"


def _open(path, start_step, log=None):
    logged = [] if log is None else log
    writer = metrics.MetricsWriter(path, start_step, log=logged.append)
    writer.close()
    return logged


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_torn_last_line_is_dropped(path):
    path.write_text(_lines(1, 2, 3) + '{"step": 4, "lo')
    _open(path, 4)
    assert _steps(path) == [1, 2, 3]


def test_torn_last_line_is_warned_about_with_its_line_number(path):
    path.write_text(_lines(1, 2, 3) + '{"step": 4, "lo')
    logged = _open(path, 4)
    assert logged == [
        f"WARNING: metrics.jsonl: dropped 1 unreadable line(s) (torn by a crash?) at line(s) 4 of {path}"
    ]


def test_garbage_middle_lines_are_dropped(path):
    path.write_bytes(
        _lines(1).encode()
        + b"\x00\x00\x00\n"
        + b"[1, 2]\n"
        + b'{"step": "2"}\n'
        + b"\xff\xfe\n"
        + _lines(3).encode()
    )
    logged = _open(path, 10)
    assert _steps(path) == [1, 3] and "dropped 4 unreadable line(s)" in logged[0]
    assert "at line(s) 2, 3, 4, 5 of" in logged[0]


def test_steps_after_start_step_are_dropped_without_warning(path):
    path.write_text(_lines(1, 2, 3, 4, 5))
    logged = _open(path, 3)
    assert _steps(path) == [1, 2, 3] and logged == []


def test_file_is_kept_untouched_when_nothing_changes(path):
    path.write_text(_lines(1, 2, 3))
    before = os.stat(path)
    _open(path, 3)
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_rewrite_replaces_the_file_and_leaves_no_temporary(path):
    path.write_text(_lines(1, 2, 3))
    before = os.stat(path).st_ino
    _open(path, 2)
    assert os.stat(path).st_ino != before  # a new file renamed over it, not truncated in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["metrics.jsonl"]


def test_failed_rewrite_keeps_the_earlier_records(path, monkeypatch):
    path.write_text(_lines(1, 2, 3))

    def crash(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics.os, "fsync", crash)
    with pytest.raises(OSError):
        _open(path, 1)
    assert _steps(path) == [1, 2, 3] and not path.with_name("metrics.jsonl.tmp").exists()


def test_complete_last_record_missing_its_newline_is_mended(path):
    path.write_text(_lines(1, 2) + json.dumps({"step": 3}))
    writer = metrics.MetricsWriter(path, 3, log=[].append)
    writer.write({"step": 4})
    writer.close()
    assert _steps(path) == [1, 2, 3, 4]


def test_missing_file_is_created_on_first_write(path):
    writer = metrics.MetricsWriter(path, 0, log=[].append)
    writer.write({"step": 1})
    writer.close()
    assert _steps(path) == [1]


def test_disabled_writer_leaves_the_file_alone(path):
    path.write_text(_lines(1, 2) + "torn")
    metrics.MetricsWriter(path, 0, enabled=False).close()
    assert path.read_text() == _lines(1, 2) + "torn"
