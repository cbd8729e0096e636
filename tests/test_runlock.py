"""moe_train.train.runlock: one trainer per run directory, checked with real processes."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moe_train.base.exits import OutputError
from moe_train.config import ConfigError
from moe_train.train import runlock

ROOT = Path(__file__).resolve().parents[1]

# A trainer stand-in: takes the lock, prints {"acquired": pid} or {"locked": message}, then
# (with "hold") waits for "release" on stdin, releases and prints "released".
CHILD = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from moe_train.train import runlock
    try:
        lock = runlock.acquire(Path(sys.argv[1]))
    except runlock.RunDirLocked as err:
        print(json.dumps({"locked": str(err)}), flush=True)
        sys.exit(3)
    print(json.dumps({"acquired": os.getpid(), "previous": lock.previous}), flush=True)
    if sys.argv[2] == "hold":
        sys.stdin.readline()
        lock.release()
        print("released", flush=True)
""")


def _env(**extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SLURM_JOB_ID", None)
    env.pop("SLURM_STEP_ID", None)
    env.update(extra)
    return env


def _try(out: Path, **env) -> dict:
    """A short-lived process that takes the lock and exits (releasing it by exiting)."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(out), "once"],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode in (0, 3), proc.stderr
    return json.loads(proc.stdout.splitlines()[0])


@pytest.fixture
def holder(tmp_path):
    """Start a process holding ``tmp_path/run``; yields (process, its first output line)."""
    procs = []

    def start(out: Path, **env):
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(out), "hold"],
            env=_env(**env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline())
        assert "acquired" in line, line
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def test_second_process_gets_run_dir_locked_naming_holder_pid(tmp_path, holder):
    proc = holder(tmp_path / "run")
    with pytest.raises(runlock.RunDirLocked, match=rf"in use by pid {proc.pid} on host "):
        runlock.acquire(tmp_path / "run")


def test_run_dir_locked_is_a_one_line_config_error(tmp_path, holder):
    holder(tmp_path / "run", SLURM_JOB_ID="4242", SLURM_STEP_ID="0")
    with pytest.raises(ConfigError) as info:
        runlock.acquire(tmp_path / "run")
    msg = str(info.value)
    assert "\n" not in msg
    assert f"run directory {tmp_path / 'run'} is in use by" in msg
    assert "(Slurm job 4242 step 0) since " in msg
    assert msg.endswith("wait for it, stop it, or use another --out")


def test_lock_of_sigkilled_holder_is_taken_over(tmp_path, holder):
    proc = holder(tmp_path / "run")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    with runlock.acquire(tmp_path / "run") as lock:
        assert lock.held and lock.enforced


def test_takeover_reports_the_crashed_holder(tmp_path, holder):
    proc = holder(tmp_path / "run")
    proc.kill()
    proc.wait(timeout=30)
    with runlock.acquire(tmp_path / "run") as lock:
        assert lock.previous is not None and lock.previous["pid"] == proc.pid and lock.previous_crashed


def test_release_in_holder_lets_another_process_take_it(tmp_path, holder):
    proc = holder(tmp_path / "run")
    proc.stdin.write("release\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "released"
    with runlock.acquire(tmp_path / "run") as lock:
        assert lock.held and not lock.previous_crashed


def test_release_here_lets_another_process_take_it(tmp_path):
    lock = runlock.acquire(tmp_path / "run")
    assert "locked" in _try(tmp_path / "run")
    lock.release()
    assert _try(tmp_path / "run")["acquired"]


def test_release_is_idempotent_and_keeps_the_file(tmp_path):
    lock = runlock.acquire(tmp_path / "run")
    lock.release()
    lock.release()
    assert not lock.held and (tmp_path / "run" / "run.lock").is_file()


def test_context_manager_releases(tmp_path):
    with runlock.acquire(tmp_path / "run") as lock:
        pass
    assert not lock.held
    with runlock.acquire(tmp_path / "run") as again:
        assert again.held


def test_same_process_cannot_take_its_own_directory_twice(tmp_path):
    with runlock.acquire(tmp_path / "run"):
        with pytest.raises(runlock.RunDirLocked, match="this process already holds it"):
            runlock.acquire(tmp_path / "run" / ".." / "run")
        assert "locked" in _try(tmp_path / "run")  # the refused attempt did not drop the lock


def test_read_holder_in_the_holding_process_keeps_the_lock(tmp_path):
    with runlock.acquire(tmp_path / "run") as lock:
        holder = runlock.read_holder(tmp_path / "run")
        assert holder is not None and holder["pid"] == os.getpid()
        assert "locked" in _try(tmp_path / "run")
    assert lock.previous is None


def test_holder_info_written(tmp_path, holder):
    proc = holder(tmp_path / "run", SLURM_JOB_ID="777", SLURM_STEP_ID="3")
    record = json.loads((tmp_path / "run" / "run.lock").read_text())  # another process: safe
    assert record["pid"] == proc.pid
    assert record["host"] and record["started_at"].endswith("+00:00")
    assert (record["slurm_job_id"], record["slurm_step_id"]) == ("777", "3")
    assert "from moe_train.train import runlock" in record["command"]


def test_creates_missing_out_dir(tmp_path):
    with runlock.acquire(tmp_path / "a" / "b"):
        assert (tmp_path / "a" / "b" / "run.lock").is_file()


def test_regular_file_at_out_dir_raises_output_error(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(OutputError, match=rf"{tmp_path / 'run'}: .*File exists"):
        runlock.acquire(tmp_path / "run")


def test_out_dir_under_a_regular_file_raises_output_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="ENOTDIR"):
        runlock.acquire(tmp_path / "file" / "run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_raises_output_error(tmp_path):
    (tmp_path / "run").mkdir(mode=0o555)
    try:
        with pytest.raises(OutputError, match=rf"{tmp_path / 'run' / 'run.lock'}: .*EACCES"):
            runlock.acquire(tmp_path / "run")
    finally:
        (tmp_path / "run").chmod(0o755)


def test_file_system_without_locks_warns_instead_of_failing(tmp_path, monkeypatch):
    def no_locks(fd, cmd, *args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(runlock.fcntl, "lockf", no_locks)  # no such file system here to test on
    lock = runlock.acquire(tmp_path / "run")
    assert not lock.enforced and not lock.held and lock.warning is not None
    assert lock.warning.startswith(
        f"file system of {tmp_path / 'run'} does not support locks "
        "(Lustre without -o flock?); one trainer per directory is "
        "not enforced"
    )


def test_forked_child_neither_holds_nor_drops_the_parents_lock(tmp_path):
    with runlock.acquire(tmp_path / "run") as lock:
        pid = os.fork()
        if pid == 0:  # child: sees the lock as not its own, its release must not unlock
            ok = not lock.held
            lock.release()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert "locked" in _try(tmp_path / "run")
        assert "released_at" not in json.loads((tmp_path / "run" / "run.lock").read_text())
