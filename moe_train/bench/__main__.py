"""``python -m moe_train.bench [--quick] [--only S,...] [--gpu [--tiny]] [--out DIR]``.

Runs the benchmark sections and saves ``OUT/<UTC timestamp>/results.{json,md}`` (the
Markdown is also printed). CPU runs (the default) run each group of sections in a child
process with the JAX CPU devices it needs (``SECTION_DEVICES``): the grouped GEMM and layer
comparisons on one device, as a single-device run sees them (XLA:CPU configured with 8 fake
devices runs the tiled backend's loops about 1.4x slower), the expert-parallel, overlap
(``moe.overlap_chunks``, fp8 dispatch) and compile sections on 8 fake devices; the attention
kernels, the compile time of scanned vs looped layers and the loss's memory against vocab on one
(``--quick`` leaves those three and the overlap section out unless ``--only`` names them).
``--gpu`` runs the GPU section on the default JAX backend
(``--tiny``: toy sizes, so the GPU code path also runs on CPU). The process owns its JAX
setup (set before any device is touched): run it in its own process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

CPU_SECTIONS = ("gemm", "layer", "ep", "overlap", "compiles", "attention", "scan", "loss")
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
}  # JAX CPU devices per section


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (sections, --quick, --gpu, --tiny, --out)."""
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
        "--gpu",
        action="store_true",
        help="the GPU section only (Mixtral/DeepSeek experts in bf16, per backend)",
    )
    ap.add_argument("--tiny", action="store_true", help="with --gpu: toy sizes (runs on CPU too)")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("runs/bench"),
        help="results go to OUT/<UTC timestamp>/ (default: runs/bench)",
    )
    ap.add_argument("--part", type=Path, default=None, help=argparse.SUPPRESS)  # child: JSON here
    args = ap.parse_args(argv)
    only = args.only if args.only is not None else ",".join(QUICK_SECTIONS if args.quick else CPU_SECTIONS)
    args.sections = [s for s in only.split(",") if s]
    bad = sorted(set(args.sections) - set(CPU_SECTIONS))
    if bad and not args.gpu:
        ap.error(f"unknown section(s) {bad}; choose from {CPU_SECTIONS}")
    if args.tiny and not args.gpu:
        ap.error("--tiny only applies to --gpu")
    return args


def run_sections(args) -> tuple[dict, list[str]]:
    """Run the chosen sections; returns (JSON sections, Markdown parts)."""
    from moe_train.bench import report
    from moe_train.train import progress

    if args.gpu:
        from moe_train.bench import gpu

        if jax.default_backend() != "gpu" and not args.tiny:
            raise SystemExit(
                "no GPU here (jax.default_backend() is "
                f"{jax.default_backend()!r}); --gpu --tiny runs the code path on CPU"
            )
        sec = gpu.run(gpu.TINY if args.tiny else gpu.FULL)
        return {"gpu": sec}, [report.gpu_md(sec)]
    from moe_train.bench import attention, compiles, ep, gemm, layer, loss, overlap, scan

    modules = {
        "gemm": (gemm, report.gemm_md),
        "layer": (layer, report.layer_md),
        "ep": (ep, None),
        "overlap": (overlap, None),
        "compiles": (compiles, report.compiles_md),
        "attention": (attention, None),
        "scan": (scan, None),
        "loss": (loss, None),
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


def main(argv: list[str] | None = None) -> int:
    """Run, print and save the benchmarks; returns the exit code."""
    args = parse(argv)
    if args.part:
        return run_part(args)
    if not args.gpu:
        jax.config.update("jax_platforms", "cpu")
    from moe_train.bench import common, report  # after the device setup

    t0 = time.perf_counter()
    stamp = common.utc_stamp()
    sections, parts = run_sections(args) if args.gpu else run_groups(args)
    items = report.targets(sections)
    results = {
        "created_utc": stamp,
        "argv": sys.argv[1:] if argv is None else argv,
        "quick": args.quick,
        "gpu": args.gpu,
        "tiny": args.tiny,
        "environment": common.environment(),
        "sections": sections,
        "targets": items,
        "wall_s": time.perf_counter() - t0,
    }
    env = results["environment"]
    if not args.gpu:
        env["section_devices"] = {s: SECTION_DEVICES[s] for s in args.sections}
    devices = (
        f"{env['devices']} device(s)"
        if args.gpu
        else ", ".join(f"{s} on {n} device{'s' if n > 1 else ''}" for s, n in env["section_devices"].items())
    )
    flags = ", ".join(f for f in ("quick", "gpu", "tiny") if getattr(args, f))
    header = (
        f"# moe_train benchmarks ({stamp}{', ' + flags if flags else ''})\n\n"
        f"jax {env['jax']} on {env['jax_backend']} ({devices}, "
        f"{env['cpu_count']} CPU cores, {env['cpu_model']}), Python {env['python']}, "
        f"{env['machine']}; wall {results['wall_s']:.0f} s.\n"
    )
    markdown = "\n\n".join([header, *([report.targets_md(items)] if items else []), *parts])
    print(markdown, flush=True)
    json_path, _ = common.write_results(args.out / stamp, results, markdown)
    print(f"\nresults: {json_path.parent}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
