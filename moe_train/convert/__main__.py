"""``python -m moe_train.convert from-hf HF_DIR OUT`` | ``to-hf CKPT HF_OUT [--dtype bf16|fp32]``.

Exit codes as the trainer's (``moe_train.signals``): 0 done; 2 bad input (an unsupported
architecture or feature, a missing tensor, a shape that does not match the config, an OUT
that is not empty), one line naming the key or tensor, nothing left in OUT; 5 the output
cannot be written; 1 a bug (traceback).
"""

from __future__ import annotations

import argparse
import sys

from moe_train import signals
from moe_train.config import ConfigError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_train.convert",
                                description="Convert checkpoints between Hugging Face and the kit.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    a = sub.add_parser("from-hf", help="a Hugging Face checkpoint -> preset.toml + orbax weights")
    a.add_argument("hf_dir", metavar="HF_DIR", help="config.json and *.safetensors")
    a.add_argument("out", metavar="OUT", help="new (or empty) output directory")
    a.add_argument("--workers", type=int, default=1,
                   help="processes that split the layers between them (each holds about one "
                        "layer in memory; default 1)")
    b = sub.add_parser("to-hf", help="kit weights -> a Hugging Face checkpoint directory")
    b.add_argument("ckpt", metavar="CKPT", help="a converted checkpoint, a run directory or a step")
    b.add_argument("out", metavar="HF_OUT", help="new (or empty) output directory")
    b.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                   help="tensor dtype of the safetensors files (default bf16)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "from-hf":
            from moe_train.convert.from_hf import from_hf

            from_hf(args.hf_dir, args.out, workers=max(1, args.workers))
        else:
            from moe_train.convert.to_hf import to_hf

            to_hf(args.ckpt, args.out, dtype=args.dtype)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return signals.EXIT_CONFIG
    except OSError as err:
        print(f"error: cannot write the output: {err}", file=sys.stderr)
        return signals.EXIT_OUTPUT
    return signals.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
