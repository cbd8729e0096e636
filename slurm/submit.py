"""Submit the trainer as a Slurm job: ``python -m slurm.submit --preset CLUSTER --model MODEL --nodes N``.

Everything is validated before anything is submitted (cluster preset, model config with
``--set`` overrides, EP size, ``--segment`` choice, image, names); a problem prints one
``error:`` line on stderr and exits 2. A value given twice (``--ep 8`` and ``--set
parallel.ep=7``, or ``--set`` twice) with different values is such a problem, naming both.
On success it prints ``job <id>`` and ``OUT=<run dir>``;
``--wait`` then follows the job and exits with its status; ``--dry-run`` prints the exact
sbatch script and srun command instead of submitting.

Where ``sbatch`` is not on PATH, a nominal (CPU) preset runs the same job through submitit's
local executor on this machine (it says so); GPU presets need a Slurm cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from moe_train.planner.request import SMOKE_MODEL, LaunchError, Request, check_twice
from slurm import follow, plan, render, task
from slurm import site as site_mod

KIT_ROOT = Path(__file__).resolve().parent.parent  # this checkout: host runs start here


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slurm.submit", description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--preset", required=True, help="cluster preset name or a site's cluster .toml")
    p.add_argument("--model", default="", help="model preset (moe_train/config/presets); not with --smoke")
    p.add_argument("--nodes", type=int, help="nodes to allocate")
    p.add_argument("--steps", type=int, help="total training steps (default: the model preset's)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="trainer override, e.g. --set moe.top_k=4 (repeatable)",
    )
    p.add_argument(
        "--out",
        default="",
        help="run directory on a shared file system (default: runs/slurm/<job name>-<UTC time>)",
    )
    p.add_argument("--ep", type=int, help="expert-parallel size (parallel.ep)")
    p.add_argument("--time", default="", help="wall-clock limit, HH:MM:SS (default: site or 01:00:00)")
    p.add_argument("--partition", default="")
    p.add_argument("--account", default="")
    p.add_argument("--qos", default="")
    p.add_argument("--job-name", default="", help="default: moe-<model>")
    p.add_argument("--image", default="", help="container image: .sqsh path or registry reference")
    p.add_argument("--site", help=f"site file (default: ${site_mod.SITE_ENV}, then {site_mod.DEFAULT_SITE})")
    p.add_argument(
        "--allow-straddle",
        action="store_true",
        help="accept EP groups that cross NVLink domains (prints the predicted cost)",
    )
    p.add_argument("--no-container", action="store_true", help="run on the host's Python")
    p.add_argument(
        "--smoke", action="store_true", help="single-node smoke job: preflight + a short tiny-model run"
    )
    p.add_argument(
        "--compute",
        default="",
        help="compute calibration the planner's choices use "
        "(make gpu-check writes one; default: moe_train/planner/compute.toml), as make plan's",
    )
    p.add_argument(
        "--ignore-memory",
        action="store_true",
        help="submit even if the memory planner says the job will not fit",
    )
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit nothing")
    p.add_argument("--wait", action="store_true", help="follow the job; exit with its status")
    return p


def request(args: argparse.Namespace) -> Request:
    if args.smoke and args.model not in ("", SMOKE_MODEL):
        raise LaunchError(f"--smoke always trains the {SMOKE_MODEL} model; drop --model")
    if not args.smoke and not args.model:
        raise LaunchError("--model is required (or --smoke)")
    if not args.smoke and args.nodes is None:
        raise LaunchError("--nodes is required (or --smoke)")
    if not args.smoke and args.nodes < 1:
        raise LaunchError(f"--nodes must be >= 1, got {args.nodes}")
    if args.steps is not None and args.steps < 1:
        raise LaunchError(f"--steps must be at least 1, got {args.steps}")
    check_twice(args)
    return Request(
        preset=args.preset,
        model=args.model or SMOKE_MODEL,
        nodes=args.nodes or 1,
        steps=args.steps,
        sets=tuple(args.sets),
        out=args.out,
        ep=args.ep,
        time=args.time,
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        job_name=args.job_name,
        image=args.image,
        allow_straddle=args.allow_straddle,
        no_container=args.no_container,
        smoke=args.smoke,
        dry_run=args.dry_run,
        ignore_memory=args.ignore_memory,
        compute=args.compute,
    )


def build(args: argparse.Namespace) -> plan.JobSpec:
    """The validated job; LaunchError / SiteError for bad input. With ``--dry-run`` an image
    file (``--image``, else the site file's ``image``) that does not exist yet is fine
    (``_missing_image``)."""
    site = site_mod.load(site_mod.find(args.site))
    now = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    req = request(args)
    ref = req.image or site.image
    missing = _missing_image(ref, req.dry_run)
    if missing is None:
        return plan.plan(req, site, host_python=shlex.quote(sys.executable), kit_root=KIT_ROOT, now=now)
    # Planned with an empty stand-in file of the same name, which the job then names as given:
    # every other check (name, path characters, preset) runs as for an existing image.
    with tempfile.TemporaryDirectory() as tmp:
        stand_in = Path(tmp) / missing.name
        stand_in.touch()
        if req.image:
            req = dataclasses.replace(req, image=str(stand_in))
        else:  # the site file's: a preset that runs on the host still ignores it
            site = dataclasses.replace(site, image=str(stand_in))
        spec = plan.plan(req, site, host_python=shlex.quote(sys.executable), kit_root=KIT_ROOT, now=now)
    if spec.container is None:
        return spec
    if re.search(r"[\s,]", str(missing)):
        raise LaunchError(f"image path {str(missing)!r} contains a space or ','; Pyxis cannot take it")
    note = (
        f"warning: image file {ref!r} does not exist yet: the job below names it; "
        f"build it with `make container` (or import one with `make container-import`) "
        f"before submitting"
    )
    return dataclasses.replace(
        spec, container=dataclasses.replace(spec.container, image=str(missing)), notes=(*spec.notes, note)
    )


def _missing_image(ref: str, dry_run: bool) -> Path | None:
    """A dry run's image (``--image`` or the site file's) that names a .sqsh file not there
    yet: its absolute path."""
    if not (dry_run and ref) or not (ref.startswith(("/", "./", "../", "~")) or ref.endswith(".sqsh")):
        return None
    path = Path(ref).expanduser()
    return None if path.exists() else path.absolute()


def dry_run_text(spec: plan.JobSpec, script: str) -> str:
    """What --dry-run prints: the sbatch script, then the srun line and each task's command."""
    return (
        "\n".join(
            [
                f"# sbatch script ({spec.submitit_folder}/<job id>_submission.sh)",
                script.rstrip("\n"),
                "",
                "# training step (srun)",
                render.srun_command(script),
                f"# each of the {spec.tasks} tasks runs in-process (submitit task, pickled):",
                render.trainer_command(spec),
            ]
        )
        + "\n"
    )


def _task(spec: plan.JobSpec, local_port: int = 0):
    import cloudpickle

    cloudpickle.register_pickle_by_value(task)  # the image needs moe_train, not slurm/
    return task.TrainTask(
        spec.trainer_args, str(spec.run_dir), spec.steps, spec.max_requeues, local_port=local_port
    )


def submit_slurm(spec: plan.JobSpec) -> str:
    """Submit through submitit's SlurmExecutor; the job id."""
    from submitit import SlurmExecutor
    from submitit.core.utils import FailedJobError

    spec.submitit_folder.mkdir(parents=True, exist_ok=True)
    ex = render.configure(
        SlurmExecutor(spec.submitit_folder, max_num_timeout=spec.max_requeues, python=spec.python), spec
    )
    try:
        return ex.submit(_task(spec)).job_id
    except FailedJobError as err:
        first = next((ln for ln in str(err).splitlines() if ln.strip()), "no message")
        raise LaunchError(f"sbatch refused the job: {first}") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submit_local(spec: plan.JobSpec):
    """Run on this machine through submitit's local executor (no Slurm here)."""
    from submitit import LocalExecutor

    if spec.container is not None or spec.nodes != 1:
        raise LaunchError(
            f"no sbatch on PATH: only a nominal (CPU) preset on 1 node runs "
            f"without Slurm, not {spec.cluster} on {spec.nodes} node(s)"
        )
    spec.submitit_folder.mkdir(parents=True, exist_ok=True)
    ex = LocalExecutor(spec.submitit_folder, max_num_timeout=spec.max_requeues)
    setup = [f"cd {shlex.quote(spec.chdir)}"] + [
        f"export {name}={shlex.quote(value)}" for name, value, _ in spec.env
    ]
    ex.update_parameters(
        timeout_min=spec.time_min,
        tasks_per_node=spec.ntasks_per_node,
        signal_delay_s=spec.signal_delay_s,
        setup=setup,
    )
    return ex.submit(_task(spec, local_port=_free_port()))


def _succeeded(result_pickle: Path) -> bool:
    """Whether submitit recorded a successful return for one task."""
    from submitit.core.utils import pickle_load

    try:
        return pickle_load(result_pickle)[0] == "success"
    except Exception:  # missing, partial or unreadable: not a success
        return False


def follow_local(job, spec: plan.JobSpec) -> int:
    """--wait for a local job: stream rank 0; every rank that finished wrote its result."""
    folder = spec.submitit_folder
    tail = follow.LogTail(folder / f"{job.job_id}_0_log.out")
    while not job.done():
        for line in tail.read():
            print(line, flush=True)
        time.sleep(1.0)
    for line in tail.flush():
        print(line, flush=True)
    ok = job.state == "FINISHED" and all(
        _succeeded(folder / f"{job.job_id}_{rank}_result.pkl") for rank in range(spec.tasks)
    )
    state = follow.JobState("COMPLETED" if ok else "FAILED", "" if ok else "1:0")
    return follow.report(str(job.job_id), folder, state, sys.stderr)


def run(args: argparse.Namespace) -> int:
    spec = build(args)
    for note in spec.notes:
        print(note, file=sys.stderr if note.startswith("warning") else sys.stdout, flush=True)
    if args.dry_run:
        sys.stdout.write(dry_run_text(spec, render.render_script(spec)))
        return 0
    if shutil.which("sbatch"):
        print(f"mode: slurm (sbatch {shutil.which('sbatch')})", flush=True)
        job_id = submit_slurm(spec)
        print(f"job {job_id}\nOUT={spec.run_dir}", flush=True)
        return follow.follow(job_id, spec.submitit_folder) if args.wait else 0
    print("mode: local (no sbatch on PATH): submitit's local executor on this machine", flush=True)
    job = submit_local(spec)
    print(f"job {job.job_id}\nOUT={spec.run_dir}", flush=True)
    return follow_local(job, spec) if args.wait else 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except (LaunchError, site_mod.SiteError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the job keeps running (scancel <job id> stops it)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
