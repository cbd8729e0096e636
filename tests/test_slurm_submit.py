"""``python -m slurm.submit`` against the real local Slurm (`bash slurm/local_cluster.sh start`).

The ``slurm`` tests are skipped, with the reason, where Slurm is not installed or the local
cluster is not running. Each submits the cpu-local preset (2 tasks x 4 fake CPU devices, EP 8
over both processes) with the tiny model and checks what the job wrote, not only its state.
The last test runs the same job without Slurm (submitit's local executor), as on a laptop.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import losses

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
JOB_TIMEOUT_S = 900  # two processes compiling on a 2-core runner take a few minutes
JOB = ["--preset", "cpu-local", "--model", "tiny", "--nodes", "1", "--ep", "8"]


def submit(out: Path, *extra: str, wait: bool = True, timeout: float = JOB_TIMEOUT_S):
    """Run the launcher; (exit code, stdout, stderr)."""
    cmd = [sys.executable, "-m", "slurm.submit", *JOB, "--steps", str(STEPS), "--time", "00:20:00"]
    cmd += ["--out", str(out), *extra, *(["--wait"] if wait else [])]
    env = {k: v for k, v in os.environ.items() if k != "MOE_TRAIN_SITE"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def job_id_of(stdout: str) -> str:
    m = re.search(r"^job (\d+)$", stdout, re.MULTILINE)
    assert m, f"no 'job <id>' line in: {stdout!r}"
    return m.group(1)


def sacct(job_id: str, fields: str = "State,ExitCode,JobName") -> list[str]:
    r = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", fields], capture_output=True, text=True, timeout=30
    )
    lines = r.stdout.strip().splitlines()
    assert lines, f"sacct knows no job {job_id}: {r.stderr.strip()}"
    return lines[-1].split("|")


def rank0_log(run_dir: Path, job_id: str) -> Path:
    return run_dir / "slurm" / f"{job_id}_0_log.out"


def wait_for_line(path: Path, pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text(errors="replace"), re.MULTILINE):
            return
        time.sleep(1)
    pytest.fail(f"{pattern!r} did not appear in {path} within {timeout} s")


def release_when_requeued(job_id: str, timeout: float) -> None:
    """Slurm holds a requeued job ~2 minutes (BeginTime); start it now to keep the test short."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True, timeout=30
        )
        if r.stdout.split()[:2] == ["PENDING", "BeginTime"]:
            # slurmd refuses a launch whose credential is not newer, in whole seconds, than
            # the requeue's revocation ("Job credential revoked"): start it in a later second
            time.sleep(2)
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)
            return
        time.sleep(1)
    pytest.fail(f"job {job_id} was not requeued within {timeout} s of SIGUSR2")


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory):
    """One complete cpu-local/tiny job with a hostile job name; (run dir, job id, marker, out)."""
    run_dir = tmp_path_factory.mktemp("launch") / "run"
    marker = run_dir.parent / "pwned"
    code, out, err = submit(run_dir, "--job-name", f"x; touch {marker}")
    assert code == 0, f"launcher exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    return run_dir, job_id_of(out), marker, out


@pytest.mark.slurm
def test_two_tasks_complete_with_metrics_and_checkpoint(uninterrupted):
    run_dir, job_id, marker, out = uninterrupted
    assert f"OUT={run_dir}" in out
    assert "mode: slurm" in out
    assert "2 process(es)" in out  # rank 0's progress, streamed by --wait
    assert f"step {STEPS}/{STEPS}" in out and "'expert': 8" in out  # EP 8 over both processes
    state, exit_code, name = sacct(job_id)
    assert (state, exit_code) == ("COMPLETED", "0:0")
    assert name == f"x; touch {marker}" and not marker.exists()
    assert len(losses(run_dir)) == STEPS
    assert (run_dir / "checkpoints" / str(STEPS)).is_dir()
    for rank in (0, 1):  # one log per rank; both processes ran the trainer
        assert (run_dir / "slurm" / f"{job_id}_{rank}_log.out").exists()


def _task_pid(job_id: str, rank: int) -> int | None:
    """The submitit worker of ``rank`` in ``job_id`` (found through /proc environ)."""
    for env_file in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = env_file.read_bytes().split(b"\0")
            cmd = (env_file.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if (
            f"SLURM_JOB_ID={job_id}".encode() in env
            and f"SLURM_PROCID={rank}".encode() in env
            and b"submitit.core._submit" in cmd
        ):
            return int(env_file.parent.name)
    return None


@pytest.mark.slurm
@pytest.mark.slow
def test_usr2_checkpoints_requeues_and_resumes_bitwise(uninterrupted, tmp_path):
    ref_dir = uninterrupted[0]
    run_dir = tmp_path / "run"
    code, out, err = submit(run_dir, wait=False, timeout=120)
    assert code == 0, err
    job_id = job_id_of(out)
    try:
        wait_for_line(rank0_log(run_dir, job_id), r"^step +3/", JOB_TIMEOUT_S)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        release_when_requeued(job_id, timeout=300)
        from slurm import follow

        code = follow.follow(
            job_id, run_dir / "slurm", out=sys.stdout, err=sys.stderr, timeout_s=JOB_TIMEOUT_S
        )
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    log = rank0_log(run_dir, job_id).read_text()
    assert code == 0, log[-3000:]
    assert "stopped by signal SIGUSR2" in log and "resumed from" in log
    r = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job_id],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.stdout.split() == ["REQUEUED", "COMPLETED"]  # requeued once, then finished
    assert losses(run_dir)[-1] == losses(ref_dir)[-1]  # resumed run == uninterrupted run


@pytest.mark.slurm
@pytest.mark.slow
def test_crashed_rank_fails_the_job_promptly_and_is_named(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = submit(run_dir, "--steps", "400", wait=False, timeout=120)
    assert code == 0, err
    job_id = job_id_of(out)
    try:
        wait_for_line(rank0_log(run_dir, job_id), r"^step +3/", JOB_TIMEOUT_S)
        pid = _task_pid(job_id, 1)
        assert pid, "rank 1's process not found"
        os.kill(pid, signal.SIGKILL)  # this test's own job's process
        killed = time.monotonic()
        from slurm import follow

        buf_err = io.StringIO()
        code = follow.follow(job_id, run_dir / "slurm", out=sys.stdout, err=buf_err, timeout_s=300)
        took = time.monotonic() - killed
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert code != 0
    assert took < 60, f"the job took {took:.0f} s to fail after rank 1 died"
    msg = buf_err.getvalue()
    # the killed rank is named, or the first rank to fail says its peer died (whichever Slurm
    # records first)
    assert "ended FAILED" in msg and ("rank 1" in msg or "peer died" in msg), msg


NO_SBATCH = """
import shutil, sys
real = shutil.which
shutil.which = lambda name, *a, **k: None if name == "sbatch" else real(name, *a, **k)
from slurm.submit import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_without_slurm_runs_through_the_local_executor(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-c", NO_SBATCH, *JOB, "--steps", "4", "--out", str(run_dir), "--wait"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mode: local (no sbatch on PATH)" in proc.stdout
    assert "2 process(es)" in proc.stdout and "step 4/4" in proc.stdout
    assert len(losses(run_dir)) == 4 and (run_dir / "checkpoints" / "4").is_dir()


DRY = ["--preset", "cpu-local", "--model", "tiny", "--nodes", "1", "--dry-run"]


def _submit_main(capsys, *extra: str) -> tuple[int, str, str]:
    from slurm.submit import main

    code = main([*DRY, *extra])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_ep_and_set_disagreeing_is_one_error_naming_both(capsys):
    code, _, err = _submit_main(capsys, "--ep", "8", "--set", "parallel.ep=4")
    assert (code, err) == (2, "error: --ep 8 and --set parallel.ep=4 disagree; give one\n")


def test_set_twice_disagreeing_is_one_error(capsys):
    code, _, err = _submit_main(capsys, "--set", "parallel.ep=8", "--set", "parallel.ep=4")
    assert (code, err) == (2, "error: --set parallel.ep=8 and --set parallel.ep=4 disagree; give one\n")


def test_steps_and_set_disagreeing_is_one_error(capsys):
    code, _, err = _submit_main(capsys, "--steps", "5", "--set", "train.steps=6")
    assert (code, err) == (2, "error: --steps 5 and --set train.steps=6 disagree; give one\n")


def test_ep_and_set_agreeing_is_fine(capsys):
    code, out, _ = _submit_main(capsys, "--ep", "4", "--set", "parallel.ep=4")
    assert code == 0 and "--set parallel.ep=4" in out


def test_set_alone_gives_the_ep(capsys):
    code, out, _ = _submit_main(capsys, "--set", "parallel.ep=4")
    assert code == 0 and "--set parallel.ep=4" in out and "parallel.ep=8" not in out
