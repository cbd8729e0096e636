"""Command line: ``python -m moe_train --preset NAME --steps N --out DIR [--set k=v ...]``.

Configuration errors are caught before anything compiles or is written: one line on stderr
naming the problem and the valid choices, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from moe_train import config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_train", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny",
                   help=f"model preset: {', '.join(config.list_presets())} (default: tiny)")
    p.add_argument("--out", required=True, type=Path,
                   help="run directory (resumes from its latest checkpoint if there is one)")
    p.add_argument("--steps", type=int, help="total steps (same as --set train.steps=N)")
    p.add_argument("--devices", type=int,
                   help="devices to use; on CPU, that many fake host devices (parallel.devices)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set moe.top_k=4 (repeatable)")
    return p


def resolve(args: argparse.Namespace) -> config.Config:
    extra = list(args.overrides)
    if args.steps is not None:
        extra.append(f"train.steps={args.steps}")
    if args.devices is not None:
        extra.append(f"parallel.devices={args.devices}")
    return config.build(args.preset, extra)


def _quiet_libraries() -> None:
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    logging.getLogger("jax").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = resolve(args)
        import jax

        if cfg.parallel.devices:
            jax.config.update("jax_num_cpu_devices", cfg.parallel.devices)
        _quiet_libraries()
        from moe_train.run import run

        return run(cfg, args.out, log=lambda line: print(line, flush=True))
    except config.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
