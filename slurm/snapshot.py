"""The planner's figures for the golden jobs: one snapshot, compared within a tolerance.

The golden files (``slurm/golden/<preset>.sbatch``, ``slurm/examples.py``) hold what the
launcher renders; what the planner made of the same jobs (the memory verdict, the search, its
choices: the lines ``make submit`` prints before the script) is here, in one file,
``tests/snapshots/planner.json``: for each preset's example job, its command line, the
planner's lines as the user sees them and the figures behind them. A change of the planner's
numbers (``moe_train/planner/compute.toml``; the memory model, while the jobs still fit) moves this
file and no golden.

``python -m slurm.examples --update-golden`` (``make golden``) writes it with the golden files;
``tests/test_planner_snapshot.py`` compares it with the planner: the command lines, the
discrete values (fits, counts, choices, names) and the lines' wording (their numbers masked)
exactly, every figure within ``REL_TOL``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from moe_train.planner.decide import Decision

SNAPSHOT = Path(__file__).resolve().parents[1] / "tests" / "snapshots" / "planner.json"
# How far (relative) a figure may drift from the snapshot before the test asks for a new one:
# wider than the rounding the file stores (SIGNIFICANT digits), narrow enough that any change
# of a share or a memory term that moves a job's step time or memory by 2% shows in review.
REL_TOL = 0.02
SIGNIFICANT = 6  # significant digits a figure is stored with
GIB = 2**30
ABOUT = (
    "The planner's figures for the golden jobs (slurm/snapshot.py). Generated: make golden "
    "(python -m slurm.examples --update-golden); never edit by hand. tests/test_planner_snapshot.py "
    "compares it with the planner: wording and discrete values exactly, figures within REL_TOL."
)
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")

Figures = dict[str, Any]  # "section.name" -> a float (compared within REL_TOL) or an exact value


def _stored(x: float) -> float:
    return float(f"{x:.{SIGNIFICANT}g}")


def memory_figures(d: Decision) -> Figures:
    """The memory verdict of the job, per GPU."""
    v = d.memory.verdict
    return {
        "memory.fits": v.fits,
        "memory.need_gib": _stored(v.total_bytes / GIB),
        "memory.usable_gib": _stored(v.usable_bytes / GIB),
        "memory.worst_case_gib": _stored(v.worst_case_bytes / GIB),
        "memory.bucket_fits": v.bucket_fits,
        "memory.largest": v.largest,
    }


def search_figures(d: Decision) -> Figures:
    """What the search timed and found (nothing where nothing is predicted)."""
    found = d.found
    if found is None:
        return {}
    out: Figures = {
        "search.timed": found.timed,
        "search.judged": found.judged,
        "search.kept": list(found.fixed),
        "search.preset_step_s": _stored(found.base_step_s),
        "search.preset_fits": found.base_fits,
    }
    if found.ranked:
        best = found.ranked[0]
        out["search.changes"] = list(best.changes)
        out["search.step_s"] = _stored(best.step.step_s)
        out["search.tokens_per_s_per_gpu"] = _stored(best.step.tokens_per_s)
        out["search.mfu"] = _stored(best.step.mfu)
    if found.opt_in is not None:
        out["search.opt_in"] = list(found.opt_in.changes)
        out["search.opt_in_step_s"] = _stored(found.opt_in.step.step_s)
    return out


def figures(d: Decision) -> Figures:
    """Every figure of the planner's for one job, with each key's value and who chose it."""
    chosen = {f"choice.{c.key}": f"{c.value} ({c.source})" for c in d.choices}
    return {**memory_figures(d), **search_figures(d), **chosen}


def entry(job: str, lines: tuple[str, ...], d: Decision) -> dict[str, Any]:
    """One job's part of the snapshot: its command line, the planner's lines, the figures."""
    return {"job": job, "lines": list(lines), "figures": figures(d)}


def write(jobs: dict[str, dict[str, Any]], path: Path = SNAPSHOT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"about": ABOUT, "jobs": jobs}, indent=2, ensure_ascii=False) + "\n")
    return path


def load(path: Path = SNAPSHOT) -> dict[str, dict[str, Any]]:
    """The snapshot's jobs, by preset."""
    return json.loads(path.read_text())["jobs"]


def wording(line: str) -> str:
    """A line with every number masked: what is compared exactly."""
    return _NUMBER.sub("#", line)


def _close(old: Any, new: Any, rel_tol: float) -> bool:
    if isinstance(old, float) and isinstance(new, float):
        return math.isclose(old, new, rel_tol=rel_tol)
    return old == new


def job_differences(old: dict[str, Any], new: dict[str, Any], rel_tol: float = REL_TOL) -> list[str]:
    """What differs between two entries of one job beyond the tolerance, one line each."""
    out = [] if old["job"] == new["job"] else [f"job: {old['job']!r} -> {new['job']!r}"]
    if [wording(x) for x in old["lines"]] != [wording(x) for x in new["lines"]]:
        out.append(f"lines: {old['lines']!r} -> {new['lines']!r}")
    a, b = old["figures"], new["figures"]
    for key in sorted(a.keys() | b.keys()):
        if not _close(a.get(key), b.get(key), rel_tol):
            out.append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return out


def differences(old: dict[str, dict], new: dict[str, dict], rel_tol: float = REL_TOL) -> list[str]:
    """Every difference between two snapshots' jobs beyond the tolerance, one line each."""
    out = [
        f"{p}: only in the {'snapshot' if p in old else 'planner'}" for p in sorted(old.keys() ^ new.keys())
    ]
    for preset in sorted(old.keys() & new.keys()):
        out += [f"{preset}: {d}" for d in job_differences(old[preset], new[preset], rel_tol)]
    return out
