"""``make compute-shares``: the step-time model's overlap shares in compute.toml, regenerated.

``python -m moe_train.planner.overlap_shares`` reads them from ``make compile`` runs.

Each job of ``overlap_jobs.toml`` is compiled by XLA:GPU without a GPU (``python -m
moe_train.planner.compile``, bucket 1x, full depth unless ``--layers``) once per overlap chunk
count it lists; the share of each collective kind that the GEMMs XLA placed under it can hide
is read from that compile's schedule (its ``hidden`` rows, ``compile.report.rows``). The
shares measured at 1, 2, 4 and 8 chunks are one share (their mean, under the chunk-less name
``compute.FAMILIES`` reads) where they lie within ``SPREAD`` of one another, else one per count;
a model's table keeps only the shares that differ from the defaults by more than ``SPREAD``.
The file is written whole: a header naming the jax version, the date and the jobs, the
measured efficiencies of ``[compute]`` that no compile measures kept as they were, each share
with a source saying which compile gave it.

Compiles are kept under ``--results`` (``<job>/<n>chunks.json``, with the arguments that made
each in ``<n>chunks.args``) and reused by a later run with the same folder and the same job:
a run that stopped goes on where it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from moe_train.base.tomlfile import read_toml
from moe_train.config.cli import command_parser, usage_error
from moe_train.planner import compute
from moe_train.planner.steptime import STEP_PARTS
from topology.presets import TopologyError

JOBS = Path(__file__).with_name("overlap_jobs.toml")
SPREAD = 0.05  # shares closer than this (of the transfer) are one share: a few percent is noise
# of the schedule between neighbouring programs, well inside the model's other errors
GIVES = {  # what a job measures -> {compile report row: compute field, "{n}" the chunk count}
    "micro_batch": {"fsdp": "fsdp_hidden_micro_batch", "all-to-all": "a2a_hidden_{n}"},
    "step": {
        "all-to-all": "a2a_hidden_step_{n}",
        **{part: f"fsdp_hidden_step_{part}_{{n}}" for part in STEP_PARTS},
    },
    "hierarchical": {"all-to-all": "a2a_hidden_hierarchical_{n}"},
}
# the efficiencies no compile measures (each with its own source): kept from the file replaced
KEPT = (
    "gemm_efficiency",
    "grouped_gemm_efficiency",
    "fp8_gemm_efficiency",
    "attention_efficiency",
    "hbm_efficiency",
)


@dataclasses.dataclass(frozen=True)
class Job:
    """One measured compile job of ``overlap_jobs.toml`` (its header says what each field is)."""

    name: str  # the results folder
    preset: str  # cluster preset
    model: str  # model preset
    nodes: int  # nodes of the job
    ep: int  # expert-parallel size
    sets: tuple[str, ...]  # pinned --set items
    chunks: tuple[int, ...]  # moe.overlap_chunks values compiled
    gives: str  # a key of GIVES
    table: str  # "": the defaults; else the model table it writes

    def describe(self) -> str:
        keys = ", ".join(s.replace("parallel.", "").replace("train.", "") for s in self.sets)
        return f"{self.model} on {self.nodes} {self.preset} nodes (EP {self.ep}, {keys}, bucket 1x)"


def load_jobs(path: Path) -> list[Job]:
    """The jobs of ``path``; TopologyError naming the bad key."""
    rows = read_toml(path, TopologyError).get("job", [])
    fields = {f.name for f in dataclasses.fields(Job)}
    jobs = []
    for i, row in enumerate(rows):
        if set(row) != fields:
            bad = sorted(set(row) ^ fields)[0]
            raise TopologyError(
                f"{path}: job[{i}] key {bad!r}: each [[job]] has exactly {', '.join(sorted(fields))}"
            )
        if row["gives"] not in GIVES:
            raise TopologyError(f"{path}: job[{i}].gives {row['gives']!r}; valid: {', '.join(GIVES)}")
        if row["gives"] != "hierarchical" and not set(row["chunks"]) <= set(compute.MEASURED_CHUNKS):
            raise TopologyError(f"{path}: job[{i}].chunks must be among {compute.MEASURED_CHUNKS}")
        jobs.append(Job(**{**row, "sets": tuple(row["sets"]), "chunks": tuple(row["chunks"])}))
    if not jobs:
        raise TopologyError(f"{path}: no [[job]] tables")
    return jobs


def compile_args(job: Job, chunks: int, layers: int | None, out: Path) -> list[str]:
    """``python -m moe_train.planner.compile`` arguments of ``job`` at ``chunks`` chunks."""
    args = ["--preset", job.preset, "--model", job.model, "--nodes", str(job.nodes), "--ep", str(job.ep)]
    for item in (*job.sets, f"moe.overlap_chunks={chunks}"):
        args += ["--set", item]
    args += ["--bucket", "1", "--json", "--out", str(out)]
    return args + (["--layers", str(layers)] if layers else [])


def measured(job: Job, chunks: int, results: Path, layers: int | None, say: Callable[[str], None]) -> dict:
    """The compile record of ``job`` at ``chunks``: one kept in ``results`` when it was
    compiled with the same arguments (``<n>chunks.args`` beside it), else a new compile."""
    path = results / job.name / f"{chunks}chunks.json"
    same = shlex.join(compile_args(job, chunks, layers, Path("OUT")))
    args_file = path.with_suffix(".args")
    if path.is_file() and args_file.is_file() and args_file.read_text().strip() == same:
        say(f"  {job.name}, {chunks} chunk(s): kept from {path}")
        return json.loads(path.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    say(f"  {job.name}, {chunks} chunk(s): compiling {job.describe()} ...")
    args = compile_args(job, chunks, layers, path.parent / "runs")
    proc = subprocess.run(  # its progress lines go to our stderr
        [sys.executable, "-m", "moe_train.planner.compile", *args], stdout=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        what = f"{job.name} at {chunks} chunk(s)"
        raise TopologyError(f"make compile failed for {what} (exit {proc.returncode}; its error is above)")
    path.write_text(proc.stdout)
    args_file.write_text(same + "\n")
    return json.loads(proc.stdout)


def shares_of(job: Job, records: dict[int, dict]) -> dict[str, list[tuple[int, float]]]:
    """Field -> (chunks, share hidden) its rows measured, from each chunk count's compile record
    (``records``: chunks -> record); a field without a chunk count gets one per compile."""
    out: dict[str, list[tuple[int, float]]] = {}
    for chunks, record in records.items():
        (bucket,) = record["buckets"]
        rows = bucket.get("hidden") or {}
        n = f"{chunks}chunk{'s' if chunks > 1 else ''}"
        for row, field in GIVES[job.gives].items():
            if row in rows:
                out.setdefault(field.format(n=n), []).append((chunks, rows[row]["share"]))
    return out


def collapsed(values: dict[str, float]) -> dict[str, float]:
    """``values`` with each family measured at every chunk count within ``SPREAD`` of one
    another given once, where its first count stood: their mean, under its chunk-less name
    (``compute.FAMILIES``)."""
    one = {}
    for name, members in compute.FAMILIES.items():
        got = [values[f] for f in members if f in values]
        if len(got) == len(members) and max(got) - min(got) <= SPREAD:
            one[members[0]] = (name, sum(got) / len(got))
    folded = {f for name, _ in one.values() for f in compute.FAMILIES[name]}
    out = {}
    for field, value in values.items():
        if field in one:
            name, mean = one[field]
            out[name] = round(mean, 3)
        elif field not in folded:
            out[field] = round(value, 3)
    return out


def differing(table: dict[str, float], defaults: dict[str, float]) -> dict[str, float]:
    """The model's shares (per-chunk fields) that differ from the defaults' by more than
    ``SPREAD``; a family is kept whole where any of its counts differs."""
    keep = {k for k, v in table.items() if abs(v - defaults[k]) > SPREAD}
    for members in compute.FAMILIES.values():
        if keep & set(members):
            keep |= set(members) & set(table)
    return {k: v for k, v in table.items() if k in keep}


def _percent(points: list[tuple[int, float]]) -> str:
    return ", ".join(f"{c} chunk{'s' if c > 1 else ''} {v:.1%}" for c, v in points)


def regenerate(jobs: list[Job], results: Path, layers: int | None, say: Callable[[str], None]) -> dict:
    """Every job compiled (or kept) and its shares: {"defaults": {field: value}, "models":
    {model: {field: value}}, "source": {(table, key): text}, "flags": {preset: XLA_FLAGS}, "jax",
    "day"} (``table`` "" for the defaults)."""
    day, jax_version = dt.date.today().isoformat(), metadata.version("jax")
    values: dict[str, dict[str, float]] = {}
    source: dict[tuple[str, str], str] = {}
    flags: dict[str, str] = {}
    for job in jobs:
        records = {c: measured(job, c, results, layers, say) for c in job.chunks}
        flags[job.preset] = next(iter(records.values())).get("xla_flags", "")
        for field, points in shares_of(job, records).items():
            values.setdefault(job.table, {})[field] = sum(v for _, v in points) / len(points)
            source[job.table, field] = (
                f"measured deviceless (make compile, jax {jax_version}, {day}, the preset's XLA_FLAGS) on "
                f"{job.describe()}{'' if layers is None else f' at {layers} layers'}: {_percent(points)}"
            )
    defaults = values.pop("", {})
    found = {"defaults": defaults, "models": values, "source": source, "flags": flags}
    return found | {"jax": jax_version, "day": day}


def _source(key: str, notes: dict[str, str]) -> str:
    """The source of ``key`` (a field or a chunk-less family) from each field's ``notes``."""
    texts = list(dict.fromkeys(notes[f] for f in compute.FAMILIES.get(key, (key,)) if f in notes))
    if len(texts) == 1:
        return texts[0]
    head = texts[0].partition(": ")[0]
    rest = "; ".join(t.partition(": ")[2] for t in texts)
    return f"{head}: one share for every chunk count (within {SPREAD} of one another): {rest}"


def _table(name: str, values: dict[str, float], notes: dict[str, str]) -> list[str]:
    """``[name]`` and ``[name.source]`` of ``values`` (chunk families within ``SPREAD`` once)."""
    shares = collapsed(values)
    return [
        f"[{name}]",
        *(f"{k} = {v}" for k, v in shares.items()),
        "",
        f"[{name}.source]",
        *(f"{k} = {json.dumps(_source(k, notes))}" for k in shares),
    ]


def render(found: dict, base: Path, jobs: list[Job]) -> str:
    """The whole compute file: the header, ``[compute]`` (``KEPT`` and every share no job
    measured as ``base`` has them, the measured defaults) and each model's table."""
    old = compute.load(base)  # every field, chunk families expanded
    shares = {f: getattr(old, f) for f in compute.OVERLAP_FIELDS} | found["defaults"]
    notes = {f: old.source.get(f, "") for f in compute.OVERLAP_FIELDS if f not in found["defaults"]}
    notes |= {f: text for (table, f), text in found["source"].items() if table == ""}
    lines = [
        "# Compute efficiencies of the step-time prediction (moe_train.planner.steptime, `make plan`):",
        "# the share of a peak each kind of work reaches, and the share of each collective's transfer",
        "# the GEMMs XLA:GPU places under it hide. A file of the same form replaces it",
        "# (`make plan COMPUTE=FILE`, e.g. one `make gpu-check` writes from its measurements).",
        "# The overlap shares are generated by `python -m moe_train.planner.overlap_shares`",
        f"# (make compute-shares) on {found['day']} with jax {found['jax']}, from these make compile",
        "# jobs (overlap_jobs.toml); edit the jobs, not the shares:",
        *(f"#   {j.name}: {j.describe()}, chunks {', '.join(map(str, j.chunks))}" for j in jobs),
        "# with the presets' XLA_FLAGS:",
        *(f"#   {preset}: {text}" for preset, text in found["flags"].items()),
        f"# The first {len(KEPT)} efficiencies no compile measures: kept from the file this one replaced.",
    ]
    kept = {k: getattr(old, k) for k in KEPT}
    lines += _table("compute", kept | shares, {k: old.source.get(k, "") for k in KEPT} | notes)
    for model, table in found["models"].items():
        mine = differing(table, shares)
        model_notes = {f: text for (t, f), text in found["source"].items() if t == model}
        lines += ["", *_table(f"model.{model}", mine, model_notes)] if mine else []
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = command_parser("python -m moe_train.planner.overlap_shares", __doc__)
    p.add_argument("--jobs", type=Path, default=JOBS, help="the measured jobs (default: overlap_jobs.toml)")
    p.add_argument(
        "--results", type=Path, default=Path("runs/overlap-shares"), help="where compiles are kept and reused"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=compute.DEFAULTS,
        help="the compute file written (default: the shipped one)",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="compile at this depth (tests; the shares are full depth's)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        jobs = load_jobs(args.jobs)
        base = args.out if args.out.is_file() else compute.DEFAULTS
        count = sum(len(j.chunks) for j in jobs)
        say(f"overlap shares: {count} compiles of {len(jobs)} jobs (minutes each at full depth) ...")
        text = render(regenerate(jobs, args.results, args.layers, say), base, jobs)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text)
        compute.load(tmp)  # the file it writes is one make plan reads, or nothing is replaced
        os.replace(tmp, args.out)
    except TopologyError as err:
        return usage_error(err)
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
