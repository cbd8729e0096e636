"""Batches of packed documents: the batch representation, positions and labels.

Shape letters (``moe_train.base.notation``): B batch, S sequence (model inputs), S1 = S + 1 (a
batch row: inputs and the last target).

A batch is either a plain ``int32 [B, S+1]`` array of token ids (every source but packed
prepared data: attention sees the whole row, positions are 0..S-1) or, with documents packed
into rows (``data.source=prepared``, ``data.packing=true``), a dict

    {"tokens": int32 [B, S+1], "segments": int32 [B, S+1]}

where ``segments`` numbers the document pieces of each row (1, 2, ... left to right). Both
leaves are sharded alike (a single ``NamedSharding`` is a prefix of the dict), so the train
step, gradient accumulation and the stepper take either form unchanged. With segments:

* attention never crosses documents (``moe_train.model.attention.attend(segment_ids_BS=...)``);
* positions restart at 0 at every document piece (``positions``);
* the first token of a document is not predicted from the document before it: its label is
  -1, which the loss ignores (``next_token_labels``).

Token ids below 0 are padding (held-out batches padded to whole batches): ignored as labels,
read as id 0 by the embedding (``model_inputs``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

TOKENS, SEGMENTS = "tokens", "segments"
PAD = -1  # token id of padding (never a label)


def is_packed(batch: Any) -> bool:
    """Whether ``batch`` carries segment ids."""
    return isinstance(batch, dict)


def parts(batch: Any):
    """(token ids [B, S+1], segment ids [B, S+1] or None) of either batch form."""
    if is_packed(batch):
        return batch[TOKENS], batch[SEGMENTS]
    return batch, None


def make(tokens_BS1, segments_BS1=None):
    """The batch of ``tokens`` (and ``segments``: packed when given)."""
    return tokens_BS1 if segments_BS1 is None else {TOKENS: tokens_BS1, SEGMENTS: segments_BS1}


def rows(batch: Any, lo: int, hi: int) -> Any:
    """Rows ``lo:hi`` of every leaf (a process's share of a global batch)."""
    return jax.tree.map(lambda a: a[lo:hi], batch)


def positions(segment_ids_BS):
    """int32 [B, S]: each token's offset from the start of its segment (runs of equal ids)."""
    B, S = segment_ids_BS.shape
    t_S = jnp.arange(S, dtype=jnp.int32)
    starts_BS = jnp.concatenate(
        [jnp.ones((B, 1), bool), segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1
    )
    first_BS = jax.lax.cummax(jnp.where(starts_BS, t_S, 0), axis=1)
    return t_S - first_BS


def next_token_labels(tokens_BS1, segments_BS1=None):
    """Labels [B, S] of the inputs ``tokens[:, :-1]``: the next token, or -1 where that token
    starts another document (its segment differs). Without segments: ``tokens[:, 1:]``."""
    targets_BS = tokens_BS1[:, 1:]
    if segments_BS1 is None:
        return targets_BS
    same_BS = segments_BS1[:, 1:] == segments_BS1[:, :-1]
    return jnp.where(same_BS, targets_BS, -1)


def model_inputs(tokens_BS1):
    """The model's input ids ``tokens[:, :-1]`` with padding read as id 0."""
    return jnp.maximum(tokens_BS1[:, :-1], 0)
