"""Integration tests against the real single-node Slurm started by `slurm/local_cluster.sh start`.

Skipped (with the reason) where Slurm is not installed or the local cluster is not running;
CI starts it before the tests. Every wait is bounded. Jobs are checked by what they wrote, never
only by exit codes: a misconfigured Slurm can report COMPLETED for a job that never ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTITION = "debug"

# slurm_cluster (conftest.py): skip unless the local cluster answers and its node can run jobs
pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def _name(tag: str) -> str:
    return f"slurmci-{tag}-{uuid.uuid4().hex[:8]}"


def _scancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


def _sbatch(script: Path, tag: str, *args: str, wait: bool, timeout: float) -> tuple[str, int]:
    """Submit `script` as job `tag` (its log: batch.out beside it); with wait, block until the
    job ends. Returns (job id, sbatch's exit code)."""
    cmd = ["sbatch", "--parsable", f"--partition={PARTITION}", "--time=3", f"--chdir={script.parent}", *args]
    cmd += [f"--job-name={_name(tag)}", f"--output={script.parent}/batch.out"]
    if wait:
        cmd.append("--wait")
    proc = subprocess.Popen([*cmd, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        job_id = out.strip().split(";")[0]
        if job_id:
            _scancel(job_id)
        pytest.fail(
            f"sbatch {'--wait ' if wait else ''}did not return within {timeout} s "
            f"(job {job_id or '?'} cancelled); stderr: {err.strip()}"
        )
    job_id = out.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch printed no job id: stdout={out!r} stderr={err!r}"
    return job_id, proc.returncode


def _sacct(job_id: str) -> tuple[str, str]:
    r = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    line = r.stdout.strip().splitlines()[0] if r.stdout.strip() else "|"
    state, _, exit_code = line.partition("|")
    return state.split()[0] if state else "", exit_code


def _submitit_executor(folder: Path, **params):
    submitit = pytest.importorskip("submitit")
    import cloudpickle

    # the job process cannot import this test module by name: ship its functions by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(
        slurm_partition=PARTITION, timeout_min=3, nodes=1, cpus_per_task=1, slurm_signal_delay_s=10, **params
    )
    return executor


def _wait_done(job, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel(check=False)
            pytest.fail(
                f"submitit job {job.job_id} not done within {timeout} s (state {job.state}); cancelled"
            )
        time.sleep(0.5)


def test_sbatch_two_tasks_write_their_rank(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nset -eu\nsrun --output=task-%t.out bash -c 'echo \"$SLURM_PROCID\"'\n")
    job_id, rc = _sbatch(script, "ranks", "--ntasks=2", "--overcommit", wait=True, timeout=90)
    batch_log = (tmp_path / "batch.out").read_text() if (tmp_path / "batch.out").exists() else ""
    assert rc == 0, f"job {job_id} failed (sbatch --wait exit {rc}); batch log:\n{batch_log}"
    for rank in (0, 1):
        out = tmp_path / f"task-{rank}.out"
        assert out.exists(), f"job {job_id}: task {rank} wrote nothing; batch log:\n{batch_log}"
        assert out.read_text().strip() == str(rank)


def _add(a, b):
    return a + b


def test_submitit_returns_result(tmp_path):
    executor = _submitit_executor(tmp_path, tasks_per_node=1, name=_name("add"))
    job = executor.submit(_add, 2, 2)
    _wait_done(job, timeout=90)
    assert job.result() == 4


def _jax_allgather_process_index():
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jax.experimental import multihost_utils

    # no arguments: JAX finds the coordinator, process count and index from Slurm's variables
    jax.distributed.initialize(initialization_timeout=60)
    try:
        gathered = multihost_utils.process_allgather(jax.numpy.int32(jax.process_index()))
        return {
            "index": jax.process_index(),
            "count": jax.process_count(),
            "gathered": [int(x) for x in gathered],
        }
    finally:
        jax.distributed.shutdown()


def test_jax_distributed_two_processes(tmp_path):
    executor = _submitit_executor(
        tmp_path, tasks_per_node=2, name=_name("jax"), slurm_additional_parameters={"overcommit": True}
    )
    job = executor.submit(_jax_allgather_process_index)
    _wait_done(job, timeout=150)
    results = job.results()
    assert sorted(r["index"] for r in results) == [0, 1]
    for r in results:
        assert r["count"] == 2
        assert r["gathered"] == [0, 1]


def test_sigkilled_job_is_failed_in_sacct(tmp_path):
    script = tmp_path / "die.sh"
    script.write_text("#!/bin/bash\necho started > started.txt\nkill -KILL $$\n")
    job_id, rc = _sbatch(script, "kill", "--ntasks=1", wait=False, timeout=30)
    assert rc == 0
    deadline = time.monotonic() + 60
    state = exit_code = ""
    while time.monotonic() < deadline:
        state, exit_code = _sacct(job_id)
        if state and state not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"):
            break
        time.sleep(0.5)
    else:
        _scancel(job_id)
        pytest.fail(f"job {job_id} not finished in sacct within 60 s (last state {state!r})")
    assert (tmp_path / "started.txt").exists(), f"job {job_id} never ran"
    assert state == "FAILED", f"job {job_id}: sacct says {state} {exit_code}"
    assert exit_code == "0:9", f"job {job_id}: expected signal 9, sacct exit code {exit_code}"


def _sigkill_self():
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_submitit_sees_sigkilled_job_fail(tmp_path):
    """Without accounting this job stays UNKNOWN and result() waits for ever."""
    submitit = pytest.importorskip("submitit")
    executor = _submitit_executor(tmp_path, tasks_per_node=1, name=_name("sigkill"))
    job = executor.submit(_sigkill_self)
    _wait_done(job, timeout=90)
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        job.result()
    assert _sacct(job.job_id)[0] == "FAILED"
