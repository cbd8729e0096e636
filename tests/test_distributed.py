"""How a run decides single / explicit / Slurm, and the step watchdog (no processes started)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_train.base import exits
from moe_train.config import ConfigError, ParallelConfig
from moe_train.train import cli, distributed, supervise

ROOT = Path(__file__).resolve().parent.parent
SLURM_STEP = {
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
}


def P(**kw) -> ParallelConfig:
    return ParallelConfig(**kw)


def test_single_process_without_coordinator_or_slurm():
    assert distributed.plan(P(), {}) == ("single", {})
    assert distributed.plan(P(num_processes=1, process_id=0), {}) == ("single", {})


def test_one_slurm_task_is_single_process():
    env = dict(SLURM_STEP, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0")
    assert distributed.plan(P(), env) == ("single", {})


def test_batch_script_outside_srun_is_single_process():
    # sbatch --ntasks=4 runs the script once: no step variables, one process
    env = {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")}
    assert distributed.plan(P(), env) == ("single", {})


def test_explicit():
    source, kw = distributed.plan(
        P(
            coordinator="10.0.0.1:1234",
            num_processes=2,
            process_id=1,
            init_timeout_s=30,
            heartbeat_timeout_s=15,
        ),
        {},
    )
    assert source == "explicit"
    assert kw["coordinator_address"] == "10.0.0.1:1234"
    assert (kw["num_processes"], kw["process_id"]) == (2, 1)
    assert kw["cluster_detection_method"] == "deactivate"  # no Slurm device restriction
    assert kw["heartbeat_timeout_seconds"] == 15
    assert kw["initialization_timeout"] >= 30  # our own guard fires at exactly 30 s
    assert kw["shutdown_timeout_seconds"] == distributed.watchdog_timeout_s(P(heartbeat_timeout_s=15))


@pytest.mark.parametrize(
    "kw, needles",
    [
        (dict(), ["parallel.num_processes", "parallel.process_id"]),
        (dict(num_processes=2), ["parallel.process_id"]),
        (dict(process_id=0), ["parallel.num_processes"]),
    ],
)
def test_explicit_missing_keys(kw, needles):
    with pytest.raises(ConfigError) as err:
        distributed.plan(P(coordinator="127.0.0.1:5000", **kw), {})
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize("pid", [2, 5])
def test_explicit_rank_out_of_range(pid):
    with pytest.raises(ConfigError, match=rf"parallel.process_id={pid} is not in 0..1"):
        distributed.plan(P(coordinator="127.0.0.1:5000", num_processes=2, process_id=pid), {})


@pytest.mark.parametrize("address", ["localhost", "host:", ":123", "host:port", "host:70000"])
def test_bad_coordinator(address):
    with pytest.raises(ConfigError, match="parallel.coordinator"):
        distributed.plan(P(coordinator=address, num_processes=2, process_id=0), {})


def test_ipv6_coordinator():
    assert distributed.plan(P(coordinator="[::1]:5000", num_processes=2, process_id=0), {})[0] == "explicit"


def test_slurm():
    source, kw = distributed.plan(P(heartbeat_timeout_s=20), SLURM_STEP)
    assert source == "slurm"
    assert (kw["num_processes"], kw["process_id"]) == (4, 2)
    assert kw["cluster_detection_method"] == "slurm"
    assert "coordinator_address" not in kw  # JAX derives it from the step's first host
    assert kw["heartbeat_timeout_seconds"] == 20


def test_slurm_step_task_count_wins_over_job_task_count():
    env = dict(SLURM_STEP, SLURM_NTASKS="8", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1")
    assert distributed.plan(P(), env)[1]["num_processes"] == 2


def test_explicit_wins_over_slurm():
    source, kw = distributed.plan(P(coordinator="10.0.0.9:7000", num_processes=2, process_id=0), SLURM_STEP)
    assert source == "explicit"
    assert (kw["coordinator_address"], kw["num_processes"], kw["process_id"]) == ("10.0.0.9:7000", 2, 0)


def test_explicit_coordinator_fills_the_rest_from_slurm():
    source, kw = distributed.plan(P(coordinator="10.0.0.9:7000"), SLURM_STEP)
    assert source == "explicit" and (kw["num_processes"], kw["process_id"]) == (4, 2)


def test_processes_without_coordinator_outside_slurm():
    with pytest.raises(ConfigError, match="parallel.coordinator"):
        distributed.plan(P(num_processes=2, process_id=1), {})


@pytest.mark.parametrize("key", ["init_timeout_s", "heartbeat_timeout_s"])
def test_timeouts_must_be_positive(key):
    with pytest.raises(ConfigError, match=f"parallel.{key}=0"):
        distributed.plan(P(**{key: 0}), {})


def test_single_process_does_not_initialize(monkeypatch):
    import jax

    def boom(*a, **k):
        raise AssertionError("jax.distributed.initialize called for a single process")

    monkeypatch.setattr(jax.distributed, "initialize", boom)
    info = distributed.initialize(P(), env={})
    try:
        assert info == distributed.ProcessInfo(0, 1, "", "single")
        assert info.is_main and not info.multi
        distributed.beat(3)  # no watchdog: no-op
    finally:
        distributed.shutdown()


def test_explicit_initialize_passes_kwargs_and_reports_rank(monkeypatch):
    import jax

    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    monkeypatch.setattr(distributed, "_initialized", False)
    try:
        info = distributed.initialize(P(coordinator="127.0.0.1:5000", num_processes=3, process_id=2), env={})
        assert info == distributed.ProcessInfo(2, 3, "127.0.0.1:5000", "explicit")
        assert seen["process_id"] == 2 and seen["num_processes"] == 3
    finally:
        monkeypatch.setattr(distributed, "_info", distributed.ProcessInfo())
        monkeypatch.setattr(distributed, "_initialized", False)


def test_initialize_failure_is_one_line(monkeypatch):
    import jax

    def fail(**kw):
        raise RuntimeError("UNKNOWN: Failed to start RPC server\n  more detail")

    monkeypatch.setattr(jax.distributed, "initialize", fail)
    monkeypatch.setattr(distributed, "_initialized", False)
    with pytest.raises(distributed.DistributedError) as err:
        distributed.initialize(P(coordinator="127.0.0.1:5000", num_processes=2, process_id=0), env={})
    msg = str(err.value)
    assert "\n" not in msg and "127.0.0.1:5000" in msg and "process 0 of 2" in msg


def test_init_guard_message(monkeypatch, capsys):
    codes = []
    monkeypatch.setattr(distributed, "exit_now", codes.append)
    distributed._init_timed_out("127.0.0.1:5000", 1, 2, 7)
    err = capsys.readouterr().err.strip().splitlines()
    assert codes == [distributed.EXIT_DISTRIBUTED]
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "127.0.0.1:5000" in err[0] and "init_timeout_s=7" in err[0]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_watchdog_fires_after_timeout_since_last_beat():
    clock, fired = Clock(), []
    wd = distributed.Watchdog(10, clock=clock, on_expire=fired.append, label="process 1 of 2")
    clock.t += 1000
    assert not wd.check()  # unarmed before the first beat without a startup timeout
    wd.beat(5)
    clock.t += 9.9
    assert not wd.check()
    wd.beat(6)
    clock.t += 9.9
    assert not wd.check()
    clock.t += 0.2
    assert wd.check() and len(fired) == 1
    assert "after step 6" in fired[0] and "process 1 of 2" in fired[0]
    assert fired[0].startswith("error: ") and "\n" not in fired[0]
    assert not wd.check()  # fires once


def test_watchdog_startup_deadline():
    clock, fired = Clock(), []
    wd = distributed.Watchdog(10, startup_timeout_s=60, clock=clock, on_expire=fired.append)
    clock.t += 59
    assert not wd.check()
    clock.t += 2
    assert wd.check() and "start-up" in fired[0]


def test_watchdog_does_not_count_a_compile():
    clock, fired, quiet = Clock(), [], [float("-inf")]
    wd = distributed.Watchdog(10, clock=clock, on_expire=fired.append, quiet_until=lambda: quiet[0])
    wd.beat(1)
    quiet[0] = float("inf")  # compiling, or waiting for the peers to compile
    clock.t += 1000
    assert not wd.check()
    quiet[0] = clock.t  # done now: a full timeout from here
    clock.t += 9.9
    assert not wd.check()
    clock.t += 0.2
    assert wd.check() and "after step 1" in fired[0]


def test_watchdog_startup_deadline_gives_a_full_timeout_after_a_compile():
    clock, fired, quiet = Clock(), [], [float("-inf")]
    wd = distributed.Watchdog(
        10, startup_timeout_s=60, clock=clock, on_expire=fired.append, quiet_until=lambda: quiet[0]
    )
    clock.t += 58
    quiet[0] = clock.t  # a compile ended 2 s before the start-up deadline
    clock.t += 9.9
    assert not wd.check()
    clock.t += 0.2
    assert wd.check() and "start-up" in fired[0]


def test_watchdog_stop_disarms():
    clock, fired = Clock(), []
    wd = distributed.Watchdog(10, clock=clock, on_expire=fired.append)
    wd.beat(1)
    wd.stop()
    clock.t += 100
    assert not wd.check() and not fired


def test_watchdog_thread_calls_exit(monkeypatch):
    import threading

    done = threading.Event()
    codes = []
    monkeypatch.setattr(distributed, "exit_now", lambda code: (codes.append(code), done.set()))
    wd = distributed.Watchdog(0.2, poll_s=0.05).start()
    wd.beat(3)
    assert done.wait(5)
    wd.stop()
    assert codes == [distributed.EXIT_DISTRIBUTED]


def test_module_level_beat_reaches_the_running_watchdog():
    wd = distributed.start_watchdog(60)
    try:
        distributed.beat(7)
        assert wd.last_step == 7
    finally:
        distributed.stop_watchdog()
    distributed.beat(8)  # stopped: no-op
    assert wd.last_step == 7


def test_cli_flags_map_to_parallel_keys(tmp_path):
    args = cli.parser().parse_args(
        [
            "--out",
            str(tmp_path),
            "--coordinator",
            "127.0.0.1:999",
            "--num-processes",
            "2",
            "--process-id",
            "1",
            "--devices",
            "2",
        ]
    )
    p = cli.resolve(args).parallel
    assert (p.coordinator, p.num_processes, p.process_id, p.devices) == ("127.0.0.1:999", 2, 1, 2)


def test_cli_devices_are_per_process(tmp_path):
    args = cli.parser().parse_args(["--out", str(tmp_path), "--devices", "2"])
    cfg = cli.resolve(args)
    two = distributed.ProcessInfo(1, 2, "h:1", "explicit")
    cfg2, local = cli._per_process_devices(cfg, args, two)
    assert (cfg2.parallel.devices, local) == (4, 2)
    assert cli._per_process_devices(cfg, args, distributed.ProcessInfo())[1] == 2
    args = cli.parser().parse_args(["--out", str(tmp_path), "--set", "parallel.devices=6"])
    cfg = cli.resolve(args)
    assert cli._per_process_devices(cfg, args, two) == (cfg, 3)
    args = cli.parser().parse_args(["--out", str(tmp_path), "--set", "parallel.devices=5"])
    with pytest.raises(ConfigError, match="not divisible by 2 processes"):
        cli._per_process_devices(cli.resolve(args), args, two)


def test_peer_failure_is_recognised():
    from jax.errors import JaxRuntimeError

    gloo = JaxRuntimeError(
        "UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error "
        "[127.0.0.1]:17095: Connection reset by peer"
    )
    line = distributed.peer_failure(gloo)
    assert line and "peer died" in line and "Connection reset by peer" in line and "\n" not in line
    assert distributed.peer_failure(JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")) is None
    assert distributed.peer_failure(ValueError("bad shape")) is None


def test_peer_failure_recognises_value_errors_and_wrapped_causes():
    from jax.errors import JaxRuntimeError

    gloo = ValueError(
        "UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
        "Read error [127.0.0.1]:37052: Connection reset by peer"
    )
    assert "Connection reset by peer" in str(distributed.peer_failure(gloo))  # process_allgather
    try:  # orbax: a failed commit barrier, raised again as a TimeoutError
        try:
            raise JaxRuntimeError(
                "INTERNAL: Barrier failed because: task is set to ERROR: "
                "UNAVAILABLE: Task 1 heartbeat timeout."
            )
        except JaxRuntimeError as cause:
            raise TimeoutError("Timed out while waiting for async_write_complete barrier.") from cause
    except TimeoutError as err:
        assert "heartbeat timeout" in str(distributed.peer_failure(err))
    assert distributed.peer_failure(ValueError("operands could not be broadcast together")) is None
    assert distributed.peer_failure(KeyError("gloo")) is None


# --------------------------------------------------------------------------- the supervisor

HEARTBEATS = [
    "E1201 12:13:52.926574   20917 coordination_service.cc:1549] [386] Use error polling "
    "to propagate the following error to all tasks: UNAVAILABLE: The following tasks "
    "are unhealthy (stopped sending heartbeats):",
    "1",
    "The tasks have crashed. Check the task logs for an earlier error.",
    "F1201 12:13:52.927144   20928 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors. absl::Status: UNAVAILABLE: The following "
    "tasks are unhealthy (stopped sending heartbeats):",
    "1",
    "The tasks have crashed. Check the task logs for an earlier error, or scheduler events.",
    "",
    "RPC: /xla.coordination.CoordinationService/PollForError",
    "ERROR:absl:[process=0] Failed to run 4 Handler Commit operations",
    "Traceback (most recent call last):",
    '  File "orbax/checkpoint/async_checkpointer.py", line 119, in _background_wait',
    "TimeoutError: Timed out while waiting for async_write_complete barrier.",
    "*** Check failure stack trace: ***",
    "    @     0x7fc3af440634  absl::log_internal::LogMessage::SendToLog()",
]
LEADER_GONE = [
    "W1201 12:14:22.380099   21197 preemption_sync_manager.cc:147] Failed to retrieve "
    "preemption notice from coordination service: UNAVAILABLE: Socket closed",
    "F1201 12:14:22.380196   21197 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send "
    "RPC to coordination service. Either the leader task was preempted/died/restarted",
    "*** Check failure stack trace: ***",
]


def job(tmp_path, pid=0):
    return supervise.Job(
        process_id=pid,
        num_processes=2,
        coordinator="127.0.0.1:5000",
        heartbeat_timeout_s=5,
        out_dir=tmp_path / "run",
    )


def test_stderr_filter_passes_lines_and_holds_runtime_noise():
    clock, shown = Clock(), []
    f = supervise.StderrFilter(write=shown.append, clock=clock, hold_s=5)
    f.feed("a warning from Python\n")
    assert shown == ["a warning from Python\n"]
    f.feed("W1201 12:00:00.000001   1 file.cc:1] a C++ warning\n")
    f.feed("its second line\n")
    f.feed("error: process 0 of 2: the trainer's own line\n")  # waits behind the noise (order)
    assert len(shown) == 1
    clock.t += 5
    f.tick()
    assert shown[1:] == [
        "W1201 12:00:00.000001   1 file.cc:1] a C++ warning\n",
        "its second line\n",
        "error: process 0 of 2: the trainer's own line\n",
    ]
    assert f.said_error and not f.fatal_seen


def test_fatal_record_is_never_shown_and_names_the_peer(tmp_path, capsys):
    clock, shown = Clock(), []
    f = supervise.StderrFilter(write=shown.append, clock=clock)
    for line in HEARTBEATS:
        f.feed(line + "\n")
    clock.t += 100
    f.tick()
    assert shown == [] and f.fatal_seen
    assert supervise.outcome(-6, f, job(tmp_path)) == exits.EXIT_DISTRIBUTED
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: process 0 of 2: peer process 1 stopped sending heartbeats"
    ), err
    assert "heartbeat_timeout_s=5" in err[0] and "(SIGABRT)" in err[0]
    log = (tmp_path / "run" / "logs" / "process-0.stderr.log").read_text()
    assert str(tmp_path / "run" / "logs" / "process-0.stderr.log") in err[0]
    assert "Check failure" in log and "Traceback" in log


def test_lost_coordinator_and_plain_signals_are_one_line(tmp_path):
    line = supervise.describe(LEADER_GONE[1:], 6, job(tmp_path, pid=1))
    assert line.startswith("error: process 1 of 2: lost the JAX coordinator (process 0 at 127.0.0.1:5000)")
    frozen = [
        "F1201 12:21:30.000001   1 client.h:80] Terminating process because ... absl::Status: "
        "DEADLINE_EXCEEDED: Deadline Exceeded",
        "RPC: /xla.coordination.CoordinationService/Heartbeat",
    ]
    line = supervise.describe(frozen, 6, job(tmp_path, pid=1))
    assert "coordinator (process 0 at 127.0.0.1:5000) stopped answering heartbeats" in line
    line = supervise.describe([], 11, job(tmp_path, pid=1))
    assert "died of SIGSEGV" in line and "\n" not in line


@pytest.mark.parametrize("code", [0, 1, 2, 3, 5])
def test_child_exit_codes_pass_through(tmp_path, code, capsys):
    f = supervise.StderrFilter(write=lambda line: print(line, end="", file=sys.stderr))
    f.feed("W1201 12:00:00.000001   1 file.cc:1] held\n")
    assert supervise.outcome(code, f, job(tmp_path)) == code
    assert "held" in capsys.readouterr().err  # shown at the end of a run that did not fail


def test_child_exit_4_keeps_its_own_line(tmp_path, capsys):
    f = supervise.StderrFilter()
    f.feed("E1201 12:00:00.000001   1 pair.cc:1] gloo noise\n")
    f.feed("error: process 1 of 2: a collective with the other processes failed\n")
    assert supervise.outcome(4, f, job(tmp_path, pid=1)) == 4
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: process 1 of 2: a collective"), err


SUPERVISOR = """
import sys
from pathlib import Path
from moe_train.train import signals
from moe_train.train import supervise

signals.STOP.install()
job = supervise.Job(process_id=1, num_processes=2, coordinator="127.0.0.1:5000",
                    heartbeat_timeout_s=5, out_dir=Path(sys.argv[1]))
print("up", flush=True)
sys.exit(supervise.run([], job, command=[sys.executable, "-c", sys.argv[2]]))
"""
CHILDREN = {
    "abort": """
import os, sys
print("training", flush=True)
print("F1201 12:00:00.000001   1 client.h:80] Terminating process because the JAX distributed "
      "service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC to "
      "coordination service. Either the leader task was preempted/died/restarted", file=sys.stderr)
print("*** Check failure stack trace: ***", file=sys.stderr, flush=True)
os.abort()
""",
    "stop": """
import signal, sys, time
from moe_train.train import supervise
time.sleep(1.0)  # a forwarded signal waits (blocked) until the handler is there
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
supervise.child_ready()
deadline = time.monotonic() + 20
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
print("stopped" if got else "no signal", flush=True)
sys.exit(0 if got else 7)
""",
    "forever": """
import os, time
from moe_train.train import supervise
supervise.child_ready()
print("child", os.getpid(), flush=True)
time.sleep(600)
""",
}


def supervised(tmp_path, child: str):
    out = open(tmp_path / "sup.out", "w")
    return subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path / "run"), CHILDREN[child]],
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def wait_for(path, needle, timeout=30):
    deadline = time.monotonic() + timeout
    while needle not in path.read_text():
        assert time.monotonic() < deadline, path.read_text()
        time.sleep(0.05)
    return path.read_text()


def test_supervisor_turns_an_abort_into_exit_4_and_one_line(tmp_path):
    p = supervised(tmp_path, "abort")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 4, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: process 1 of 2: lost the JAX coordinator")
    assert "(SIGABRT)" in lines[0] and "Check failure" not in err
    assert "training" in (tmp_path / "sup.out").read_text()  # stdout passed through


def test_supervisor_forwards_sigterm_even_before_the_child_is_ready(tmp_path):
    p = supervised(tmp_path, "stop")
    wait_for(tmp_path / "sup.out", "up")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "stopped" in (tmp_path / "sup.out").read_text()


def test_child_dies_with_its_supervisor(tmp_path):
    p = supervised(tmp_path, "forever")
    try:
        text = wait_for(tmp_path / "sup.out", "child ")
        pid = int(text.split("child ", 1)[1].split()[0])
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            try:  # reaped by init; a zombie still answers kill(0) briefly
                if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the trainer outlived its supervisor")
    finally:
        if p.poll() is None:
            p.kill()
