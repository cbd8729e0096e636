"""Stop safely at any time: Ctrl-C (SIGINT) stops like SIGTERM, saves the step it stopped at
and prints the command that resumes (exit 130); a second Ctrl-C ends the run at once without
leaving a partial checkpoint behind; ``train.checkpoint_minutes`` saves by wall time.

The runs are real ``python -m moe_train`` processes (``test_faults.cli``); the multi-process
supervisor is checked with a stand-in child (``test_distributed.SUPERVISOR``).
"""

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import QUIET, ROOT, pipe
from helpers import tiny_saving as tiny
from test_distributed import SUPERVISOR, wait_for
from test_faults import cli, finish, losses, saved_steps
from test_train import _wait_for_steps

from moe_train.base.exits import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK
from moe_train.train import cli as cli_module
from moe_train.train import loop as run_mod

HINT = "interrupted (Ctrl-C)"  # what the first Ctrl-C prints
STEPS = 60  # enough that a SIGINT after step 3 lands mid-run (tiny: ~20 ms a step on CPU)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of an uninterrupted run of the command line."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert finish(cli(out, steps=STEPS))[0] == EXIT_OK
    return losses(out)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Path, int, str]:
    """A run sent SIGINT after its third step: (run directory, exit code, stdout)."""
    out = tmp_path_factory.mktemp("interrupted")
    proc = cli(out, steps=STEPS)
    _wait_for_steps(out, 3)
    proc.send_signal(signal.SIGINT)
    code, stdout, _ = finish(proc)
    return out, code, stdout


def interrupt_twice(proc: subprocess.Popen, between) -> None:
    """SIGINT, ``between()`` (two signals sent at once would be one: the kernel merges a
    signal that is still pending), SIGINT."""
    proc.send_signal(signal.SIGINT)
    between()
    proc.send_signal(signal.SIGINT)


def stopped_at(stdout: str) -> int:
    line = next(x for x in stdout.splitlines() if "stopped by signal SIGINT after step" in x)
    return int(line.split("after step ")[1].split(";")[0])


@pytest.mark.slow
def test_ctrl_c_exits_130_mid_run(interrupted):
    _, code, stdout = interrupted
    assert code == EXIT_INTERRUPTED and 3 <= stopped_at(stdout) < STEPS, stdout


@pytest.mark.slow
def test_ctrl_c_saves_the_step_it_stopped_at(interrupted):
    out, _, stdout = interrupted
    assert saved_steps(out)[-1] == stopped_at(stdout)  # also saved every 2 steps (test_faults.cli)


@pytest.mark.slow
def test_ctrl_c_prints_the_resume_command_last(interrupted):
    out, _, stdout = interrupted
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("to resume, run: ") and f" --out {shlex.quote(str(out))} " in last


@pytest.mark.slow
def test_the_printed_command_resumes_at_that_step_and_matches_an_uninterrupted_run(
    tmp_path, interrupted, reference
):
    out, _, stdout = interrupted
    command = shlex.split(stdout.strip().splitlines()[-1].removeprefix("to resume, run: "))
    again = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert again.returncode == EXIT_OK, again.stderr
    assert f"(step {stopped_at(stdout)})" in again.stdout  # "resumed from .../N (step N)"
    assert losses(out) == reference  # bitwise on CPU in fp32


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_run_at_once_with_one_line(tmp_path):
    proc = cli(tmp_path, steps=400)
    _wait_for_steps(tmp_path, 2)
    interrupt_twice(proc, lambda: next(line for line in pipe(proc.stdout) if HINT in line))
    sent = time.monotonic()
    code, _, err = finish(proc, timeout=60)
    assert code == EXIT_INTERRUPTED and time.monotonic() - sent < 10
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted twice"), err


@pytest.mark.slow
def test_a_second_ctrl_c_while_a_checkpoint_is_written_loses_nothing(tmp_path, reference):
    proc, caught = cli(tmp_path, steps=STEPS), False  # saving every 2 steps
    ckpts = tmp_path / "checkpoints"
    while proc.poll() is None and not caught:
        caught = ckpts.is_dir() and any("orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir())
        time.sleep(0.001)
    interrupt_twice(proc, lambda: time.sleep(0.01))
    code, _, _ = finish(proc)
    if not caught or code != EXIT_INTERRUPTED:
        pytest.skip("every save finished before it could be interrupted")
    assert finish(cli(tmp_path, steps=STEPS))[0] == EXIT_OK
    assert losses(tmp_path) == reference


@pytest.mark.slow
def test_ctrl_c_during_start_up_exits_130_with_one_line_and_no_traceback(tmp_path):
    proc = cli(tmp_path, steps=6)
    time.sleep(1.5)  # importing JAX, the self-test or compiling
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc)
    assert code == EXIT_INTERRUPTED and "Traceback" not in err, err
    assert any(f"by signal SIGINT {when}" in out for when in ("during start-up", "after step 1"))


# --------------------------------------------------------------------------- a stuck start-up


@pytest.fixture
def stuck(tmp_path) -> subprocess.Popen:
    """A trainer stuck at start-up: it reads a prepared corpus's manifest.json that is a FIFO
    nobody writes to, so its main thread waits in ``open`` for ever (as on a hung file system)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    os.mkfifo(corpus / "manifest.json")
    proc = cli(tmp_path / "out", "--set", "data.source=prepared", "--set", f"data.path={corpus}")
    time.sleep(2)  # imported, and waiting
    assert proc.poll() is None, "the trainer should be waiting on the FIFO"
    return proc


def stop_line(stdout: str, signame: str) -> str:
    """The one line a stop during start-up prints (fails on any other output)."""
    lines = [x for x in stdout.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"stopped by signal {signame} during start-up"), stdout
    return lines[0]


def test_sigterm_ends_a_start_up_stuck_in_a_blocking_read(stuck):
    stuck.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code, out, err = finish(stuck, timeout=30)
    assert (code, err) == (EXIT_OK, "") and time.monotonic() - sent < 10
    assert "nothing was trained or saved" in stop_line(out, "SIGTERM")


def test_ctrl_c_ends_a_stuck_start_up_at_once_with_one_line(stuck):
    stuck.send_signal(signal.SIGINT)
    code, out, err = finish(stuck, timeout=30)
    assert (code, err) == (EXIT_INTERRUPTED, "") and stop_line(out, "SIGINT")


def test_ctrl_c_during_start_up_says_nothing_was_saved_not_that_the_step_will_be(stuck):
    stuck.send_signal(signal.SIGINT)
    _, out, _ = finish(stuck, timeout=30)
    assert "nothing was trained or saved" in out and "is saved" not in out and HINT not in out


def test_the_start_up_line_gives_the_command_that_starts_again(stuck):
    stuck.send_signal(signal.SIGTERM)
    _, out, _ = finish(stuck, timeout=30)
    command = stop_line(out, "SIGTERM").split("; to start again, run: ")[1]
    assert shlex.split(command)[1:] == ["-m", "moe_train", *map(str, stuck.args[3:])]


def test_ctrl_c_after_the_start_locked_a_new_out_leaves_no_directory(tmp_path):
    out = tmp_path / "new" / "run"
    proc = cli(out, steps=6)
    deadline = time.monotonic() + 120
    while not (out / "run.lock").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    code, stdout, _ = finish(proc, timeout=60)
    if "step 1/" in stdout:
        pytest.skip("the start-up was over before the signal")
    assert code == EXIT_INTERRUPTED and not (tmp_path / "new").exists(), stdout


# --------------------------------------------------------------------------- the command


def test_the_resume_command_drops_resume_step():
    argv = ["--out", "o", "--resume-step", "4", "--resume-step=4", "--resume", "4", "--steps", "9"]
    assert cli_module.rerun_command(argv).endswith(" -m moe_train --out o --steps 9")


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_checkpoint_minutes_must_be_finite_and_not_negative(tmp_path, capsys, value):
    argv = ["--out", str(tmp_path / "o"), "--set", f"train.checkpoint_minutes={value}"]
    code = cli_module.main(argv)
    assert code == EXIT_CONFIG and "train.checkpoint_minutes" in capsys.readouterr().err


# --------------------------------------------------------------------------- saves by wall time


@pytest.fixture(scope="module")
def timed(tmp_path_factory) -> tuple[Path, list[str]]:
    """A 6-step run saving every 0.06 s of wall time and never by step count: (out, log)."""
    out, log = tmp_path_factory.mktemp("timed"), []
    cfg = tiny(
        "train.checkpoint_every=0", "train.checkpoint_minutes=0.001", "train.keep_checkpoints=10", steps=6
    )
    assert run_mod.run(cfg, out, log=log.append) == EXIT_OK
    return out, log


def test_checkpoint_minutes_saves_before_the_end(timed):
    out, _ = timed
    assert len(saved_steps(out)) > 1 and saved_steps(out)[-1] == 6


def test_checkpoint_minutes_0_saves_only_at_the_end(tmp_path):
    cfg = tiny("train.checkpoint_every=0", "train.checkpoint_minutes=0", steps=3)
    assert run_mod.run(cfg, tmp_path, **QUIET) == EXIT_OK
    assert saved_steps(tmp_path) == [3]


def test_the_summary_says_when_the_last_checkpoint_was_saved(timed):
    _, log = timed
    summary = next(line for line in log if line.startswith("Trained steps"))
    assert "(the last: step 6, saved " in summary and " ago)" in summary


# --------------------------------------------------------------------------- multi-process


CHILD = """
import os, signal, sys, time
from moe_train.train import supervise
STAY = False  # True: go on after a SIGINT (a trainer finishing its step)
got = []
signal.signal(signal.SIGINT, lambda s, f: got.append(s))
supervise.child_ready()
print("child", os.getpid(), flush=True)
deadline = time.monotonic() + (60 if STAY else 20)
while (STAY or not got) and time.monotonic() < deadline:
    time.sleep(0.05)
print("got SIGINT" if got else "no signal", flush=True)
sys.exit(130 if got else 7)
"""


def supervised(tmp_path: Path, stay: bool) -> subprocess.Popen:
    """The supervisor of ``test_distributed`` over ``CHILD``."""
    out = open(tmp_path / "sup.out", "w")
    child = CHILD.replace("STAY = False", f"STAY = {stay}")
    return subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path / "run"), child],
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie until init reaps it
        return f.read().split()[2] == "Z"


def test_the_supervisor_forwards_ctrl_c_and_passes_130_through(tmp_path):
    p = supervised(tmp_path, stay=False)
    wait_for(tmp_path / "sup.out", "child ")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == EXIT_INTERRUPTED, err
    assert "got SIGINT" in (tmp_path / "sup.out").read_text()


def test_a_second_ctrl_c_ends_the_supervisor_and_its_child_at_once(tmp_path):
    p = supervised(tmp_path, stay=True)
    text = wait_for(tmp_path / "sup.out", "child ")
    pid = int(text.split("child ", 1)[1].split()[0])
    interrupt_twice(p, lambda: wait_for(tmp_path / "sup.out", HINT))
    _, err = p.communicate(timeout=30)
    assert p.returncode == EXIT_INTERRUPTED and err.startswith("error: interrupted twice"), err
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)


@pytest.mark.slow
def test_sigterm_ends_a_supervised_start_up_stuck_waiting_for_its_peers(tmp_path):
    """Process 1 of 2 with no process 0: its child waits in jax.distributed.initialize. The
    supervisor forwards SIGTERM; the child ends at once with the start-up line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--preset", "tiny", "--out", str(tmp_path / "out"), "--devices", "2"]
    argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1"]
    with open(tmp_path / "p.out", "w") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "moe_train", *argv],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        wait_for(tmp_path / "p.out", "waiting for the job's processes", timeout=60)
        p.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == EXIT_OK and time.monotonic() - sent < 10, err
    assert "stopped by signal SIGTERM during start-up" in (tmp_path / "p.out").read_text()
