"""Compiled memory of the LM loss against vocab size: chunked (``moe_train.model.loss``) vs whole logits.

Shape key: T tokens, H hidden, V vocab.

For each vocab size the loss and its gradients with respect to the hidden states and the head
(forward+backward, fp32, one CPU device) are compiled two ways: ``lm_loss`` at its default
chunk, and optax's cross-entropy on the whole [T, V] logits (what the train step computed
before). The row reports XLA's compiled temp bytes of each and their ratio; nothing is timed,
so the numbers do not depend on the machine's load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from moe_train.bench.common import markdown_table, mib
from moe_train.model import loss

TITLE = "LM loss compiled memory vs vocab: chunked vs whole logits"


@dataclasses.dataclass(frozen=True)
class Sizes:
    tokens: int  # T
    hidden: int  # H
    vocabs: tuple[int, ...]  # V values


FULL = Sizes(tokens=4096, hidden=64, vocabs=(256, 4096, 32768, 131072))
QUICK = Sizes(tokens=1024, hidden=32, vocabs=(256, 131072))


def _whole(x_TH, head_HV, labels_T):
    logits_TV = jnp.dot(x_TH, head_HV, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_TV, labels_T).mean()


def _chunked(x_TH, head_HV, labels_T):
    return loss.lm_loss(x_TH, head_HV, labels_T)[0]


def temp_bytes(fn, T: int, H: int, V: int) -> int | None:
    """XLA's compiled temp bytes of ``fn``'s gradients w.r.t. x and head."""
    args = (jax.ShapeDtypeStruct((T, H), jnp.float32), jax.ShapeDtypeStruct((H, V), jnp.float32),
            jax.ShapeDtypeStruct((T,), jnp.int32))
    stats = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(*args).compile().memory_analysis()
    return None if stats is None else int(stats.temp_size_in_bytes)


def run(s: Sizes) -> dict[str, Any]:
    rows = []
    for V in s.vocabs:
        whole, chunked = (temp_bytes(f, s.tokens, s.hidden, V) for f in (_whole, _chunked))
        rows.append({"vocab": V, "chunk": loss.default_chunk(s.tokens, V),
                     "whole_temp_bytes": whole, "chunked_temp_bytes": chunked,
                     "ratio": chunked / whole if whole and chunked else None})
    table = markdown_table(["vocab", "chunk (tokens)", "whole logits", "chunked", "chunked / whole"],
                           [[r["vocab"], r["chunk"], mib(r["whole_temp_bytes"]),
                             mib(r["chunked_temp_bytes"]),
                             f"{r['ratio']:.3f}" if r["ratio"] else "-"] for r in rows])
    md = (f"## {TITLE}\n\nT={s.tokens} tokens, H={s.hidden}, fp32, forward+backward; compiled "
          f"temp memory.\n\n{table}\n")
    return {"title": TITLE, "sizes": dataclasses.asdict(s), "rows": rows, "markdown": md}
