"""How a run decides single / explicit / Slurm, and the step watchdog (no processes started)."""

import pytest

from moe_train import cli, distributed
from moe_train.config import ConfigError, ParallelConfig

SLURM_STEP = {"SLURM_JOB_ID": "1234", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_NTASKS": "4",
              "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}


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
    source, kw = distributed.plan(P(coordinator="10.0.0.1:1234", num_processes=2, process_id=1,
                                    init_timeout_s=30, heartbeat_timeout_s=15), {})
    assert source == "explicit"
    assert kw["coordinator_address"] == "10.0.0.1:1234"
    assert (kw["num_processes"], kw["process_id"]) == (2, 1)
    assert kw["cluster_detection_method"] == "deactivate"  # no Slurm device restriction
    assert kw["heartbeat_timeout_seconds"] == 15
    assert kw["initialization_timeout"] >= 30  # our own guard fires at exactly 30 s
    assert kw["shutdown_timeout_seconds"] == distributed.watchdog_timeout_s(P(heartbeat_timeout_s=15))


@pytest.mark.parametrize("kw, needles", [
    (dict(), ["parallel.num_processes", "parallel.process_id"]),
    (dict(num_processes=2), ["parallel.process_id"]),
    (dict(process_id=0), ["parallel.num_processes"]),
])
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
    source, kw = distributed.plan(P(coordinator="10.0.0.9:7000", num_processes=2, process_id=0),
                                  SLURM_STEP)
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
    args = cli.parser().parse_args(["--out", str(tmp_path), "--coordinator", "127.0.0.1:999",
                                    "--num-processes", "2", "--process-id", "1", "--devices", "2"])
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

    gloo = JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error "
                           "[127.0.0.1]:17095: Connection reset by peer")
    line = distributed.peer_failure(gloo)
    assert line and "peer died" in line and "Connection reset by peer" in line and "\n" not in line
    assert distributed.peer_failure(JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")) is None
    assert distributed.peer_failure(ValueError("gloo")) is None
