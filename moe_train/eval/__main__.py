"""``python -m moe_train.eval RUN_OR_CKPT --data DIR``: held-out loss of saved weights.

RUN_OR_CKPT is a run directory (its newest checkpoint), one step's directory or a converted
checkpoint (``moe_train.convert.weights``); DIR a corpus prepared with ``python -m moe_train.data
prepare``. The val split is scored exactly as a run's ``train.eval_every`` evaluations score
it (``moe_train.eval``, ``moe_train.data.heldout``: the same fixed batches, packed by
document unless the weights' config says ``data.packing=false``), so the printed
``eval_loss`` of a run's checkpoint equals the ``eval_loss`` its run logged at that step (same
``--tokens`` and batch). The model runs without expert parallelism on ``--devices`` devices
(rows split over them); an fp8-trained model is evaluated in bf16 (fp8 scales are training
state). Prints a line as each phase starts (restoring the weights, compiling, scoring), then
the result: one line, or JSON with ``--json`` (then stdout is the JSON alone and the
phases go to stderr). A run's step (or converted weights) is
verified against its manifest first; one without a manifest is refused unless
``--trust-unverified``.

Exit codes: 0; 2 bad weights, data or options (one line).
"""

from __future__ import annotations

import argparse
import json
import sys

from moe_train.base import exits
from moe_train.convert.score import weights_cli
from moe_train.data.packed import resolve_dir
from moe_train.eval import evaluate_weights


def main(argv: list[str] | None = None) -> int:
    return weights_cli(
        argv,
        prog="python -m moe_train.eval",
        description="Held-out loss and perplexity of saved weights.",
        ckpt=("RUN_OR_CKPT", "run directory, step or converted checkpoint"),
        options=_options,
        run=_run,
    )


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, metavar="DIR", help="a prepared corpus (its val split)")
    p.add_argument(
        "--tokens",
        type=int,
        default=0,
        help="held-out tokens to score (default: the run's train.eval_tokens, or 64 sequences)",
    )
    p.add_argument("--batch-size", type=int, default=0, help="sequences per batch (default 8)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _run(args: argparse.Namespace) -> int:
    resolve_dir(args.data, key="--data")  # a bad --data is named as typed, before the weights load
    out = evaluate_weights(
        args.ckpt,
        args.data,
        devices=args.devices,
        batch_size=args.batch_size,
        tokens=args.tokens,
        trust_unverified=args.trust_unverified,
        # progress beside the result on stdout; with --json, stdout is the JSON alone
        log=lambda line: print(line, file=sys.stderr if args.json else sys.stdout, flush=True),
    )
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"eval_loss {out['eval_loss']:.6f}  eval_ppl {out['eval_ppl']:.4f}  "
            f"({out['eval_tokens']} tokens of {out['data']})"
        )
    return exits.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
