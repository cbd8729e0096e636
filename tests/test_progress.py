"""A line for every wait (``moe_train.train.progress``): quiet calls stay silent, slow ones get
a first line, heartbeats and their time; a training run says when it compiles and for how
long, and its last line's report command works as printed."""

import shlex
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import sets, train_cli

from moe_train.train import progress

ROOT = Path(__file__).resolve().parent.parent


def waited(seconds: float, **kw) -> list[str]:
    lines: list[str] = []
    with progress.Waiting(lines.append, "saving", **kw):
        time.sleep(seconds)
    return lines


def test_a_quick_wait_prints_nothing():
    assert waited(0.05, after_s=1.0) == []


def test_a_slow_wait_says_what_it_waits_for_first():
    assert waited(0.6, after_s=0.2, every_s=10)[0] == "saving ..."


def test_a_slow_wait_beats_while_it_lasts():
    lines = waited(1.0, after_s=0.1, every_s=0.3)
    assert sum(line.startswith("  still saving: ") for line in lines) >= 2, lines


def test_a_slow_wait_ends_with_its_duration():
    assert waited(0.5, after_s=0.1, every_s=10)[-1].startswith("saving: done in 0.")


def test_a_predicate_starts_the_first_line_with_its_description():
    flag = threading.Event()
    lines: list[str] = []
    with progress.Waiting(
        lines.append,
        "compiling",
        after_s=100,
        started=flag.is_set,
        describe=lambda: "compiling step 1",
        done=False,
    ):
        flag.set()
        time.sleep(0.4)
    assert lines == ["compiling step 1 ..."]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("run") / "r"
    proc = train_cli(out, "--steps", "2", *sets("train.seq_len=16", "train.batch_size=2"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, out


@pytest.mark.slow
def test_the_first_compile_is_announced_before_it_runs(trained):
    lines = trained[0].splitlines()
    announced = next(i for i, s in enumerate(lines) if s.startswith("compiling the train step for step 1"))
    assert announced < next(i for i, s in enumerate(lines) if s.startswith("step 1/2"))


@pytest.mark.slow
def test_the_first_compile_ends_with_its_duration(trained):
    assert any(s.startswith("compiled the train step in ") for s in trained[0].splitlines())


@pytest.mark.slow
def test_the_printed_report_command_runs_as_printed(trained):
    last = trained[0].strip().splitlines()[-1]
    command = last.split("report: ", 1)[1]
    proc = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and (trained[1] / "report.html").is_file(), proc.stderr[-2000:]


@pytest.fixture(scope="module")
def overflowed(tmp_path_factory) -> list[str]:
    """Expert parallelism on 4 devices with a tight first capacity bucket: tiny's routing is
    skewed at the start, so step 1 overflows it and reruns on the next bucket."""
    from moe_train import config
    from moe_train.train.loop import run

    cfg = config.build(
        "tiny",
        [
            "train.steps=2",
            "parallel.devices=4",
            "parallel.ep=4",
            "moe.dispatcher=a2a",
            "moe.capacity_buckets=1.0,1.25",
            "train.seq_len=32",
        ],
    )
    lines: list[str] = []
    run(cfg, tmp_path_factory.mktemp("ep"), log=lines.append)
    return lines


@pytest.mark.slow
def test_an_overflow_rerun_says_it_recompiles_and_why(overflowed):
    assert any(
        s.startswith("compiling the train step for a rerun of step 1: it overflowed") for s in overflowed
    ), overflowed
