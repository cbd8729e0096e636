"""What the kit's command-line entry points share: a parser whose errors are one line.

``python -m moe_train.planner.memory``, ``python -m moe_train.planner.compile``,
``python -m moe_train.planner.ep_plan`` and ``python -m moe_train.planner`` take
a model, a cluster preset, nodes, an EP size and ``--set`` overrides; a bad argument is one
``error:`` line on stderr and exit 2 (the kit's rule for bad input), never argparse's usage
block. The tool commands (``bench``, ``gpucheck``, ``study``) also share their ``--out`` option,
comma lists and results folders' names from here. Commands that declare their options as data
(an ``options.toml`` beside them: ``data prepare``, ``eval``, ``score``, ``convert``) have them
read and added here (``options_file``, ``add_options``), and pass them on to the function they
call by name (``moe_train.base.calls.from_names``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from moe_train import config
from moe_train.base.tomlfile import read_toml

EXIT_USAGE = 2
# the argument types an options table names (add_options)
TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "path": Path}


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


def json_argument(p: argparse.ArgumentParser) -> None:
    """``--json``: print the command's result as one JSON object (the planner commands)."""
    p.add_argument("--json", action="store_true", help="print one JSON object")


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


def options_file(module: str) -> dict[str, Any]:
    """The options tables of the commands of ``module`` (pass ``__file__``): the
    ``options.toml`` beside it, one table a command."""
    return read_toml(Path(module).with_name("options.toml"), ValueError)


def add_options(
    p: argparse.ArgumentParser, table: dict[str, Any], values: Mapping[str, object] | None = None
) -> None:
    """A command's options table (its ``[[<command>.option]]`` rows) as ``add_argument`` calls,
    in its order: each row is ``flag`` (or a positional's name), then argparse's keywords, with
    ``type`` one of TYPES' names and each ``{NAME}`` in ``help`` ``values[NAME]``. Rows that
    name the same ``exclusive`` group exclude each other; the table's ``exclusive`` says, for
    each group, whether one of its options is required."""
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for row in table["option"]:
        kw = dict(row)
        flag, group = kw.pop("flag"), kw.pop("exclusive", "")
        if "type" in kw:
            kw["type"] = TYPES[kw["type"]]
        if "help" in kw:
            kw["help"] = kw["help"].format_map(values or {})
        if group and group not in groups:
            groups[group] = p.add_mutually_exclusive_group(required=table["exclusive"][group])
        (groups[group] if group else p).add_argument(flag, **kw)
