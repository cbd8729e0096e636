"""``python -m moe_train.convert from-hf HF_DIR OUT`` | ``to-hf CKPT HF_OUT [--dtype bf16|fp32]``.

Exit codes as the trainer's (``moe_train.base.exits``): 0 done; 2 bad input (an unsupported
architecture or feature, a missing tensor, a shape that does not match the config, an OUT
that is not empty, an input file that cannot be read, a non-finite weight, a checkpoint or
converted weights that are damaged or have no manifest: ``to-hf --trust-unverified`` reads the
latter), one line naming the key,
tensor or file, nothing left in OUT; 5 the output cannot be written; 1 a bug (traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from moe_train.base import exits
from moe_train.config import ConfigError
from moe_train.config.cli import add_options, options_file


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_train.convert",
        description="Convert checkpoints between Hugging Face and the kit.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    options = options_file(__file__)
    for name in ("from-hf", "to-hf"):
        add_options(sub.add_parser(name, help=options[name]["help"]), options[name])
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "from-hf":
            from moe_train.convert.from_hf import from_hf  # JAX and orbax: after the arguments are checked

            from_hf(args.hf_dir, args.out, workers=max(1, args.workers))
        else:
            from moe_train.convert.to_hf import to_hf  # JAX and orbax: after the arguments are checked

            to_hf(args.ckpt, args.out, dtype=args.dtype, trust_unverified=args.trust_unverified)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return exits.EXIT_CONFIG
    except OSError as err:
        if _in_output(err, args.out):
            print(f"error: cannot write the output: {err}", file=sys.stderr)
            return exits.EXIT_OUTPUT
        print(f"error: cannot read the input: {err}", file=sys.stderr)
        return exits.EXIT_CONFIG
    return exits.EXIT_OK


def _in_output(err: OSError, out: str) -> bool:
    """Whether ``err`` is about OUT or its ``.OUT.partial-<pid>`` sibling (else: an input)."""
    if not err.filename:
        return True  # e.g. no space left while writing
    target, path = Path(out).absolute(), Path(os.fsdecode(err.filename)).absolute()
    return (
        path == target
        or target in path.parents
        or any(
            p.parent == target.parent and p.name.startswith(f".{target.name}.partial-")
            for p in (path, *path.parents)
        )
    )


if __name__ == "__main__":
    sys.exit(main())
