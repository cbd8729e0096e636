"""What the kit's command-line entry points share: a parser whose errors are one line.

``python -m moe_train.planner.memory``, ``python -m moe_train.planner.compile``,
``python -m moe_train.planner.ep_plan`` and ``python -m moe_train.planner`` take
a model, a cluster preset, nodes, an EP size and ``--set`` overrides; a bad argument is one
``error:`` line on stderr and exit 2 (the kit's rule for bad input), never argparse's usage
block. The tool commands (``bench``, ``gpucheck``, ``study``) also share their ``--out`` option,
comma lists and results folders' names from here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

from moe_train import config

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one ``error:`` line, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.exit(usage_error(message))


def command_parser(prog: str, doc: str | None) -> OneLineParser:
    """The parser of the command ``prog``, described by the first line of its module's ``doc``."""
    return OneLineParser(prog=prog, description=(doc or "").partition("\n")[0])


def usage_error(message: object) -> int:
    """``message`` as the one ``error:`` line on stderr; EXIT_USAGE, the exit code of bad input."""
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def print_out(text: str) -> None:
    """``text`` on stdout; a reader that has gone (``... | head``) ends the output quietly,
    as shell tools do, instead of with a traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def job_arguments(p: argparse.ArgumentParser, cluster_flag: str, cluster_help: str) -> None:
    """--model, the cluster flag, --nodes, --ep and --set, as every job command takes them."""
    p.add_argument("--model", required=True, help=f"model preset: {', '.join(config.list_presets())}")
    p.add_argument(cluster_flag, required=True, help=cluster_help)
    nodes_argument(p)
    ep_argument(p, "expert-parallel size (default parallel.ep)")
    set_argument(p, "train.remat=full")


def job_config(args: argparse.Namespace) -> config.Config:
    """The config of ``job_arguments``' --model, --set and --ep (--ep and a --set of
    ``parallel.ep`` must agree); ConfigError for bad input."""
    flags = {} if args.ep is None else {"--ep": ("parallel.ep", str(args.ep))}
    return config.build(args.model, args.overrides, flags=flags)


def nodes_argument(p: argparse.ArgumentParser) -> None:
    """``--nodes N`` (required): the nodes of the job."""
    p.add_argument("--nodes", type=int, required=True, help="nodes in the job")


def ep_argument(p: argparse.ArgumentParser, help: str) -> None:
    """``--ep N``: the expert-parallel size (None where not given: the model's ``parallel.ep``)."""
    p.add_argument("--ep", type=int, default=None, help=help)


def set_argument(
    p: argparse.ArgumentParser, example: str = "", *, help: str = "", dest: str = "overrides"
) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``dest``: the config overrides every command
    that builds a config takes; ``help`` says what they are (default: a config field's
    override, ``example`` shown)."""
    p.add_argument(
        "--set",
        dest=dest,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=help or f"override a config field, e.g. --set {example} (repeatable)",
    )


def add_out_option(parser: argparse.ArgumentParser, default: str, layout: str) -> None:
    """``--out OUT`` (a ``Path``, default ``default``): results go to ``OUT/<layout>``."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(default),
        help=f"results go to OUT/{layout} (default: {default})",
    )


def utc_stamp() -> str:
    """Now in UTC, as a results folder's name: ``20261207T020304Z``."""
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def comma_list(text: str) -> list[str]:
    """The names of a comma-separated option value, empty ones dropped."""
    return [s for s in text.split(",") if s]
