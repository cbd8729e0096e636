"""What each Slurm task runs: the trainer, in-process, inside submitit's worker.

submitit starts ``python -u -m submitit.core._submit <folder>`` once per task (one per GPU);
the worker unpickles a ``TrainTask`` and calls it. Running the trainer in the same process
(``moe_train.train.cli.main``) keeps submitit's signal handling and requeue working:

1. Before the call, submitit installs its USR2 handler (checkpoint + ``scontrol requeue``).
2. While training, the trainer's own handler takes USR2/SIGTERM: every process finishes the
   same step, saves a checkpoint, and ``main`` returns 0. The trainer then restores
   submitit's handler.
3. Back here, a run that returned 0 before its last step was stopped early (preempted, or
   warned before the time limit): the task hands the signal to submitit's handler, which on
   rank 0 calls ``checkpoint()`` (bounded by ``max_requeues``), requeues the job and exits;
   the requeued job resumes from the trainer's checkpoint in the run directory.

With several tasks, ``cli.main`` itself runs the trainer in a supervised child process
(``moe_train.train.supervise``: a peer failure becomes exit 4 and one line). It forwards the stop
signals to the child and gives submitit's handlers back before it returns, so step 3 holds.

A signal that arrives before ``cli.main`` goes straight to submitit's handler (requeue at
once); one during the trainer's start-up ends it with 0 before its first step, and step 3
requeues: nothing is lost either way. A trainer exit code other than 0 ends the task with
that code (2 config, 3 diverged, 4 lost peers, 5 unwritable run directory) so the job fails
and ``--wait`` can say which rank.
Under submitit's local executor (no Slurm), the task passes the coordinator explicitly.

The class is pickled by value (``cloudpickle.register_pickle_by_value``), so the image needs
``moe_train`` and ``submitit`` but not this module.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from submitit.helpers import Checkpointable, DelayedSubmission

from moe_train.planner.memory import trainer as memory
from moe_train.train import cli


def latest_checkpoint(run_dir: Path) -> int | None:
    """The highest finished checkpoint step in ``run_dir/checkpoints`` (orbax step dirs)."""
    steps = [int(p.name) for p in (Path(run_dir) / "checkpoints").glob("*") if p.name.isdigit()]
    return max(steps, default=None)


class TrainTask(Checkpointable):
    """One trainer process of the job; requeued (bounded) when stopped before its last step."""

    def __init__(
        self,
        trainer_args: tuple[str, ...],
        run_dir: str,
        steps: int,
        max_requeues: int,
        local_port: int = 0,
        requeues: int = 0,
    ) -> None:
        self.trainer_args = tuple(trainer_args)  # python -m moe_train arguments
        self.run_dir = run_dir  # the run directory (shared by every node)
        self.steps = steps  # total steps: a clean exit before this one means "stopped early"
        self.max_requeues = max_requeues  # requeues allowed (preemption and timeouts together)
        self.local_port = local_port  # coordinator port under the local executor; 0 on Slurm
        self.requeues = requeues  # requeues so far (submitit side)

    def __call__(self) -> int:
        argv = list(self.trainer_args) + self._local_process_args()
        code = cli.main(argv, memory=memory)
        rank = _rank()
        if code != 0:
            print(f"error: rank {rank}: trainer exited with code {code}", file=sys.stderr, flush=True)
            sys.exit(code)
        done = latest_checkpoint(Path(self.run_dir))
        if done is not None and done >= self.steps:
            return 0
        print(
            f"rank {rank}: stopped at checkpoint {done} of {self.steps} steps; handing over "
            f"to submitit to requeue",
            file=sys.stderr,
            flush=True,
        )
        _hand_to_submitit()
        return 0  # ranks other than 0: rank 0 requeues the whole job

    def checkpoint(self, *args, **kwargs) -> DelayedSubmission | None:
        """Called by submitit on rank 0 before requeueing: the same task, one more requeue.

        The trainer has already saved its state in the run directory, so resuming is just
        running the same command again. None (no requeue) once ``max_requeues`` is spent.
        """
        restarts = max(self.requeues, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
        if restarts >= self.max_requeues:
            print(
                f"error: not requeueing: {restarts} requeue(s) already, max_requeues "
                f"{self.max_requeues}; rerun the same command to continue from the checkpoint",
                file=sys.stderr,
                flush=True,
            )
            return None
        return DelayedSubmission(
            TrainTask(
                self.trainer_args, self.run_dir, self.steps, self.max_requeues, self.local_port, restarts + 1
            )
        )

    def _local_process_args(self) -> list[str]:
        """Explicit coordinator for several tasks under submitit's local executor."""
        if os.environ.get("SUBMITIT_EXECUTOR") != "local":
            return []
        count = int(os.environ.get("SUBMITIT_LOCAL_NTASKS", "1"))
        if count <= 1:
            return []
        return [
            "--coordinator",
            f"127.0.0.1:{self.local_port}",
            "--num-processes",
            str(count),
            "--process-id",
            os.environ.get("SUBMITIT_LOCAL_GLOBALID", "0"),
        ]


def _rank() -> str:
    return os.environ.get("SLURM_PROCID") or os.environ.get("SUBMITIT_LOCAL_GLOBALID") or "0"


def _hand_to_submitit() -> None:
    """Run submitit's preemption handler now (the trainer consumed the signal itself)."""
    from submitit import JobEnvironment

    sig = JobEnvironment._usr_sig()
    handler = signal.getsignal(sig)
    if callable(handler):
        handler(sig, None)
