"""``python -m moe_train.score CKPT --tokens IDS.npy [--logits LOGITS.npy]``: score token ids.

CKPT is a converted checkpoint (``python -m moe_train.convert from-hf``), a run directory (its
newest checkpoint) or one step's directory; IDS an integer array [B, S]. Prints the mean
next-token cross-entropy over the B x (S - 1) predicted tokens and its perplexity, and writes
the fp32 logits [B, S, V] when asked. Runs on whatever JAX has (CPU or GPU), on
``--devices`` devices (default all): the rows are split over them when they divide B, and
the weights are sharded as for training (``moe_train.parallel.sharding``). The MoE layers run dropless
on each device (no expert parallelism); MTP modules do not run (they train, they do not score).
A run's step (or converted weights) is verified against its manifest before it is used
(``weights.restore``); one
without a manifest is refused unless ``--trust-unverified`` (also ``python -m moe_train.eval``'s:
``weights_cli`` is both commands' command line).

Exit codes: 0, 2 (bad CKPT or IDS: one line), 5 (LOGITS cannot be written).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_train.base import exits
from moe_train.base.calls import from_names
from moe_train.config import ConfigError
from moe_train.config.cli import add_options, options_file
from moe_train.convert import weights
from moe_train.model.settings import model_settings
from moe_train.model.transformer import Transformer
from moe_train.parallel import sharding

OPTIONS = options_file(__file__)  # score's options, and every weights command's (options.toml)


def load_ids(path: str, vocab: int) -> np.ndarray:
    """IDS as int32 [B, S]; ConfigError for a file that is not one .npy array (empty,
    truncated, pickled, an .npz), another rank or dtype, no rows, or an id outside the vocab."""
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        why = " ".join(str(err).split()) or "the file is empty or truncated"
        why = "no .npy header" if "pickled" in why else why  # numpy's guess for any other file
        raise ConfigError(f"--tokens {path}: cannot read a .npy array ({why})") from None
    if not isinstance(ids, np.ndarray):
        ids.close()
        raise ConfigError(f"--tokens {path}: expected one .npy array, got an .npz archive")
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise ConfigError(
            f"--tokens {path}: expected integer ids [B, S] with B >= 1 and S >= 2, "
            f"got {ids.dtype} {list(ids.shape)}"
        )
    if ids.min() < 0 or ids.max() >= vocab:
        raise ConfigError(
            f"--tokens {path}: ids must be in [0, {vocab}) (the model's "
            f"vocabulary), got {ids.min()}..{ids.max()}"
        )
    return ids.astype(np.int32)


def pick_devices(n: int) -> list[jax.Device]:
    """The first ``n`` devices (0: all); ConfigError for a count this machine does not have."""
    available = jax.devices()
    if not 0 <= n <= len(available):
        raise ConfigError(
            f"--devices {n}: choose 1..{len(available)} (0 or none: all "
            f"{len(available)} {available[0].platform} device(s))"
        )
    return available[: n or None]


def score(
    ckpt: str,
    ids: np.ndarray | None = None,
    *,
    tokens: str | None = None,
    devices: int = 0,
    trust_unverified: bool = False,
) -> tuple[float, np.ndarray]:
    """(mean next-token loss, fp32 logits [B, S, V]) of the weights at ``ckpt`` (a step
    without a manifest is refused unless ``trust_unverified``)."""
    source = weights.locate(ckpt)
    cfg = weights.config_of(source)
    if ids is None:
        assert tokens is not None, "score needs ids or tokens"
        ids = load_ids(tokens, cfg.model.vocab_size)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=ids.shape[1]))
    mesh = sharding.make_mesh(pick_devices(devices))
    params, moe_state = weights.restore(source, cfg, mesh, trust_unverified)
    shd = sharding.Sharding.of(mesh, cfg)
    rows = NamedSharding(mesh, P(sharding.TOKEN_AXES) if ids.shape[0] % mesh.size == 0 else P())
    model = Transformer(model_settings(cfg))

    @jax.jit
    def forward(params, moe_state, ids_BS):
        logits_BSV, _ = model.apply({"params": params, "moe_state": moe_state}, ids_BS)
        logp = jax.nn.log_softmax(logits_BSV[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, ids_BS[:, 1:, None], axis=-1)
        return jnp.mean(nll), logits_BSV

    with shd.activate():
        loss, logits = forward(params, moe_state, jax.device_put(ids, rows))
    return float(loss), np.asarray(logits, np.float32)


def weights_cli(
    argv: list[str] | None, command: dict[str, Any], run: Callable[[argparse.Namespace], int]
) -> int:
    """A command over saved weights: its options table ``command`` (prog, description, its
    options, the weights' positional ``ckpt`` first), then OPTIONS' ``weights`` (``--devices``,
    ``--trust-unverified``); returns ``run(args)``, or EXIT_CONFIG after one line for a ConfigError."""
    p = argparse.ArgumentParser(prog=command["prog"], description=command["description"])
    add_options(p, command)
    add_options(p, OPTIONS["weights"])
    args = p.parse_args(argv)
    try:
        return run(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return exits.EXIT_CONFIG


def main(argv: list[str] | None = None) -> int:
    return weights_cli(argv, OPTIONS["score"], _run)


def _run(args: argparse.Namespace) -> int:
    loss, logits = from_names(score, args)
    B, S = logits.shape[:2]
    print(f"loss {loss:.6f}  perplexity {math.exp(loss):.4f}  ({B} x {S - 1} predicted tokens)")
    if args.logits:
        try:
            np.save(Path(args.logits), logits)
        except OSError as err:
            print(f"error: cannot write {args.logits}: {err}", file=sys.stderr)
            return exits.EXIT_OUTPUT
    return exits.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
