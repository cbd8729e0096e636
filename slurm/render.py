"""Render a ``JobSpec`` into submitit's Slurm executor: the exact sbatch script and srun line.

The script is submitit's own (``SlurmExecutor._make_submission_file_text``), so what
``--dry-run`` prints is what ``sbatch`` gets. On top of submitit's defaults (one
``srun --unbuffered`` step running ``python -u -m submitit.core._submit <folder>`` per task,
per-rank logs ``<folder>/%j_%t_log.{out,err}``, ``--signal=USR2@<s>``), the launcher adds:

* ``setup``: ``set -euo pipefail``; the preset's environment as ``export`` lines (values
  shell-quoted, each with its source as a comment); on container presets one
  ``srun --ntasks-per-node=1 --container-image=... --container-name=... true`` step that
  imports the image once per node; the smoke job's preflight step; then ``set +e`` so the
  training step's status reaches the teardown;
* ``srun_args``: Pyxis flags (``--container-image``, ``--container-name``,
  ``--container-mounts`` with the run directory, ``--container-workdir``,
  ``--no-container-mount-home``, ``--container-env`` for the preset's variables, which
  must win over the image's) and ``--kill-on-bad-exit=1`` (one failed rank ends the step);
* ``teardown``: a training step that lost its peers or stopped progressing (exit 4: the
  trainer's step watchdog) is requeued, at most ``max_requeues`` times; the job then ends
  with the step's status;
* ``--segment``, ``--requeue``, ``--chdir`` (host runs) as additional sbatch parameters.

Every value that reaches the script is either validated by ``slurm.plan`` or quoted here
(submitit quotes ``#SBATCH`` values and srun arguments with ``shlex.quote``).
"""

from __future__ import annotations

import shlex
from typing import Any

from submitit.slurm.slurm import SlurmExecutor

from slurm.plan import JobSpec

WATCHDOG_EXIT = 4  # moe_train.train.distributed.EXIT_DISTRIBUTED: lost peers / no step progress


class RenderOnlyExecutor(SlurmExecutor):
    """submitit's SlurmExecutor without the "is srun installed" check: renders, never submits."""

    @classmethod
    def affinity(cls) -> int:
        return 1

    def _submit_command(self, command: str):  # pragma: no cover - guarded
        raise RuntimeError("RenderOnlyExecutor cannot submit jobs")


def _env_lines(spec: JobSpec) -> list[str]:
    lines = []
    for name, value, source in spec.env:
        lines.append(f"# {name}: {' '.join(source.split())}")
        lines.append(f"export {name}={shlex.quote(value)}")
    return lines


def image_load_command(spec: JobSpec) -> str:
    """The setup step that imports the image once per node under its container name."""
    c = spec.container
    assert c is not None
    return shlex.join(
        [
            "srun",
            f"--nodes={spec.nodes}",
            f"--ntasks={spec.nodes}",
            "--ntasks-per-node=1",
            f"--container-image={c.image}",
            f"--container-name={c.name}",
            "true",
        ]
    )


def preflight_command(spec: JobSpec) -> str:
    """The smoke job's preflight, once per node inside the already imported container."""
    c = spec.container
    assert c is not None and spec.preflight
    return " ".join(
        [
            shlex.join(
                [
                    "srun",
                    f"--nodes={spec.nodes}",
                    f"--ntasks={spec.nodes}",
                    "--ntasks-per-node=1",
                    f"--container-name={c.name}",
                    f"--container-workdir={c.workdir}",
                    "--no-container-mount-home",
                ]
            ),
            spec.preflight,
        ]
    )


def setup_lines(spec: JobSpec) -> list[str]:
    lines = ["set -euo pipefail", *_env_lines(spec)]
    if spec.container is not None:
        lines += [
            "# import the image once per node; the training step reuses it by name",
            image_load_command(spec),
        ]
        if spec.preflight:
            lines += [
                "# smoke job: check GPUs, NCCL and the container before training",
                preflight_command(spec),
            ]
    lines += ["set +e  # the training step's exit status is handled in the teardown"]
    return lines


def teardown_lines(spec: JobSpec) -> list[str]:
    n = spec.max_requeues
    return [
        "rc=$?",
        f'if [ "$rc" -eq {WATCHDOG_EXIT} ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {n} ]; then',
        f'  echo "moe-train: the training step lost a peer or stopped progressing (exit {WATCHDOG_EXIT});'
        f' requeueing (restart $((${{SLURM_RESTART_COUNT:-0}} + 1)) of {n})" >&2',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$rc"',
    ]


def srun_args(spec: JobSpec) -> list[str]:
    args = ["--kill-on-bad-exit=1"]
    c = spec.container
    if c is not None:
        args += [
            f"--container-image={c.image}",
            f"--container-name={c.name}",
            f"--container-mounts={','.join(c.mounts)}",
            f"--container-workdir={c.workdir}",
            "--no-container-mount-home",
        ]
        if c.env_names:
            args.append(f"--container-env={','.join(c.env_names)}")
    return args


def executor_parameters(spec: JobSpec) -> dict[str, Any]:
    """Keyword arguments for ``SlurmExecutor.update_parameters``."""
    extra: dict[str, Any] = {"requeue": True}
    if spec.segment is not None:
        extra["segment"] = spec.segment
    if spec.chdir:
        extra["chdir"] = spec.chdir
    params: dict[str, Any] = dict(
        job_name=spec.job_name,
        nodes=spec.nodes,
        ntasks_per_node=spec.ntasks_per_node,
        time=spec.time_min,
        signal_delay_s=spec.signal_delay_s,
        exclusive=spec.exclusive or None,
        setup=setup_lines(spec),
        teardown=teardown_lines(spec),
        srun_args=srun_args(spec),
        additional_parameters=extra,
    )
    if spec.gpus_per_node is not None:
        params["gpus_per_node"] = spec.gpus_per_node
    for key in ("partition", "account", "qos"):
        if getattr(spec, key):
            params[key] = getattr(spec, key)
    return {k: v for k, v in params.items() if v is not None}


def configure(executor: SlurmExecutor, spec: JobSpec) -> SlurmExecutor:
    executor.update_parameters(**executor_parameters(spec))
    return executor


def render_script(spec: JobSpec) -> str:
    """The exact sbatch script submitit would write for ``spec``."""
    ex = configure(
        RenderOnlyExecutor(spec.submitit_folder, max_num_timeout=spec.max_requeues, python=spec.python), spec
    )
    return ex._make_submission_file_text(ex._submitit_command_str, uid="")


def srun_command(script: str) -> str:
    """The training step's srun line of a rendered script."""
    lines = [ln for ln in script.splitlines() if ln.startswith("srun ") and "submitit" in ln]
    return lines[-1] if lines else ""


def trainer_command(spec: JobSpec) -> str:
    """What each task runs in-process (for humans; the task itself is pickled, not shell)."""
    return shlex.join(["python", "-m", "moe_train", *spec.trainer_args])
