"""Held-out batches for evaluation (``train.eval_every``): fixed, the same at every evaluation.

Where they come from (``data.source``):

* ``prepared``: the val split of ``data.path`` in document order, cut into rows as training
  rows are (``moe_train.data.packed.val_rows``), packed with segment ids unless
  ``data.packing=false``. No val split (or an empty one) is a one-line DataError (exit 2).
* ``synthetic``: walks of the training chain drawn from a random stream of their own
  (``default_rng([data.seed, tag, i])``, never a training batch's ``[data.seed, step]``):
  the same distribution, fixed walks.
* ``tokens``, ``bytes``: none; ``train.eval_every`` is a config error there (every window of
  the file may be trained on, so nothing in it is held out).

How many: ``train.eval_tokens`` tokens, or ``DEFAULT_SEQUENCES`` sequences when it is 0, in
whole batches of ``train.batch_size`` rows (the shape the step is sharded and planned for;
rounded up). 64 sequences: at 1-4k tokens each, 65-260k scored tokens put the standard error
of the mean loss near 0.01 nats (documents differ more than tokens; the rows come from many
documents), enough to follow the curve and see overfitting, for at most the forward pass of
64 sequences, under a third of a training step's compute at a batch of 64. A val split
shorter than that is used whole and the last batch is padded (``packing.PAD``, never scored).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_train.config import Config
from moe_train.data import DataError, SyntheticSource, packing
from moe_train.data.packed import val_rows

DEFAULT_SEQUENCES = 64  # sequences per evaluation when train.eval_tokens is 0
_HELD_OUT_TAG = 0x4E1D  # separates the held-out walks' streams from the batches'


def sequences(cfg: Config) -> int:
    """Rows per evaluation: eval_tokens (or the default) in whole batches of batch_size."""
    t = cfg.train
    want = -(-t.eval_tokens // t.seq_len) if t.eval_tokens else DEFAULT_SEQUENCES
    return -(-want // t.batch_size) * t.batch_size


def eval_batches(cfg: Config) -> tuple[list[Any], str]:
    """(the held-out global batches, host numpy of ``train.batch_size`` rows each, in either
    form of ``moe_train.data.packing``; a one-line description for the log)."""
    d, t, m = cfg.data, cfg.train, cfg.model
    rows, B = sequences(cfg), t.batch_size
    if d.source == "prepared":
        batch, real, shown = val_rows(
            d.path, vocab_size=m.vocab_size, seq_len=t.seq_len, rows=rows, packed=bool(d.packing)
        )
        batches = [packing.rows(batch, lo, lo + B) for lo in range(0, rows, B)]
        batches = batches[: max(1, -(-real // B))]  # no batch of padding only
        return batches, (
            f"the val split of {shown} ({min(real, rows)} rows of "
            f"{t.seq_len + 1} tokens{', packed' if d.packing else ''})"
        )
    if d.source == "synthetic":
        src = SyntheticSource(vocab_size=m.vocab_size, seq_len=t.seq_len, batch_size=B, seed=d.seed)
        batches = [
            np.ascontiguousarray(
                src._generate(np.random.default_rng([d.seed, _HELD_OUT_TAG, i]), 0, B), dtype=np.int32
            )
            for i in range(rows // B)
        ]
        return batches, f"{rows} held-out synthetic walks of {t.seq_len + 1} tokens"
    raise DataError(
        f"train.eval_every needs held-out data; data.source={d.source} has none "
        f"(use data.source=prepared with a val split)"
    )
