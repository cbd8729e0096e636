"""No silence over 10 s: the commands a newcomer runs first, at toy sizes, each read line by line
(stdout and stderr together, as a terminal shows them) with the time every line arrived.

A command fails when the time between two lines (or from its start to its first line, or from
its last line to its exit) is over ``MAX_GAP_S``: the kit's 10 s heartbeat period
(``moe_train.train.progress.EVERY_S``) plus ``SLACK_S`` for a heartbeat thread's wake-up on a
loaded 2-core machine. The children run without the test suite's compilation cache, as a
newcomer's first run does. The XLA:GPU compile runs where its plugin is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CORPUS, ROOT

from moe_train.planner.compile import plugin
from moe_train.train.progress import EVERY_S

SLACK_S = 1.0
MAX_GAP_S = EVERY_S + SLACK_S
NO_PLUGIN = plugin.version_problem(plugin.search_path())


def timed_lines(args: list[str], timeout: float = 600) -> tuple[int, list[tuple[float, str]]]:
    """``python -m ARGS`` from the repository root: its exit code and every output line with
    the seconds since the start at which it arrived; a last ``(t, "<exit>")`` at its end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(PYTHONUNBUFFERED="1", JAX_ENABLE_COMPILATION_CACHE="false")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in proc.stdout]
    rc = proc.wait(timeout=timeout)
    return rc, [*lines, (time.monotonic() - t0, "<exit>")]


def longest_gap(lines: list[tuple[float, str]]) -> tuple[float, str]:
    """The longest silence and the line that ended it."""
    times = [0.0] + [t for t, _ in lines]
    return max((b - a, line) for a, b, (_, line) in zip(times, times[1:], lines))


def commands(tmp: Path) -> dict[str, list[str]]:
    """The newcomer's commands (README, docs/data.md), in the order they depend on each other."""
    data, run = tmp / "data", tmp / "run"
    out = {
        "prepare": ["moe_train.data", "prepare", "--train-tokenizer", "512", "--input", str(CORPUS)],
        "train": ["moe_train", "--preset", "tiny", "--out", str(run), "--steps", "5"],
        "eval": ["moe_train.eval", str(run), "--data", str(data)],
        "plan": ["moe_train.planner", "--preset", "h100-dgx", "--model", "mixtral-8x7b", "--nodes", "8"],
        "compile": ["moe_train.planner.compile", "--preset", "h100-dgx", "--model", "tiny", "--nodes", "1"],
    }
    out["prepare"] += ["--out", str(data)]
    out["plan"] += ["--ep", "8"]
    out["train"] += ["--set", "data.source=prepared", "--set", f"data.path={data}"]
    out["compile"] += ["--ep", "8", "--set", "moe.capacity_buckets=1", "--out", str(tmp / "compile")]
    return out


NAMES = ["prepare", "train", "eval", "plan", "compile"]


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, tuple[int, list[tuple[float, str]]]]:
    tmp = tmp_path_factory.mktemp("newcomer")
    cmds = commands(tmp)
    return {name: timed_lines(cmds[name]) for name in NAMES if name != "compile" or NO_PLUGIN is None}


def _ran(ran: dict, name: str) -> tuple[int, list[tuple[float, str]]]:
    if name not in ran:
        pytest.skip(f"no CUDA PJRT plugin: {NO_PLUGIN}")
    return ran[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_command_succeeds(ran, name):
    rc, lines = _ran(ran, name)
    assert rc == 0, "\n".join(line for _, line in lines[-20:])


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_no_silence_over_ten_seconds(ran, name):
    _, lines = _ran(ran, name)
    gap, line = longest_gap(lines)
    assert gap <= MAX_GAP_S, f"{gap:.1f} s of silence before: {line}"


def test_the_longest_gap_is_found_and_named():
    lines = [(1.0, "a"), (13.0, "b"), (14.0, "<exit>")]
    assert longest_gap(lines) == (12.0, "b")
