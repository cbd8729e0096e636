"""``make plan``: the job ``make submit`` would run, with its memory verdict first.

``python -m moe_train.planner --preset CLUSTER --model MODEL --nodes N [--ep N] [--set K=V ...]
[--steps N] [--compute FILE] [--allow-straddle] [--top N] [--json]`` builds the job as the
launcher does (``moe_train.planner.decide``: the trainer's config, the planner's choices, which are the
fastest job of its search that fits, ``moe_train.planner.search``; the placement, the memory plan),
without a site file, an image or Slurm, and prints, in this order:

1. the memory verdict; a job that does not fit names the cheapest change that fits and
   every change tried (``moe_train.planner.memory.verdict``);
2. the trainer command each task runs, with the ``--set`` items the job script carries;
3. what the search found (jobs timed, memory plans made, the fastest that fits against the
   model preset's settings), then each choice and who made it: yours (a ``--set``/``SET=``
   item or ``--ep``, kept as given), the planner's (its note, as ``make submit`` prints it)
   or the model preset's;
4. what the planner timed around the job: every weight-gather mode (step time and memory per
   GPU) and every chunk count (step time), the job's own marked;
5. the placement and predicted step in detail (``moe_train.planner.ep_plan``), then the memory per item.

``--top N`` prints instead the verdict of the job and the N fastest jobs of the search that
fit, as a table (the first is the job ``make submit`` runs): predicted step, tokens/s/GPU,
model TFLOP/s/GPU, MFU, exposed communication, memory per GPU and the settings that differ
from the model preset's, then the published figures for the model and preset.

Exit 0 when the job fits; 2 when it does not (``make submit`` refuses it, exit 2: its verdict
is the first line) and for bad input (one ``error:`` line before anything else, naming the
bad key and the valid choices: e.g. a batch that does not split over the GPUs, with the
nearest sizes that do and the tokens per step each gives).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from moe_train import config
from moe_train.base.calls import from_names
from moe_train.config import cli
from moe_train.planner import choices, layout, memory, search
from moe_train.planner import ep_plan as topo_plan
from moe_train.planner.decide import Decision, decide
from moe_train.planner.memory.__main__ import render as memory_render
from moe_train.planner.memory.__main__ import to_json as memory_json
from moe_train.planner.request import LaunchError, Request, check_twice
from topology.presets import TopologyError

EXIT_DOES_NOT_FIT = cli.EXIT_USAGE  # make submit's refusals, a job that will not fit among them
GIB = 2**30
OUT = "OUT"  # stands in for the run directory make submit picks
PREFIX = choices.PREFIX  # each key's first word, as the choices' notes


@dataclass(frozen=True)
class Timed:
    """One value of a chosen key, as the planner timed it."""

    item: str  # "parallel.weight_gather=step", "moe.overlap_chunks=2"
    step_s: float  # predicted step per GPU, the job's other settings as they are
    total_bytes: int | None  # memory per GPU; None: the job's (overlap chunks do not change it)
    fits: bool | None  # total_bytes within the usable memory; None with total_bytes
    job: bool  # the job's own value


@dataclass(frozen=True)
class Shown:
    """The job ``make plan`` shows."""

    decision: Decision  # config, choices, placement, memory plan
    topology: topo_plan.Plan  # placement, all-to-all and predicted step of the job
    timed: tuple[Timed, ...]  # the alternatives the planner timed
    trainer: tuple[str, ...]  # python -m moe_train arguments of each task (run dir: OUT)


def show(req: Request, top: int = 1) -> Shown:
    """The job for ``req`` (``top``: how many jobs the search ranks); LaunchError /
    TopologyError for a job the launcher refuses."""
    d = decide(req, top)
    try:
        topo = choices.prediction(d.req, d.cfg)
    except config.ConfigError as err:
        raise LaunchError(str(err)) from None
    trainer = layout.trainer_args(d.req, d.cluster, d.cfg, d.ep, Path(OUT), d.per_task)
    return Shown(decision=d, topology=topo, timed=_timed(d, topo.step), trainer=trainer)


def _timed(d: Decision, step) -> tuple[Timed, ...]:
    """Every weight-gather mode with its memory, then every chunk count (none: no step)."""
    if step is None:
        return ()
    out = []
    for mode, s in step.by_gather.items():
        cfg = dataclasses.replace(d.cfg, parallel=dataclasses.replace(d.cfg.parallel, weight_gather=mode))
        try:
            v = memory.plan(cfg, d.cluster, d.req.nodes, search=False).verdict
        except memory.PlanError:
            v = None
        out.append(
            Timed(
                f"{search.GATHER_KEY}={mode}",
                s,
                v.total_bytes if v else None,
                v.fits if v else None,
                mode == d.cfg.parallel.weight_gather,
            )
        )
    out += [
        Timed(f"{search.CHUNKS_KEY}={c}", s, None, None, c == d.cfg.moe.overlap_chunks)
        for c, s in step.by_chunks.items()
    ]
    return tuple(out)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _verdict_lines(d: Decision) -> list[str]:
    v = d.memory.verdict
    lines = [f"memory: {v.message}"]
    if not v.fits:
        lines += [
            f"  {a.change}: {_gib(a.total_bytes)} per GPU, {'fits' if a.fits else 'does not fit'}"
            for a in v.alternatives
        ]
        lines.append("  make submit refuses this job (exit 2; --ignore-memory submits it anyway)")
    return lines


def _choice_line(c: choices.Choice, d: Decision, step) -> str:
    """What the job has for ``c.key`` and who chose it."""
    if c.note:
        return c.note
    head = f"{PREFIX[c.key]}: {c.item}"
    if c.source == choices.USER:
        best = None
        if step is not None and c.key in (search.GATHER_KEY, search.CHUNKS_KEY):
            best = (
                min(step.by_gather, key=step.by_gather.get)
                if c.key == search.GATHER_KEY
                else step.best_chunks
            )
        flag = "--ep or --set" if c.key == search.EP_KEY else "--set"
        return (
            head
            + f", yours ({flag}), kept"
            + (f"; the step-time model favours {best}" if best is not None else "")
        )
    if d.found is None:
        return head + ", the model preset's (nothing predicted for this job)"
    if not d.found.ranked:
        return head + ", the model preset's (no job searched fits)"
    return head + ", the model preset's, kept by the search"


def _timed_lines(timed: tuple[Timed, ...]) -> list[str]:
    if not timed:
        return []
    lines = [
        "timed (predicted step per GPU, the job's other settings as they are; memory "
        "per GPU, which overlap chunks do not change):"
    ]
    for t in timed:
        mem = (
            ""
            if t.total_bytes is None
            else (f"{_gib(t.total_bytes):>12}  {'fits' if t.fits else 'does not fit'}")
        )
        row = f"  {t.item:36}{t.step_s:10.3f} s{mem:28}{'<- the job' if t.job else ''}"
        lines.append(row.rstrip())
    return lines


def render(s: Shown) -> str:
    """The job for humans: the verdict first, the details last."""
    d, req = s.decision, s.decision.req
    gpus = req.nodes * d.cluster.gpus_per_node
    st = s.topology.step
    lines = [
        *_verdict_lines(d),
        f"job: {req.model} on {req.nodes} {d.cluster.name} nodes ({gpus} GPUs), EP {d.ep} x "
        f"FSDP {gpus // d.ep}; what make submit runs in each task:",
        f"  python -m moe_train {shlex.join(s.trainer)}",
        *d.placement,
        "choices (SET= keys stay yours; the planner decides the others):",
        *([f"  {d.search_note}"] if d.search_note else []),
        *[f"  {_choice_line(c, d, st)}" for c in d.choices],
        *_timed_lines(s.timed),
        (
            "predicted: "
            + (
                f"{st.step_s:.3f} s per step, {st.tokens_per_s:,.0f} tokens/s/GPU, MFU "
                f"{st.mfu:.1%}, exposed communication {st.comm_share:.1%}"
                if st
                else "no step time for this job"
            )
            + " (details below)"
        ),
        "",
        topo_plan.render(s.topology, timed=False),
        "",
        _memory_render(d),
    ]
    return "\n".join(lines)


def _memory_render(d: Decision) -> str:
    return memory_render(d.memory, d.req.model)


def _settings_text(c: search.Candidate) -> str:
    return " ".join(c.changes) or "(the model preset's)"


def top_rows(s: Shown) -> list[dict]:
    """The ranked jobs of the search, fastest first, as plain values."""
    found = s.decision.found
    return [
        {
            "step_s": c.step.step_s,
            "tokens_per_s_per_gpu": c.step.tokens_per_s,
            "model_tflops_per_gpu": c.step.model_tflops,
            "mfu": c.step.mfu,
            "exposed_comm_share": c.step.comm_share,
            "total_bytes": c.total_bytes,
            "usable_bytes": c.usable_bytes,
            "changes": list(c.changes),
        }
        for c in (found.ranked if found else ())
    ]


def render_top(s: Shown) -> str:
    """The job's verdict, then the search's fastest jobs that fit as a table."""
    d = s.decision
    gpus = d.req.nodes * d.cluster.gpus_per_node
    found = d.found
    lines = _verdict_lines(d)
    if found is None:
        return "\n".join(
            lines
            + [
                f"search: nothing predicted for {d.req.model} on "
                f"{d.cluster.name} (fp32 compute or a CPU preset)"
            ]
        )
    lines += [
        d.search_note or "",
        f"the fastest jobs that fit, {d.req.model} on {d.req.nodes} {d.cluster.name} "
        f"nodes ({gpus} GPUs); row 1 is the job make submit runs (SET= keys and EP= are "
        f"kept as given):",
        f"  {'#':>2} {'step s':>8} {'tokens/s/GPU':>13} {'TFLOP/s/GPU':>12} {'MFU':>6} "
        f"{'exposed':>8} {'memory GiB':>13}  settings the planner changes",
    ]
    if not found.ranked:
        return "\n".join(
            lines[:-2] + ["no job searched fits: the memory verdict above names the cheapest change"]
        )
    for n, c in enumerate(found.ranked, 1):
        st = c.step
        mem = f"{c.total_bytes / GIB:.1f}/{c.usable_bytes / GIB:.1f}"
        lines.append(
            f"  {n:>2} {st.step_s:>8.2f} {st.tokens_per_s:>13,.0f} "
            f"{st.model_tflops:>12,.0f} {st.mfu:>6.1%} {st.comm_share:>8.1%} "
            f"{mem:>13}  {_settings_text(c)}"
        )
    return "\n".join(lines + [a.line() for a in s.topology.anchors])


def to_json(s: Shown) -> dict:
    """The job as one JSON object."""
    d = s.decision
    return {
        "fits": d.fits,
        "verdict": d.memory.verdict.message,
        "job": {
            "preset": d.cluster.name,
            "model": d.req.model,
            "nodes": d.req.nodes,
            "ep": d.ep,
            "sets": list(d.req.sets),
            "trainer_args": list(s.trainer),
        },
        "choices": [dataclasses.asdict(c) for c in d.choices],
        "timed": [dataclasses.asdict(t) for t in s.timed],
        "placement": list(d.placement),
        "topology": topo_plan.plan_json(s.topology),
        "memory": memory_json(d.memory, d.req.model),
        "search": None
        if d.found is None
        else {
            "note": d.search_note,
            "timed": d.found.timed,
            "judged": d.found.judged,
            "fixed": list(d.found.fixed),
            "ranked": top_rows(s),
        },
    }


def parser() -> argparse.ArgumentParser:
    p = cli.command_parser("python -m moe_train.planner", __doc__)
    p.add_argument("--preset", required=True, help="cluster preset name or a site's cluster .toml")
    p.add_argument("--model", required=True, help="model preset (moe_train/config/presets)")
    cli.nodes_argument(p)
    cli.ep_argument(p, "expert-parallel size (default: the model's parallel.ep)")
    cli.set_argument(p, help="trainer override, as make submit takes it (repeatable)", dest="sets")
    p.add_argument("--steps", type=int, help="total training steps (default: the model preset's)")
    p.add_argument(
        "--compute",
        default="",
        help="compute calibration (make gpu-check writes one; default: "
        "moe_train/planner/compute.toml); the planner's choices use it too",
    )
    p.add_argument(
        "--allow-straddle",
        action="store_true",
        help="accept EP groups that cross NVLink domains (prints the predicted cost)",
    )
    p.add_argument(
        "--top",
        type=int,
        default=0,
        metavar="N",
        help="print the N fastest jobs of the planner's search that fit, as a table "
        "(the first is the job make submit runs)",
    )
    cli.json_argument(p)
    return p


def request(args: argparse.Namespace) -> Request:
    """The request make submit would build from the same arguments; LaunchError if bad."""
    if args.steps is not None and args.steps < 1:
        raise LaunchError(f"--steps must be at least 1, got {args.steps}")
    check_twice(args)
    return from_names(Request, args, sets=tuple(args.sets), dry_run=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.top < 0:
            raise LaunchError(f"--top must be at least 1, got {args.top}")
        shown = show(request(args), max(args.top, 1))
    except (LaunchError, TopologyError) as err:
        return cli.usage_error(err)
    text = (
        json.dumps(to_json(shown), indent=1)
        if args.json
        else render_top(shown)
        if args.top
        else render(shown)
    )
    cli.print_out(text)
    return 0 if shown.decision.fits else EXIT_DOES_NOT_FIT
