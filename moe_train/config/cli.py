"""What the kit's command-line entry points share: a parser whose errors are one line.

``python -m moe_train.planner.memory``, ``python -m moe_train.planner.compile`` and
``python -m moe_train.planner.ep_plan`` take
a model, a cluster preset, nodes, an EP size and ``--set`` overrides; a bad argument is one
``error:`` line on stderr and exit 2 (the kit's rule for bad input), never argparse's usage
block.
"""

from __future__ import annotations

import argparse
import sys

from moe_train import config

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one ``error:`` line, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def job_arguments(p: argparse.ArgumentParser, cluster_flag: str, cluster_help: str) -> None:
    """--model, the cluster flag, --nodes, --ep and --set, as every job command takes them."""
    p.add_argument("--model", required=True, help=f"model preset: {', '.join(config.list_presets())}")
    p.add_argument(cluster_flag, required=True, help=cluster_help)
    p.add_argument("--nodes", type=int, required=True, help="nodes in the job")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default parallel.ep)")
    set_argument(p, "train.remat=full")


def set_argument(p: argparse.ArgumentParser, example: str) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``overrides``: the config overrides every command
    that builds a config takes; ``example`` is shown in the help."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config field, e.g. --set {example} (repeatable)",
    )
