"""``python -m moe_train.gpucheck [--out runs/gpucheck] [--only S,...]`` (``make gpu-check``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import Any

from moe_train.base.tomlfile import read_toml
from moe_train.config.cli import add_out_option, comma_list, utc_stamp
from moe_train.gpucheck import Context, Section, budget_scale, failed, heartbeat, run_section, say, write

# The sections in order, each {name, title, budget_s, run} (the file says what they mean).
SECTIONS_FILE = Path(__file__).with_name("sections.toml")
SECTION_TABLE: tuple[dict[str, Any], ...] = tuple(read_toml(SECTIONS_FILE, ValueError)["section"])
SECTION_NAMES = tuple(sec["name"] for sec in SECTION_TABLE)


def _runner(path: str) -> Callable[[Context], dict[str, Any]]:
    """The function ``module.function`` of ``moe_train.gpucheck`` (JAX: after main() sets its env)."""
    module, function = path.split(".")
    return getattr(import_module(f"moe_train.gpucheck.{module}"), function)


def sections() -> list[Section]:
    """The sections of ``SECTION_TABLE`` in order, each with its function."""
    return [Section(sec["name"], sec["title"], sec["budget_s"], _runner(sec["run"])) for sec in SECTION_TABLE]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m moe_train.gpucheck", description="What works on this GPU node, and how fast."
    )
    add_out_option(ap, "runs/gpucheck", "<UTC>/results.{json,md}")
    ap.add_argument(
        "--only",
        default=",".join(SECTION_NAMES),
        help=f"comma-separated sections (default: all of {', '.join(SECTION_NAMES)})",
    )
    args = ap.parse_args(argv)
    args.only = comma_list(args.only)
    bad = sorted(set(args.only) - set(SECTION_NAMES))
    if bad:
        ap.error(f"unknown section(s) {', '.join(bad)}; choose from {', '.join(SECTION_NAMES)}")
    return args


def markdown(results: dict) -> str:
    from moe_train.gpucheck.report import render  # JAX: after main() sets its env

    return render(results)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # grow GPU memory as needed (not 75% up front): the trainer runs are child processes
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    stamp = utc_stamp()
    out_dir = args.out / stamp
    platform, count = jax.default_backend(), len(jax.devices())
    results = {
        "created_utc": stamp,
        "platform": platform,
        "device_kind": jax.devices()[0].device_kind,
        "devices": count,
        "sections": [],
    }
    t0, scale, spare = time.perf_counter(), budget_scale(platform), 0.0
    for sec in (s for s in sections() if s.name in args.only):
        budget = sec.budget_s * scale + spare  # with what the sections before left unused
        say(f"{sec.name}: {sec.title} (budget {budget:.0f} s)")
        with heartbeat(f"running section {sec.name}"):
            res = run_section(
                sec,
                lambda _, budget=budget: Context(
                    platform,
                    count,
                    out_dir,
                    time.perf_counter() + budget,
                    results["device_kind"],
                    tuple(results["sections"]),
                ),
            )
        res["budget_s"] = budget
        spare = max(0.0, budget - res["seconds"])
        results["sections"].append(res)
        results["wall_s"] = time.perf_counter() - t0
        write(out_dir, results, markdown(results))
        say(
            f"{sec.name}: {res['status']} in {res['seconds']:.1f} s"
            + (f" ({res['reason']})" if res.get("reason") else "")
        )
    print(markdown(results), flush=True)
    print(f"results: {out_dir}", flush=True)
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
