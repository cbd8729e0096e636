"""From a submission request to a validated ``JobSpec``; nothing here talks to Slurm.

``plan(request, site)`` checks everything that can be checked before submitting: the cluster
preset, the model config with the user's ``--set`` overrides (``moe_train.config.build``), the
EP size against the GPUs and the experts, the ``--segment`` choice (``topology.placement``),
the container image, and every free-text value that will reach the batch script (the part
that needs no site file or image, ``moe_train.planner.decide``, is also what ``make plan`` shows). Any problem
raises ``LaunchError`` with one line naming it and the valid choices; the CLI prints it and
exits 2 with nothing submitted.

Free text is either validated (names, partition/account/qos, image references, mounts) or
shell-quoted when the script is rendered (job name, paths, environment values). Control
characters are refused everywhere: a newline would end an ``#SBATCH`` comment line.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from containers.images import pyxis_image, validate_image
from moe_train.planner import layout, preflight
from moe_train.planner.decide import decide, with_compiled
from moe_train.planner.request import LaunchError, Request, check_text
from slurm import site as site_mod
from topology import presets

if TYPE_CHECKING:
    from moe_train.planner.decide import Decision

CONTAINER_NAME = "moe-train"  # Pyxis --container-name; job-scoped, so one fixed name suffices
DEFAULT_TIME = "01:00:00"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+,-]*")  # partition, account, qos
_NAME_OR_EMPTY = re.compile(f"(?:{_NAME.pattern})?")  # "" leaves the value to Slurm
_PYTHON = re.compile(r"[A-Za-z0-9_./+-]+")


@dataclass(frozen=True)
class Container:
    """Pyxis settings of the training step."""

    image: str  # --container-image, in Pyxis syntax (absolute .sqsh path or REGISTRY#IMAGE:TAG)
    name: str  # --container-name: imported once per node by a setup step, reused after
    mounts: tuple[str, ...]  # --container-mounts entries, "src:dst[:flags]"
    workdir: str  # --container-workdir: the kit's directory inside the image
    env_names: tuple[str, ...]  # --container-env: preset variables that must win over the image's


@dataclass(frozen=True)
class JobSpec:
    """Everything needed to render and submit the job; built only by ``plan``."""

    cluster: str  # cluster preset name (file stem for a site's .toml)
    job_name: str  # sbatch --job-name (free text; quoted when rendered)
    nodes: int  # sbatch --nodes
    ntasks_per_node: int  # one trainer process per GPU (preset's slurm.ntasks_per_node)
    gpus_per_node: int | None  # sbatch --gpus-per-node; None for nominal (CPU) presets
    segment: int | None  # sbatch --segment; None when the preset does not ask for it
    exclusive: bool  # sbatch --exclusive
    time_min: int  # sbatch --time, minutes
    signal_delay_s: int  # sbatch --signal=USR2@<this>
    partition: str  # sbatch --partition; "" leaves it to Slurm
    account: str  # sbatch --account; ""  leaves it to Slurm
    qos: str  # sbatch --qos; "" leaves it to Slurm
    run_dir: Path  # absolute run directory: trainer output, submitit folder and logs
    env: tuple[tuple[str, str, str], ...]  # (name, value, source) exported by the batch script
    container: Container | None  # None: run on the host's Python (no Pyxis flags)
    python: str  # shell words starting Python for submitit's worker
    chdir: str  # sbatch --chdir (host runs: the kit's root, for relative data paths); "": none
    trainer_args: tuple[str, ...]  # python -m moe_train arguments, run in-process by each task
    steps: int  # the run's total steps: a task that stops earlier was preempted
    devices_per_task: int  # devices each process drives (fake CPU devices on nominal presets)
    max_requeues: int  # bound on requeues after preemption, timeout or a hung step
    preflight: str  # shell command of the smoke job's preflight step; "" for none
    notes: tuple[str, ...]  # lines to show the user (segment choice, warnings)
    # those of ``notes`` that are the planner's figures (memory verdict, search, its choices,
    # the compiled peak): the golden files leave them out (slurm/examples.py, slurm/snapshot.py)
    planner_notes: tuple[str, ...]

    @property
    def tasks(self) -> int:
        return self.nodes * self.ntasks_per_node

    @property
    def submitit_folder(self) -> Path:
        return self.run_dir / "slurm"


def parse_time(text: str) -> int:
    """Minutes (rounded up) of a Slurm time limit: MINUTES, [D-]HH:MM:SS or D-HH[:MM]."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise LaunchError(f"time {text!r} is not a Slurm time; use HH:MM:SS, D-HH:MM:SS or minutes")
    days, b, c = (int(g) if g else None for g in m.group(1, 3, 4))
    a = int(m.group(2))  # the one group every form has
    if days is None and b is None:
        seconds = a * 60  # plain minutes
    elif days is None and c is None and b is not None:
        seconds = a * 60 + b  # MM:SS
    else:
        seconds = (days or 0) * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if seconds <= 0:
        raise LaunchError(f"time {text!r} must be positive")
    return math.ceil(seconds / 60)


def signal_delay(cluster: presets.Cluster) -> int:
    """Seconds of warning from the preset's ``USR2@<s>`` (the signal submitit requeues on)."""
    m = re.fullmatch(r"USR2@(\d+)", cluster.slurm.signal)
    if not m:
        raise LaunchError(
            f"cluster preset {cluster.name}: slurm.signal {cluster.slurm.signal!r} "
            f"must be USR2@<seconds> (NCCL takes USR1; submitit requeues on USR2)"
        )
    return int(m.group(1))


def plan(req: Request, site: site_mod.Site, *, host_python: str, kit_root: Path, now: str) -> JobSpec:
    """Validate ``req`` (with ``site`` defaults) into a JobSpec; raises LaunchError.

    ``host_python`` starts Python on the host (quoted shell words), ``kit_root`` is this
    checkout (the working directory of host runs), ``now`` a UTC stamp for default run dirs.
    """
    d = decide(req)
    req, cluster, cfg = d.req, d.cluster, d.cfg
    job_name = check_text("job name", req.job_name or f"moe-{req.model}")
    if len(job_name) > 200:
        raise LaunchError(f"job name is {len(job_name)} characters long; use at most 200")
    notes = list(d.placement)
    run_dir = _run_dir(req, job_name, now, container=_uses_container(req, cluster))
    container = _container(req, site, cluster, run_dir)
    if container is not None and not (req.image or site.image):
        notes.append(
            f"warning: rendered with {cluster.name}'s base image {cluster.image}, which "
            f"lacks moe-train; a real submission needs --image (make container)"
        )
    chosen = [d.search_note, *(c.note for c in d.choices), preflight.preflight(req, cluster, cfg)]
    d = with_compiled(d)  # the preflight's compile, where it made one, decides the verdict
    planner = [_memory(req, cluster, d), *(n for n in chosen if n)]
    notes[1:1] = planner  # after the placement's reason, before its warnings
    return JobSpec(
        cluster=cluster.name,
        job_name=job_name,
        nodes=req.nodes,
        ntasks_per_node=cluster.slurm.ntasks_per_node,
        gpus_per_node=None if cluster.nominal else cluster.slurm.gpus_per_node,
        segment=d.segment if cluster.slurm.segment else None,
        exclusive=cluster.slurm.exclusive,
        time_min=parse_time(req.time or site.time or DEFAULT_TIME),
        signal_delay_s=signal_delay(cluster),
        partition=check_text("partition", req.partition or site.partition, _NAME_OR_EMPTY),
        account=check_text("account", req.account or site.account, _NAME_OR_EMPTY),
        qos=check_text("qos", req.qos or site.qos, _NAME_OR_EMPTY),
        run_dir=run_dir,
        env=tuple(
            (k, check_text(f"env {k}", v), cluster.env_source[k]) for k, v in sorted(cluster.env.items())
        ),
        container=container,
        python=host_python
        if container is None
        else check_text("container_python", site.container_python, _PYTHON, "a command name or path"),
        chdir="" if container is not None else str(kit_root),
        trainer_args=layout.trainer_args(req, cluster, cfg, d.ep, run_dir, d.per_task),
        steps=cfg.train.steps,
        devices_per_task=d.per_task,
        max_requeues=site.max_requeues,
        preflight=_preflight(req, cluster, container, site),
        notes=tuple(notes),
        planner_notes=tuple(planner),
    )


def _memory(req: Request, cluster: presets.Cluster, d: Decision) -> str:
    """The memory planner's verdict as a note; a job that will not fit is refused unless
    ``--ignore-memory`` (a dry run only warns, so every preset still renders)."""
    verdict = d.memory.verdict
    if verdict.fits:
        return f"memory: {verdict.message}"
    if req.dry_run or req.ignore_memory:
        return f"warning: memory: {verdict.message}"
    raise LaunchError(
        f"memory: {verdict.message}; pass --ignore-memory to submit anyway "
        f"(details: make plan with the same PRESET, MODEL, NODES, EP and SET)"
    )


def _uses_container(req: Request, cluster: presets.Cluster) -> bool:
    """Nominal (CPU) presets run on the host's Python; so does ``--no-container``."""
    return not (cluster.nominal or req.no_container)


def _run_dir(req: Request, job_name: str, now: str, container: bool) -> Path:
    default = f"runs/slurm/{re.sub(r'[^A-Za-z0-9_.-]+', '_', job_name)}-{now}"
    path = Path(check_text("run directory", req.out or default)).expanduser().absolute()
    text = str(path)
    if "%" in text:
        raise LaunchError(f"run directory {text!r} contains '%' (Slurm reads it as a file pattern)")
    if container and re.search(r"[\s,:]", text):
        raise LaunchError(
            f"run directory {text!r} contains a space, ',' or ':', which Pyxis "
            f"--container-mounts cannot carry; choose another path"
        )
    return path


def _image(ref: str) -> str:
    """A Pyxis --container-image value: an existing .sqsh as an absolute path, or a reference."""
    check_text("image", ref)
    if ref.startswith(("/", "./", "../", "~")) or ref.endswith(".sqsh"):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise LaunchError(
                f"image file {ref!r} does not exist (build it with `make container` "
                f"or import one with `make container-import`)"
            )
        text = str(path.absolute())
        if re.search(r"[\s,]", text):
            raise LaunchError(f"image path {text!r} contains a space or ','; Pyxis cannot take it")
        return text
    if not validate_image(ref):
        raise LaunchError(
            f"image {ref!r} is neither an existing .sqsh file nor a plain registry "
            f"reference (registry/name:tag)"
        )
    return pyxis_image(ref)


def _mount(entry: str) -> str:
    check_text("container mount", entry)
    parts = entry.split(":")
    if (
        not 2 <= len(parts) <= 3
        or not all(parts[:2])
        or not parts[0].startswith("/")
        or not parts[1].startswith("/")
        or re.search(r"[\s,]", entry)
    ):
        raise LaunchError(
            f"container mount {entry!r} is not /src:/dst[:flags] (absolute paths, no spaces or commas)"
        )
    return entry


def _container(
    req: Request, site: site_mod.Site, cluster: presets.Cluster, run_dir: Path
) -> Container | None:
    if not _uses_container(req, cluster):
        if req.image:
            raise LaunchError(
                f"cluster preset {cluster.name} runs on the host without a container "
                f"(nominal preset or --no-container); drop --image"
            )
        return None
    if not (req.image or site.image) and not req.dry_run:
        raise LaunchError(
            f"no kit image: {cluster.name}'s [container] image {cluster.image} is the "
            f"base image without moe-train; build one with `make container` (or "
            f"`make container-import`) and pass --image PATH.sqsh or set image in "
            f"the site file"
        )
    image = _image(req.image or site.image or cluster.image)
    mounts = [f"{run_dir}:{run_dir}"] + [_mount(m) for m in site.mounts]
    ref = req.preset
    if ref.endswith(".toml") or "/" in ref:  # a site's cluster file: the trainer reads it too
        path = Path(ref).absolute()
        mounts.append(_mount(f"{path}:{path}:ro"))
    workdir = check_text("container_workdir", site.container_workdir, _PYTHON, "an absolute path")
    return Container(
        image=image,
        name=CONTAINER_NAME,
        mounts=tuple(mounts),
        workdir=workdir,
        env_names=tuple(sorted(cluster.env)),
    )


def _preflight(
    req: Request, cluster: presets.Cluster, container: Container | None, site: site_mod.Site
) -> str:
    """The smoke job's in-container check (skipped on the host: nothing to check there)."""
    if not req.smoke or container is None:
        return ""
    return shlex.join(
        [
            site.container_python,
            "-m",
            "containers.preflight",
            "--preset",
            layout.cluster_ref(req.preset),
            "--expect-gpus",
            str(cluster.gpus_per_node),
        ]
    )
