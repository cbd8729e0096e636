"""Golden files: one fixed example job per shipped cluster preset, rendered by ``--dry-run``.

``slurm/golden/<preset>.sbatch`` holds what ``python -m slurm.submit ... --dry-run`` prints
for the job in ``EXAMPLES`` (fixed nodes, model, EP, steps, run directory, job name, time,
no site file, and fixed stand-ins for this machine's Python and checkout), so the rendering
is deterministic. tests/test_slurm_render.py compares them; change them only on purpose::

    python -m slurm.examples --update-golden      # or MOE_TRAIN_UPDATE_GOLDEN=1 pytest ...
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from slurm import plan, render, site
from topology import presets

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
UPDATE_ENV = "MOE_TRAIN_UPDATE_GOLDEN"
HOST_PYTHON = "/venv/bin/python"  # stands in for sys.executable on host (CPU) presets
KIT_ROOT = Path("/src/moe-train")  # stands in for this checkout
KIT_IMAGE = "registry.example.com/moe-train:golden"  # stands in for the kit image (--image)


@dataclass(frozen=True)
class Example:
    """The fixed job rendered for one preset."""

    nodes: int  # --nodes
    model: str  # --model
    ep: int  # --ep
    steps: int  # --steps
    sets: tuple[str, ...] = ()  # --set overrides (a per-GPU batch and remat that fit in memory)


EXAMPLES: dict[str, Example] = {
    "cpu-local": Example(nodes=1, model="tiny", ep=8, steps=40),
    "h100-dgx": Example(
        nodes=4, model="qwen3-30b-a3b", ep=32, steps=1000, sets=("train.batch_size=32", "train.remat=full")
    ),
    "h200-hgx": Example(
        nodes=2, model="mixtral-8x7b", ep=8, steps=1000, sets=("train.batch_size=16", "train.remat=full")
    ),
    "b200-hgx": Example(
        nodes=16, model="deepseek-v3", ep=64, steps=1000, sets=("train.batch_size=128", "train.remat=full")
    ),
    "gb200-nvl72": Example(
        nodes=32, model="deepseek-v3", ep=64, steps=1000, sets=("train.batch_size=128", "train.remat=full")
    ),
    "gb200-nvl36x2": Example(
        nodes=32, model="deepseek-v3", ep=64, steps=1000, sets=("train.batch_size=128", "train.remat=full")
    ),
}


def spec_for(preset: str) -> plan.JobSpec:
    e = EXAMPLES[preset]
    image = "" if presets.load(preset).nominal else KIT_IMAGE
    req = plan.Request(
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
    return plan.plan(req, site.Site(), host_python=HOST_PYTHON, kit_root=KIT_ROOT, now="19700101-000000")


def golden_text(preset: str) -> str:
    """What --dry-run prints for the preset's example: notes, script, srun line, task command."""
    from slurm.submit import dry_run_text

    spec = spec_for(preset)
    return "".join(f"{n}\n" for n in spec.notes) + dry_run_text(spec, render.render_script(spec))


def golden_path(preset: str) -> Path:
    return GOLDEN_DIR / f"{preset}.sbatch"


def update() -> list[Path]:
    """Rewrite every golden file; the paths written."""
    GOLDEN_DIR.mkdir(exist_ok=True)
    written = []
    for preset in presets.list_presets():
        path = golden_path(preset)
        path.write_text(golden_text(preset))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m slurm.examples", description=(__doc__ or "").partition("\n")[0]
    )
    p.add_argument("--update-golden", action="store_true", help="rewrite slurm/golden/*.sbatch")
    p.add_argument("preset", nargs="?", help="print this preset's example instead")
    args = p.parse_args(argv)
    if args.update_golden:
        for path in update():
            print(f"wrote {path}")
        return 0
    if args.preset not in EXAMPLES:
        print(f"error: give --update-golden or one of: {', '.join(EXAMPLES)}", file=sys.stderr)
        return 2
    sys.stdout.write(golden_text(args.preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
