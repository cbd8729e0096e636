"""Real multi-process runs on CPU (2 processes x 2 fake devices, gloo collectives).

Two processes train exactly like one process with all four devices; a killed peer (process 0
or 1, also during an async checkpoint save) or a missing coordinator makes the other process
exit 4 with one line on stderr within the configured timeouts, never hang or abort.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import losses, records

from moe_train.base.exits import EXIT_DISTRIBUTED

ROOT = Path(__file__).resolve().parent.parent
# optim.decay_steps fixed: the compiled step does not depend on train.steps, so every test here
# reuses the programs compiled by the first one (persistent compilation cache, conftest.py)
SMALL = [
    "--preset",
    "tiny",
    "--set",
    "train.seq_len=16",
    "--set",
    "train.batch_size=4",
    "--set",
    "optim.decay_steps=1000",
]
HEARTBEAT_S = 5  # the survivor must go within the heartbeat, or 2x it (the step watchdog)
SLACK_S = 20  # process start-up and Python/JAX teardown on a loaded 2-core machine

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """``python -m moe_train ...`` with its output in files (no pipe can fill up and block)."""

    def __init__(self, log_dir: Path, name: str, *args: str):
        self.stdout_path, self.stderr_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "moe_train", *args], cwd=ROOT, env=env, stdout=out, stderr=err
            )

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=30)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def report(self) -> str:
        return f"rc={self.popen.poll()}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


def pair(log_dir: Path, out: Path, *args: str, port: int | None = None) -> list[Proc]:
    port = port or free_port()
    return [
        Proc(
            log_dir,
            f"p{i}",
            "--out",
            str(out),
            *SMALL,
            "--devices",
            "2",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(i),
            *args,
        )
        for i in range(2)
    ]


def wait_all(procs: list[Proc], timeout: float = 180) -> None:
    """Every process exits 0 within ``timeout``; leftovers are killed either way."""
    try:
        for p in procs:
            assert p.wait(timeout) == 0, p.report()
    finally:
        for p in procs:
            p.kill()


def metric_lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


EP_ACROSS_PROCESSES = [
    "--set",
    "parallel.ep=4",
    "--set",
    "moe.dispatcher=a2a",
    "--set",
    "moe.capacity_buckets=100",
]


@pytest.mark.parametrize("extra", [[], EP_ACROSS_PROCESSES], ids=["data-parallel", "ep4-a2a"])
def test_two_processes_match_one_process(tmp_path, extra):
    procs = [
        Proc(
            tmp_path, "one", "--out", str(tmp_path / "one"), *SMALL, "--steps", "4", "--devices", "4", *extra
        )
    ]
    procs += pair(tmp_path, tmp_path / "two", "--steps", "4", "--set", "parallel.init_timeout_s=60", *extra)
    wait_all(procs)
    procs = procs[1:]
    expected, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(got) == 4
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert "step 4/4" in procs[0].stdout and "step 4/4" not in procs[1].stdout  # only process 0 logs
    assert "2 process(es)" in procs[0].stdout
    assert (tmp_path / "two" / "checkpoints" / "4").is_dir()


def assert_one_error_line(proc: Proc) -> str:
    """Exit 4 and exactly one line on stderr, an "error:" line, no traceback or C++ dump."""
    assert proc.popen.returncode == EXIT_DISTRIBUTED, proc.report()
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.report()
    for bad in ("Traceback", "Fatal Python", "Check failure"):
        assert bad not in proc.stderr, proc.report()
    return lines[0]


# The bound (moe_train.train.distributed): a dead peer ends the others within 2 x the heartbeat once
# training runs (the coordination service: one heartbeat timeout; process 0 gone: at once).
@pytest.mark.parametrize(
    "victim, extra",
    [
        (1, []),
        (0, ["--set", "train.checkpoint_every=1"]),  # killed during an async checkpoint commit
        (1, ["--set", "train.checkpoint_every=1"]),
    ],
    ids=["kill-1", "kill-0-saving", "kill-1-saving"],
)
def test_killed_peer_ends_the_other_process(tmp_path, victim, extra):
    procs = pair(
        tmp_path,
        tmp_path / "run",
        "--steps",
        "100000",
        "--set",
        "parallel.init_timeout_s=60",
        "--set",
        f"parallel.heartbeat_timeout_s={HEARTBEAT_S}",
        *extra,
    )
    try:
        deadline = time.monotonic() + 150
        while metric_lines(tmp_path / "run") < 3:
            assert all(p.popen.poll() is None for p in procs), "\n".join(p.report() for p in procs)
            assert time.monotonic() < deadline, "no training progress"
            time.sleep(0.05)
        procs[victim].popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = procs[1 - victim]
        try:
            survivor.wait(2 * HEARTBEAT_S + SLACK_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"process {1 - victim} still running {2 * HEARTBEAT_S + SLACK_S} s after "
                f"its peer was killed\n{survivor.report()}"
            )
        elapsed = time.monotonic() - killed
        line = assert_one_error_line(survivor)
        assert f"process {1 - victim} of 2" in line
        assert elapsed < 2 * HEARTBEAT_S + SLACK_S
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("alone", [1, 0])
def test_missing_peer_fails_within_init_timeout(tmp_path, alone):
    init_s = 5
    p = Proc(
        tmp_path,
        "alone",
        "--out",
        str(tmp_path / "run"),
        *SMALL,
        "--devices",
        "2",
        "--coordinator",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        "2",
        "--process-id",
        str(alone),
        "--set",
        f"parallel.init_timeout_s={init_s}",
    )
    try:
        start = time.monotonic()
        rc = p.wait(init_s + SLACK_S)
        elapsed = time.monotonic() - start
    finally:
        p.kill()
    assert rc == EXIT_DISTRIBUTED, p.report()
    assert elapsed < init_s + SLACK_S
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.report()
    assert "127.0.0.1:" in lines[0] and f"init_timeout_s={init_s}" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing written


# A peer that hangs while alive keeps sending heartbeats, so JAX never fails the job; the
# other process waits in a collective for ever unless the step watchdog ends it.
STUCK_PEER = """
import sys, time
import numpy as np
import jax
from jax.sharding import NamedSharding, PartitionSpec
from moe_train.train import distributed
from moe_train.config import ParallelConfig

pid, port, hb = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
p = ParallelConfig(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                   init_timeout_s=60, heartbeat_timeout_s=hb)
info = distributed.initialize(p)
distributed.start_watchdog(distributed.watchdog_timeout_s(p), label=f"process {pid} of 2")
sharding = NamedSharding(jax.make_mesh((2,), ("d",)), PartitionSpec("d"))
total = jax.jit(lambda x: x.sum())
for step in range(1, 10**6):
    float(total(jax.make_array_from_process_local_data(sharding, np.ones(1, np.float32))))
    distributed.beat(step)
    print("step", step, flush=True)
    if pid == 1 and step == 3:
        time.sleep(10**6)  # alive, heartbeats going, never steps again
    time.sleep(0.05)
"""


def test_stuck_peer_is_caught_by_the_step_watchdog(tmp_path):
    port, procs = free_port(), []
    try:
        for pid in range(2):
            out, err = open(tmp_path / f"{pid}.out", "w"), open(tmp_path / f"{pid}.err", "w")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", STUCK_PEER, str(pid), str(port), str(HEARTBEAT_S)],
                    cwd=ROOT,
                    stdout=out,
                    stderr=err,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                )
            )
        deadline = time.monotonic() + 60
        while "step 3" not in (tmp_path / "1.out").read_text():
            assert procs[1].poll() is None and time.monotonic() < deadline, (tmp_path / "1.err").read_text()
            time.sleep(0.1)
        stuck = time.monotonic()
        rc = procs[0].wait(2 * HEARTBEAT_S + SLACK_S)
        elapsed = time.monotonic() - stuck
        err = (tmp_path / "0.err").read_text()
        assert rc == EXIT_DISTRIBUTED, err
        assert elapsed >= 2 * HEARTBEAT_S - 1  # not before the limit
        assert "error: process 0 of 2: no progress for 10 s after step 3" in err  # step 4 hangs
        # the stuck one goes too: its own watchdog, or the coordinator (process 0) going away
        assert procs[1].wait(SLACK_S) != 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


# Process 1 compiles the program GLOO_WAIT_S + 5 s later than process 0. Run as it comes,
# process 0's first collective would give up on the Gloo context after Gloo's 30 s; compiled
# together, process 0 waits at the barrier, and its step watchdog (10 s) does not count that.
GLOO_WAIT_S = 30
LATE_PEER = """
import sys, time
import numpy as np
import jax
from jax.sharding import NamedSharding, PartitionSpec
from moe_train.train import distributed
from moe_train.parallel import together
from moe_train.config import ParallelConfig

pid, port, hb, late_s = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
p = ParallelConfig(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                   init_timeout_s=60, heartbeat_timeout_s=hb)
info = distributed.initialize(p)
distributed.start_watchdog(distributed.watchdog_timeout_s(p), startup_timeout_s=2 * hb,
                           label=f"process {pid} of 2")
sharding = NamedSharding(jax.make_mesh((2,), ("d",)), PartitionSpec("d"))
x = jax.make_array_from_process_local_data(sharding, np.full(1, pid + 1.0, np.float32))


def slow_to_trace(a):
    if pid == 1:
        time.sleep(late_s)  # traced, so inside the compile
    return a.sum()


total = jax.jit(slow_to_trace)
together.compiled_together(total, (x,), "sum", p)
print("sum", float(total(x)), flush=True)
distributed.beat(1)
distributed.shutdown()
"""


def test_a_peer_that_compiles_late_is_waited_for(tmp_path):
    port, procs = free_port(), []
    try:
        for pid in range(2):
            args = [str(pid), str(port), str(HEARTBEAT_S), str(GLOO_WAIT_S + 5)]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", LATE_PEER, *args],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                )
            )
        outs = [p.communicate(timeout=GLOO_WAIT_S + 5 + 3 * SLACK_S) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0 and "sum 3.0" in out, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def test_training_loop_beats_the_watchdog(tmp_path):
    """The loop reports every finished step (``distributed.beat``); without it a multi-process
    run would be ended by the watchdog's start-up deadline."""
    from moe_train import config
    from moe_train.train import distributed
    from moe_train.train.loop import run

    cfg = config.build(
        "tiny",
        [
            "train.steps=3",
            "train.seq_len=16",
            "train.batch_size=4",
            "optim.decay_steps=1000",
            "parallel.devices=4",
        ],
    )
    wd = distributed.start_watchdog(10_000)
    try:
        assert run(cfg, tmp_path / "run", log=lambda line: None) == 0
        assert wd.last_step == 3 and not wd.fired
    finally:
        distributed.stop_watchdog()


SLURM_TASK = """
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec
from moe_train.train import distributed
from moe_train.config import ParallelConfig

info = distributed.initialize(ParallelConfig(init_timeout_s=30, heartbeat_timeout_s=10))
sharding = NamedSharding(jax.make_mesh((jax.device_count(),), ("d",)), PartitionSpec("d"))
x = jax.make_array_from_process_local_data(sharding, np.full(1, info.process_index + 1.0, np.float32))
print(info.source, info.process_index, info.process_count, info.coordinator,
      float(jax.jit(lambda a: a.sum())(x)), flush=True)
distributed.shutdown()
"""


def test_slurm_step_is_detected(tmp_path):
    """Two tasks with the variables srun sets: JAX's Slurm detection finds the coordinator."""
    for job in range(1000, 5096):  # JAX's port for a job: 61440 + job id mod 4096
        try:
            with socket.socket() as s:
                s.bind(("", 61440 + job % 4096))
            break
        except OSError:
            continue
    procs = []
    try:
        for rank in range(2):
            env = dict(
                os.environ,
                SLURM_JOB_ID=str(job),
                SLURM_STEP_NODELIST="localhost",
                SLURM_NTASKS="2",
                SLURM_STEP_NUM_TASKS="2",
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", SLURM_TASK],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        line = [ln for ln in out.splitlines() if ln.startswith("slurm")][0]
        assert line == f"slurm {rank} 2 localhost:{61440 + job % 4096} 3.0"


def test_signal_to_one_process_stops_all_at_the_same_step_and_resumes(tmp_path):
    """Slurm may signal the tasks at slightly different times: all agree on one stop step."""
    out, steps = tmp_path / "run", 12
    args = ("--steps", str(steps), "--set", "parallel.init_timeout_s=60")
    procs = pair(tmp_path, out, *args)
    try:
        deadline = time.monotonic() + 150
        while metric_lines(out) < 3:
            assert all(p.popen.poll() is None for p in procs), "\n".join(p.report() for p in procs)
            assert time.monotonic() < deadline, "no training progress"
            time.sleep(0.05)
        procs[1].popen.send_signal(signal.SIGUSR2)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    wait_all(procs, 120)
    assert "stopped by signal SIGUSR2" in procs[0].stdout
    stopped = metric_lines(out)
    assert stopped < steps and (out / "checkpoints" / str(stopped)).is_dir()
    wait_all(pair(tmp_path, out, *args))
    assert [r["step"] for r in records(out)] == list(range(1, steps + 1))
