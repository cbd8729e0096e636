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
from moe_train.base.calls import from_names
from moe_train.config.cli import options_file
from moe_train.convert.score import weights_cli
from moe_train.data.packed import resolve_dir
from moe_train.eval import evaluate_weights


def main(argv: list[str] | None = None) -> int:
    return weights_cli(argv, options_file(__file__)["eval"], _run)


def _run(args: argparse.Namespace) -> int:
    resolve_dir(args.data, key="--data")  # a bad --data is named as typed, before the weights load

    def log(line: str) -> None:  # progress beside the result on stdout; with --json, stdout is the JSON alone
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    out = from_names(evaluate_weights, args, path=args.ckpt, data_dir=args.data, log=log)
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
