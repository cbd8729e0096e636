"""``python -m moe_train.eval RUN_OR_CKPT --data DIR``: held-out loss of saved weights.

RUN_OR_CKPT is a run directory (its newest checkpoint), one step's directory or a converted
checkpoint (``moe_train.weights``); DIR a corpus prepared with ``python -m moe_train.data
prepare``. The val split is scored exactly as a run's ``train.eval_every`` evaluations score
it (``moe_train.evaluate``, ``moe_train.data.heldout``: the same fixed batches, packed by
document unless the weights' config says ``data.packing=false``), so the printed
``eval_loss`` of a run's checkpoint equals the ``eval_loss`` its run logged at that step (same
``--tokens`` and batch). The model runs without expert parallelism on ``--devices`` devices
(rows split over them); an fp8-trained model is evaluated in bf16 (fp8 scales are training
state). Prints one line, or JSON with ``--json``.

Exit codes: 0; 2 bad weights, data or options (one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax

from moe_train import config, sharding, signals, weights
from moe_train.config import Config, ConfigError


def eval_config(saved: Config, data_dir: str, *, devices: int, batch_size: int,
                tokens: int) -> Config:
    """The weights' config set up to evaluate on ``data_dir``'s val split on ``devices``."""
    t, d, p = saved.train, saved.data, saved.parallel
    rows = batch_size or devices * max(1, 8 // devices)
    compute = "bf16" if saved.precision.compute == "fp8" else saved.precision.compute
    cfg = dataclasses.replace(
        saved,
        data=dataclasses.replace(d, source="prepared", path=data_dir),
        train=dataclasses.replace(t, batch_size=rows, micro_batches=1, micro_batch_size=0,
                                  eval_tokens=tokens or t.eval_tokens, init_from=""),
        parallel=dataclasses.replace(p, devices=devices, ep=1, dp=0, cluster=""),
        precision=dataclasses.replace(saved.precision, compute=compute))
    config.validate(cfg)
    if rows % devices:
        raise ConfigError(f"--batch-size {rows} must be a multiple of the {devices} devices")
    return cfg


def evaluate_weights(path: str, data_dir: str, *, devices: int = 0, batch_size: int = 0,
                     tokens: int = 0) -> dict:
    """{"eval_loss", "eval_ppl", "eval_tokens", "data"} of the weights at ``path``."""
    from moe_train.data.heldout import eval_batches
    from moe_train.evaluate import evaluate

    source = weights.locate(path)
    devs = jax.devices()[:devices or None]
    cfg = eval_config(weights.config_of(source), data_dir, devices=len(devs),
                      batch_size=batch_size, tokens=tokens)
    batches, description = eval_batches(cfg)  # a DataError (ConfigError) before any restore
    mesh = sharding.make_mesh(devs)
    params, moe_state = weights.restore(source, cfg, mesh)
    return {**evaluate(cfg, mesh, params, moe_state, batches), "data": description}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_train.eval",
                                description="Held-out loss and perplexity of saved weights.")
    p.add_argument("ckpt", metavar="RUN_OR_CKPT", help="run directory, step or converted checkpoint")
    p.add_argument("--data", required=True, metavar="DIR", help="a prepared corpus (its val split)")
    p.add_argument("--tokens", type=int, default=0,
                   help="held-out tokens to score (default: the run's train.eval_tokens, or 64 "
                        "sequences)")
    p.add_argument("--batch-size", type=int, default=0, help="sequences per batch (default 8)")
    p.add_argument("--devices", type=int, default=0, help="devices to use (default: all)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    try:
        out = evaluate_weights(args.ckpt, args.data, devices=args.devices,
                               batch_size=args.batch_size, tokens=args.tokens)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return signals.EXIT_CONFIG
    if args.json:
        print(json.dumps(out))
    else:
        print(f"eval_loss {out['eval_loss']:.6f}  eval_ppl {out['eval_ppl']:.4f}  "
              f"({out['eval_tokens']} tokens of {out['data']})")
    return signals.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
