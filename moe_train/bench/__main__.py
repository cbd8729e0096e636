"""``python -m moe_train.bench [--quick] [--only S,...] [--accel [--tiny]] [--out DIR]``.

Runs the benchmark sections and saves ``OUT/<UTC timestamp>/results.{json,md}`` (the
Markdown is also printed). CPU runs (the default) run each group of sections in a child
process with the JAX CPU devices it needs (``SECTION_DEVICES``): the grouped GEMM, layer and
permutation comparisons on one device, as a single-device run sees them (XLA:CPU configured with 8 fake
devices runs the tiled backend's loops about 1.4x slower), the expert-parallel, overlap
(``moe.overlap_chunks``, fp8 dispatch) and compile sections on 8 fake devices; the attention
kernels, the compile time of scanned vs looped layers and the loss's memory against vocab on one
(``--quick`` leaves those three and the overlap section out unless ``--only`` names them).
``--accel`` (``--gpu`` is the same) runs the accelerator benchmark (``moe_train.bench.accel``)
on the default JAX backend, a TPU or a GPU; without one it exits 2 with one line, unless
``--tiny`` (toy sizes, so its code path also runs on CPU). The process owns its JAX setup (set
before any device is touched): run it in its own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from moe_train.config.cli import add_out_option, comma_list, utc_stamp
from moe_train.train import progress

CPU_SECTIONS = ("gemm", "layer", "permute", "ep", "overlap", "compiles", "attention", "scan", "loss")
QUICK_SECTIONS = ("gemm", "layer", "ep", "compiles")  # --quick without --only
SECTION_DEVICES = {
    "gemm": 1,
    "layer": 1,
    "ep": 8,
    "overlap": 8,
    "compiles": 8,
    "attention": 1,
    "scan": 1,
    "loss": 1,
    "permute": 1,
}  # JAX CPU devices per section
# (option, the option it needs): given without the latter, the former is refused, in this order
NEEDS = (
    ("tiny", "accel"),
    ("tune", "accel"),
    ("missing", "tune"),
    ("write_tiles", "tune"),
    ("models", "accel"),
    ("variants", "accel"),
    ("budget_s", "accel"),
)
NEEDS_TEXT = {"accel": "--accel", "tune": "--accel --tune"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (sections, --quick, --accel, --tiny, --out)."""
    ap = argparse.ArgumentParser(
        prog="python -m moe_train.bench", description=(__doc__ or "").partition("\n")[0]
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and fewer configurations (about a minute; used by the tests)",
    )
    ap.add_argument(
        "--only",
        default=None,
        help=f"comma-separated CPU sections to run (default: all of {CPU_SECTIONS}; "
        f"with --quick: {QUICK_SECTIONS})",
    )
    ap.add_argument(
        "--accel",
        action="store_true",
        help="the accelerator benchmark on the TPU or GPU JAX sees: the MoE layer at Mixtral, Qwen3 and "
        "DeepSeek-V3 expert shapes against dense and a plain ragged_dot layer, a MoE train step against "
        "its dense twin, the goals met or not",
    )
    ap.add_argument("--gpu", action="store_true", help="the same as --accel")
    ap.add_argument(
        "--tune",
        action="store_true",
        help="with --accel: the megablox tile sweep (every GEMM's candidate tiles, timed) instead",
    )
    ap.add_argument(
        "--write-tiles",
        action="store_true",
        help="with --tune: write the fastest tiles into the table the megablox backend reads",
    )
    ap.add_argument(
        "--missing",
        action="store_true",
        help="with --tune: only the GEMMs the tile table has no entry for on this device",
    )
    ap.add_argument("--tiny", action="store_true", help="with --accel: toy sizes (runs on CPU too)")
    ap.add_argument(
        "--models",
        default=None,
        help="with --accel: comma-separated expert shapes to run (default: all; "
        "names as the tables print them, e.g. qwen3-30b-a3b)",
    )
    ap.add_argument(
        "--variants",
        default=None,
        help="with --accel: comma-separated layer rows to run beside dense (default: all; "
        "e.g. plain,auto: the goals' rows)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="with --accel: the run's deadline in seconds (later rows are listed as skipped)",
    )
    add_out_option(ap, "runs/bench", "<UTC timestamp>/")
    ap.add_argument("--part", type=Path, default=None, help=argparse.SUPPRESS)  # child: JSON here
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.accel = args.accel or args.gpu
    only = args.only if args.only is not None else ",".join(QUICK_SECTIONS if args.quick else CPU_SECTIONS)
    args.sections = comma_list(only)
    bad = sorted(set(args.sections) - set(CPU_SECTIONS))
    if bad and not args.accel:
        ap.error(f"unknown section(s) {bad}; choose from {CPU_SECTIONS}")
    for flag, needs in NEEDS:
        given = getattr(args, flag)
        if given is not None and given is not False and not getattr(args, needs):
            ap.error(f"--{flag.replace('_', '-')} only applies to {NEEDS_TEXT[needs]}")
    if args.budget_s is not None and args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    return args


def run_accel(args) -> tuple[dict, list[str]]:
    """The accelerator benchmark: a line when it starts, one as each row finishes, a heartbeat
    every 10 s in between (``progress.Waiting``), its time when done."""
    from moe_train.bench import accel, permute, tiles  # flax: after the arguments are checked

    what = "sweeping the megablox tiles" if args.tune else "running the accelerator benchmark"
    # chosen before any line: a bad model name exits 2
    tune_sizes = chosen(tiles.TINY if args.tiny else tiles.FULL, args) if args.tune else None
    accel_sizes = None if args.tune else chosen(accel.TINY if args.tiny else accel.FULL, args)
    every = progress.EVERY_S
    say = lambda line: print(line, flush=True)
    say(f"{what} ...")  # here, before any row: the heartbeat runs in a thread
    with progress.Waiting(say, what, after_s=every, describe=lambda: f"  still {what}: {every:.0f} s"):
        if tune_sizes is not None:
            write = megablox_table() if args.write_tiles else None
            provenance = {
                "commit": git_commit(),
                "command": shlex.join(["python", "-m", "moe_train.bench", *without_out(args.argv)]),
            }
            sec = tiles.run(
                tune_sizes,
                lambda line: say("  tiles: " + line),
                write,
                provenance,
                missing_only=args.missing,
            )
            return {"tiles": sec}, [sec.pop("markdown")]
        assert accel_sizes is not None
        sec = accel.run(accel_sizes, say=lambda line: say("  accel: " + line))
        perm = permute.run(permute.QUICK if args.tiny else permute.ACCEL, with_goal=True)
    return {"accel": sec, "permute": perm}, [sec.pop("markdown"), perm.pop("markdown")]


def chosen(sizes, args):
    """``sizes`` (an accel or tiles ``Sizes``) narrowed to ``--models`` (and ``--variants``) and
    given ``--budget-s``; an unknown name exits 2 with the valid list."""
    changes: dict = {}
    if args.models is not None:
        want = named("--models", "model", args.models, [shape_name(s) for s in sizes.shapes])
        changes["shapes"] = tuple(s for s in sizes.shapes if shape_name(s) in want)
    if args.budget_s is not None:
        changes["budget_s"] = args.budget_s
    if args.variants is not None and hasattr(sizes, "variants"):  # tiles' sizes have none
        from moe_train.bench.accel import variant_names  # flax: after the arguments are checked

        changes["variants"] = named("--variants", "variant", args.variants, variant_names())
    return dataclasses.replace(sizes, **changes)


def named(option: str, what: str, text: str, names) -> tuple[str, ...]:
    """The comma-separated names ``text`` of ``option``, each one of ``names``; else exit 2
    with the valid list."""
    want = comma_list(text)
    bad = sorted(set(want) - set(names))
    if bad or not want:
        said = f"unknown {', '.join(bad)}" if bad else f"no {what} named"
        print(f"{option}: {said}; choose from {', '.join(names)}", file=sys.stderr)
        raise SystemExit(2)
    return tuple(want)


def shape_name(shape) -> str:
    """The model name of one ``Sizes.shapes`` entry: accel's ``Shape`` or tiles' (name, MoEShape)."""
    return shape.name if hasattr(shape, "name") else shape[0]


def without_out(argv: list[str]) -> list[str]:
    """``argv`` less ``--out DIR`` (``--out=DIR``): the command a shipped table records names
    no machine's path."""
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--out="):
            skip = False
            continue
        skip = arg == "--out"
        if not skip:
            out.append(arg)
    return out


def megablox_table() -> Path:
    """The tile table the megablox backend reads (``--write-tiles`` writes it)."""
    from moe_train.moe import megablox  # flax: after the arguments are checked

    return megablox.TILE_FILE


def run_sections(args) -> tuple[dict, list[str]]:
    """Run the chosen sections; returns (JSON sections, Markdown parts)."""
    from moe_train.bench import report  # flax: after the arguments are checked

    if args.accel:
        return run_accel(args)
    from moe_train.bench import (  # flax, optax: as above
        attention,
        compiles,
        ep,
        gemm,
        layer,
        loss,
        overlap,
        permute,
        scan,
    )

    modules = {
        "gemm": (gemm, report.gemm_md),
        "layer": (layer, report.layer_md),
        "ep": (ep, None),
        "overlap": (overlap, None),
        "compiles": (compiles, report.compiles_md),
        "attention": (attention, None),
        "scan": (scan, None),
        "loss": (loss, None),
        "permute": (permute, None),
    }
    sections, parts = {}, []
    for name in args.sections:
        module, md = modules[name]
        # a line when it starts, every 10 s while it runs, and its time when done
        with progress.Waiting(
            lambda line: print(line, flush=True), f"running benchmark section {name}", after_s=0
        ):
            sec = module.run(module.QUICK if args.quick else module.FULL)
        parts.append(sec.pop("markdown") if md is None else md(sec))
        sections[name] = sec
    return sections, parts


def run_part(args) -> int:
    """Child process: run ``args.sections`` (one device group) and write them to ``args.part``."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", SECTION_DEVICES[args.sections[0]])
    sections, parts = run_sections(args)
    args.part.write_text(json.dumps({"sections": sections, "parts": parts}))
    return 0


def run_groups(args) -> tuple[dict, list[str]]:
    """The CPU sections, each device group in its own child process, in the asked order."""
    sections, parts = {}, {}
    for n in sorted({SECTION_DEVICES[s] for s in args.sections}):
        names = [s for s in args.sections if SECTION_DEVICES[s] == n]
        with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
            part = Path(tmp) / "part.json"
            cmd = [
                sys.executable,
                "-m",
                "moe_train.bench",
                "--only",
                ",".join(names),
                "--part",
                str(part),
                *(["--quick"] if args.quick else []),
            ]
            subprocess.run(cmd, check=True)
            got = json.loads(part.read_text())
        sections.update(got["sections"])
        parts.update(zip(names, got["parts"]))
    return ({s: sections[s] for s in args.sections}, [parts[s] for s in args.sections])


def no_accelerator() -> str | None:
    """One line when JAX sees no accelerator (its default backend is the CPU), else None."""
    if jax.default_backend() != "cpu":
        return None
    return (
        "python -m moe_train.bench --accel: no accelerator here (jax.default_backend() is 'cpu'); "
        "--accel --tiny runs its code path on CPU at toy sizes"
    )


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes), or None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, timeout=20
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    """Run, print and save the benchmarks; returns the exit code."""
    args = parse(argv)
    if args.part:
        return run_part(args)
    if not args.accel:
        jax.config.update("jax_platforms", "cpu")
    elif not args.tiny and (refusal := no_accelerator()):
        print(refusal, file=sys.stderr, flush=True)
        return 2
    from moe_train.bench import common, report  # after the device setup

    t0 = time.perf_counter()
    stamp = utc_stamp()
    sections, parts = run_sections(args) if args.accel else run_groups(args)
    items = report.targets(sections)
    given = sys.argv[1:] if argv is None else argv
    results = {
        "created_utc": stamp,
        "argv": given,
        "command": shlex.join([sys.executable, "-m", "moe_train.bench", *given]),
        "git_commit": git_commit(),
        "quick": args.quick,
        "accel": args.accel,
        "tiny": args.tiny,
        "environment": common.environment(),
        "sections": sections,
        "targets": items,
        "wall_s": time.perf_counter() - t0,
    }
    env = results["environment"]
    if not args.accel:
        env["section_devices"] = {s: SECTION_DEVICES[s] for s in args.sections}
    devices = (
        f"{env['devices']} device(s)"
        if args.accel
        else ", ".join(f"{s} on {n} device{'s' if n > 1 else ''}" for s, n in env["section_devices"].items())
    )
    flags = ", ".join(f for f in ("quick", "accel", "tiny") if getattr(args, f))
    header = (
        f"# moe_train benchmarks ({stamp}{', ' + flags if flags else ''})\n\n"
        f"jax {env['jax']} on {env['jax_backend']} ({devices}, "
        f"{env['cpu_count']} CPU cores, {env['cpu_model']}), Python {env['python']}, "
        f"{env['machine']}; wall {results['wall_s']:.0f} s; commit {results['git_commit'] or 'unknown'}.\n"
        f"Command: `{results['command']}`\n"
    )
    markdown = "\n\n".join([header, *([report.targets_md(items)] if items else []), *parts])
    print(markdown, flush=True)
    json_path, _ = common.write_results(args.out / stamp, results, markdown)
    print(f"\nresults: {json_path.parent}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
