"""Golden files: one fixed example job per shipped cluster preset, rendered by ``--dry-run``.

``slurm/golden/<preset>.sbatch`` holds what the launcher renders for the job in ``EXAMPLES``
(fixed nodes, model, EP, steps, run directory, job name, time, no site file, and fixed
stand-ins for this machine's Python and checkout), so the rendering is deterministic: its own
notes (placement, warnings), the sbatch script, the srun line and each task's command. What
``python -m slurm.submit ... --dry-run`` prints besides is not the launcher's: the planner's
lines (memory verdict, search, its choices) are in one planner snapshot, compared within a
tolerance (``slurm/snapshot.py``), and each environment variable's source comment (the
preset's own prose, measured numbers included) stands as ``<the preset's env_source.NAME>``.
Each example sets the keys the planner would choose by predicted step time
(``Example.sets``), so a change of the planner's numbers (``moe_train/planner/compute.toml``; the
memory model, while the jobs still fit) moves the snapshot and no golden file.

tests/test_slurm_render.py and tests/test_planner_snapshot.py compare them; change them only
on purpose (both at once)::

    python -m slurm.examples --update-golden      # or MOE_TRAIN_UPDATE_GOLDEN=1 pytest ...
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from moe_train.planner.decide import decide
from moe_train.planner.request import Request
from slurm import plan, render, site, snapshot
from slurm.submit import dry_run_text
from topology import presets

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
UPDATE_ENV = "MOE_TRAIN_UPDATE_GOLDEN"
HOST_PYTHON = "/venv/bin/python"  # stands in for sys.executable on host (CPU) presets
KIT_ROOT = Path("/src/moe-train")  # stands in for this checkout
KIT_IMAGE = "registry.example.com/moe-train:golden"  # stands in for the kit image (--image)
ENV_SOURCE = "<the preset's env_source.{name}>"  # stands in for each variable's source comment


@dataclass(frozen=True)
class Example:
    """The fixed job rendered for one preset."""

    nodes: int  # --nodes
    model: str  # --model
    ep: int  # --ep
    steps: int  # --steps
    # --set overrides: a per-GPU batch and remat that fit in memory, and every key the planner
    # chooses by predicted step time (moe_train/planner/choices.py: weight gathering, overlap chunks; one
    # sequence per GPU leaves one micro-batch), so that no figure of the planner's moves the job
    sets: tuple[str, ...] = ()


def _sets(batch: int, gather: str) -> tuple[str, ...]:
    """A GPU example's --set items: one sequence per GPU (``batch`` = the GPUs), full remat, the
    weight gathering the planner chose for the job when the goldens left its figures (so the
    rendered job stayed as it was), one overlap chunk."""
    return (
        f"train.batch_size={batch}",
        "train.remat=full",
        f"parallel.weight_gather={gather}",
        "moe.overlap_chunks=1",
    )


EXAMPLES: dict[str, Example] = {
    "cpu-local": Example(nodes=1, model="tiny", ep=8, steps=40),  # nothing predicted: nothing chosen
    "h100-dgx": Example(nodes=4, model="qwen3-30b-a3b", ep=32, steps=1000, sets=_sets(32, "micro_batch")),
    "h200-hgx": Example(nodes=2, model="mixtral-8x7b", ep=8, steps=1000, sets=_sets(16, "micro_batch")),
    "b200-hgx": Example(nodes=16, model="deepseek-v3", ep=64, steps=1000, sets=_sets(128, "micro_batch")),
    "gb200-nvl72": Example(nodes=32, model="deepseek-v3", ep=64, steps=1000, sets=_sets(128, "step")),
    "gb200-nvl36x2": Example(nodes=32, model="deepseek-v3", ep=64, steps=1000, sets=_sets(128, "step")),
}


def request_for(preset: str) -> Request:
    """The preset's example job as ``make submit DRY_RUN=1`` would be asked for it."""
    e = EXAMPLES[preset]
    image = "" if presets.load(preset).nominal else KIT_IMAGE
    return Request(
        preset=preset,
        model=e.model,
        nodes=e.nodes,
        steps=e.steps,
        ep=e.ep,
        sets=e.sets,
        out=f"/runs/golden/{preset}",
        job_name=f"golden-{preset}",
        time="02:00:00",
        image=image,
        dry_run=True,
    )


def spec_for(preset: str) -> plan.JobSpec:
    req = request_for(preset)
    return plan.plan(req, site.Site(), host_python=HOST_PYTHON, kit_root=KIT_ROOT, now="19700101-000000")


def _shown(spec: plan.JobSpec) -> str:
    return "".join(f"{n}\n" for n in spec.notes) + dry_run_text(spec, render.render_script(spec))


def shown_text(preset: str) -> str:
    """What --dry-run prints for the preset's example: notes, script, srun line, task command."""
    return _shown(spec_for(preset))


def launcher_part(spec: plan.JobSpec) -> plan.JobSpec:
    """``spec`` without what is not the launcher's: the planner's notes, and the preset's
    source comments in place of a stand-in (``ENV_SOURCE``)."""
    env = tuple((name, value, ENV_SOURCE.format(name=name)) for name, value, _ in spec.env)
    notes = tuple(n for n in spec.notes if n not in spec.planner_notes)
    return dataclasses.replace(spec, env=env, notes=notes, planner_notes=())


def golden_text(preset: str) -> str:
    """The golden file of the preset's example: ``shown_text`` as the launcher renders it
    (``launcher_part``)."""
    return _shown(launcher_part(spec_for(preset)))


def job_line(preset: str) -> str:
    """The example job's command line (python -m slurm.submit arguments)."""
    e = EXAMPLES[preset]
    args = ["--preset", preset, "--model", e.model, "--nodes", str(e.nodes), "--ep", str(e.ep)]
    return shlex.join([*args, *(a for s in e.sets for a in ("--set", s))])


def planner_entry(preset: str) -> dict:
    """The preset's example job in the planner snapshot (``slurm/snapshot.py``)."""
    return snapshot.entry(job_line(preset), spec_for(preset).planner_notes, decide(request_for(preset)))


def planner_jobs() -> dict[str, dict]:
    """The planner snapshot's jobs: every shipped preset's example."""
    return {preset: planner_entry(preset) for preset in presets.list_presets()}


def golden_path(preset: str) -> Path:
    return GOLDEN_DIR / f"{preset}.sbatch"


def update() -> list[Path]:
    """Rewrite every golden file and the planner snapshot; the paths written."""
    GOLDEN_DIR.mkdir(exist_ok=True)
    written = []
    for preset in presets.list_presets():
        path = golden_path(preset)
        path.write_text(golden_text(preset))
        written.append(path)
    return [*written, snapshot.write(planner_jobs())]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m slurm.examples", description=(__doc__ or "").partition("\n")[0]
    )
    p.add_argument(
        "--update-golden",
        action="store_true",
        help="rewrite slurm/golden/*.sbatch and the planner snapshot (tests/snapshots/planner.json)",
    )
    p.add_argument("preset", nargs="?", help="print this preset's example as --dry-run shows it instead")
    args = p.parse_args(argv)
    if args.update_golden:
        for path in update():
            print(f"wrote {path}")
        return 0
    if args.preset not in EXAMPLES:
        print(f"error: give --update-golden or one of: {', '.join(EXAMPLES)}", file=sys.stderr)
        return 2
    sys.stdout.write(shown_text(args.preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
