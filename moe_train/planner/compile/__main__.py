"""``python -m moe_train.planner.compile``: compile the job's train step for its GPU without one.

Exit codes: 0 compiled (whether or not it fits: the table says), 2 bad input or no plugin
(one ``error:`` line on stderr naming the valid choices or how to install it), 130 Ctrl-C
(one line, at once, even in the middle of XLA:GPU's compile; no report is written).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moe_train.config.cli import command_parser, job_arguments, json_argument, usage_error
from moe_train.planner.compile import job as job_mod
from moe_train.planner.compile import plugin
from moe_train.planner.request import Request
from topology import presets

if TYPE_CHECKING:
    from moe_train.planner.compile.job import Job


def parser() -> argparse.ArgumentParser:
    p = command_parser("python -m moe_train.planner.compile", __doc__)
    job_arguments(p, "--preset", f"cluster preset ({', '.join(presets.list_presets())}) or a site .toml")
    p.add_argument("--steps", type=int, help="train.steps, as for make submit (changes only the LR schedule)")
    p.add_argument(
        "--layers", type=int, help="compile at reduced depth: model.num_layers=N (said in the output)"
    )
    p.add_argument(
        "--bucket",
        default="",
        help="compile only this capacity bucket (1, 1.25, ..., worst; planned: the "
        "one the memory planner judges the job by); default: every bucket",
    )
    p.add_argument(
        "--peak",
        action="store_true",
        help="dump XLA's buffer assignment and print what fills each bucket's peak "
        "(by source scope); the dump stays in the run directory (xla/)",
    )
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="print the memory planner's total per bucket (the report's planner column) and "
        "compile nothing (seconds; needs no plugin)",
    )
    p.add_argument("--out", default="runs/compile", help="parent of the <UTC> run directory")
    json_argument(p)
    return p


# set by `make compile` when PRESET was not given: the preset is the Makefile's default, not the user's
PRESET_DEFAULTED_ENV = "MOE_TRAIN_PRESET_DEFAULTED"


def _defaulted_preset(preset: str) -> str:
    with_gpu = [name for name in presets.list_presets() if presets.load(name).gpu]
    return (
        f"make compile needs a GPU cluster preset: PRESET was not given, and the Makefile's default, "
        f"{preset}, names no GPU; pass PRESET=<a GPU preset>: {', '.join(with_gpu)}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:  # the preset's XLA_FLAGS go to XLA before jax starts: read the preset first
        cluster = presets.load(args.preset)
    except presets.TopologyError as err:
        return usage_error(err)
    if not cluster.gpu and os.environ.get(PRESET_DEFAULTED_ENV):
        return usage_error(_defaulted_preset(args.preset))
    with plugin.quiet():
        return _compile(args, cluster)


def _compile(args: argparse.Namespace, cluster: presets.Cluster) -> int:
    missing = plugin.enable(cluster.env.get("XLA_FLAGS", ""))  # before anything imports jax

    try:
        job = job_mod.configure(
            args.model, args.preset, args.nodes, args.ep, tuple(args.overrides), args.layers, args.steps
        )
    except job_mod.ERRORS as err:
        return usage_error(err)
    if args.plan_only:
        print("\n".join(job_mod.planner_lines(job)))
        return 0
    if missing:
        return usage_error(missing)
    from moe_train.planner.compile import run  # JAX: after plugin.enable points it at XLA:GPU

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    try:
        result, out_dir = run.compile_job(job, Path(args.out) / stamp, args.bucket, args.peak)
    except job_mod.ERRORS as err:
        return usage_error(err)
    _cache_planned(args, job, result)
    print(json.dumps(result, indent=1) if args.json else f"{run.render(result)}\nwritten: {out_dir}")
    return 0


def _cache_planned(args: argparse.Namespace, job: Job, result: dict) -> None:
    """A full-depth compile of the planned bucket goes into the submit preflight's cache,
    where ``make plan`` and ``make submit`` find it: its peak decides their memory verdict
    (``moe_train.planner.preflight``; not under COMPILE=0, nor at ``--layers``, which is another job)."""
    from moe_train.planner import preflight  # after plugin.enable, as everything here that may import jax

    planned = [b for b in result["buckets"] if b["bucket"] == job.plan.estimate.bucket]
    if args.layers is not None or not planned or os.environ.get(preflight.ENV, "1") == "0":
        return
    req = Request(preset=args.preset, model=args.model, nodes=args.nodes)
    preflight.store(req, job.cfg, {**result, "buckets": planned}, compiled_by="make compile")


EXIT_INTERRUPTED = 130
INTERRUPTED = "error: interrupted by Ctrl-C; no compile report was written (rerun to compile again)"


def ctrl_c_ends_at_once() -> None:
    """Ctrl-C prints one line and exits 130 at once. Python's own handler raises
    KeyboardInterrupt only when XLA:GPU's compile (C++, minutes) returns, and then prints a
    traceback of hundreds of lines; here the signal's byte on a wakeup socket wakes a thread
    that ends the process. Its line goes to stderr as it was at the start (the plugin's and
    XLA's filters take file descriptor 2 over later)."""
    stderr = os.dup(2)
    wake, woken = socket.socketpair()
    wake.setblocking(False)
    signal.set_wakeup_fd(wake.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, lambda *_: None)  # Python does nothing; the thread acts

    def watch() -> None:
        with wake, woken:  # held open by this thread for the process's life
            while signal.SIGINT not in woken.recv(64):
                pass
        os.write(stderr, (INTERRUPTED + "\n").encode())
        os._exit(EXIT_INTERRUPTED)

    threading.Thread(target=watch, name="moe_train-ctrl-c", daemon=True).start()


if __name__ == "__main__":
    ctrl_c_ends_at_once()
    sys.exit(main())
