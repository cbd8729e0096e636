"""Memory against vocab and sequence length: the LM loss's temp memory, the planner's activations.

Shape letters (``moe_train.base.notation``): T tokens, H hidden, V vocab, S sequence length.

Loss: for each vocab size the loss and its gradients with respect to the hidden states and
the head (forward+backward, fp32, one CPU device) are compiled two ways at the same T:
``lm_loss`` at its default chunk and vocab tile (``moe_train.model.loss``), and optax's
cross-entropy on the whole [T, V] logits (what the train step computed before). The rows
report XLA's compiled temp bytes of each, the chunked one's ratio to the smallest vocab and
to the whole logits; nothing is timed, so the numbers do not depend on the machine's load.
In fp32 the [H, V] head gradient is the loop's carry, written in place into the output, so
it is not temp: the temp bytes are the loss's working set alone.

Planner: ``moe_train.planner.memory.plan``'s activation bytes per GPU of a GPU job (the preset's
Mixtral on 8 H100 nodes, EP 8) at each sequence length, with the tokens per GPU micro-batch
held equal (``train.micro_batch_size`` = that many tokens / S sequences; the batch keeps
the tokens per step too), for the attention ``auto`` resolves to there (cuDNN), chunked and
xla; and, for contrast, ``auto`` with the preset's one-sequence micro-batches, where the
micro-batch grows with S.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from moe_train import config
from moe_train.bench import common
from moe_train.bench.common import markdown_table, mib
from moe_train.model import loss
from moe_train.planner.memory import plan
from moe_train.planner.memory.job import attention_kind
from topology.presets import load

TITLE = "Memory: LM loss temp vs vocab, planner activations vs sequence length"


@dataclasses.dataclass(frozen=True)
class Sizes:
    tokens: int  # T (16,384: one [T, 256] tile of fp32 logits is the loss's 16 MiB budget)
    hidden: int  # H
    vocabs: tuple[int, ...]  # V values; the first is the ratio's base
    seq_lens: tuple[int, ...] = (4096, 8192)  # S values of the planner rows; the first is the base
    job: tuple[str, str, int, int] = ("mixtral-8x7b", "h100-dgx", 8, 8)  # model, cluster, nodes, EP


FULL = Sizes(tokens=16384, hidden=64, vocabs=(256, 4096, 32768, 131072))
QUICK = Sizes(tokens=16384, hidden=16, vocabs=(256, 32768, 131072))


def _whole(x_TH, head_HV, labels_T):
    logits_TV = jnp.dot(x_TH, head_HV, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_TV, labels_T).mean()


def _chunked(x_TH, head_HV, labels_T):
    return loss.lm_loss(x_TH, head_HV, labels_T)[0]


def temp_bytes(fn, T: int, H: int, V: int) -> int | None:
    """XLA's compiled temp bytes of ``fn``'s gradients w.r.t. x and head."""
    args = (
        jax.ShapeDtypeStruct((T, H), jnp.float32),
        jax.ShapeDtypeStruct((H, V), jnp.float32),
        jax.ShapeDtypeStruct((T,), jnp.int32),
    )
    stats = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(*args).compile().memory_analysis()
    return None if stats is None else int(stats.temp_size_in_bytes)


def loss_rows(s: Sizes) -> list[dict[str, Any]]:
    """One row per vocab: chunk, tile, whole and chunked temp bytes and their ratios."""
    rows = []
    for V in s.vocabs:
        whole, chunked = (temp_bytes(f, s.tokens, s.hidden, V) for f in (_whole, _chunked))
        rows.append(
            {
                "vocab": V,
                "chunk": loss.default_chunk(s.tokens, V),
                "tile": loss.vocab_tile(V),
                "whole_temp_bytes": whole,
                "chunked_temp_bytes": chunked,
                "ratio": chunked / whole if whole and chunked else None,
            }
        )
    base = rows[0]["chunked_temp_bytes"]
    for r in rows:
        got = r["chunked_temp_bytes"]
        r["vs_first_vocab"] = got / base if base and got else None
    return rows


def _plan_row(s: Sizes, attention: str, seq: int, micro_tokens: int) -> dict[str, Any]:
    """The planner's activations for the job at ``seq`` with ``micro_tokens`` per GPU
    micro-batch (0: the preset's micro-batches) and the preset's tokens per step."""
    model, cluster, nodes, ep = s.job
    base = config.build(model)
    step_tokens = base.train.batch_size * base.train.seq_len
    sets = [f"model.attention={attention}", f"train.seq_len={seq}", f"train.batch_size={step_tokens // seq}"]
    if micro_tokens:
        sets.append(f"train.micro_batch_size={max(micro_tokens // seq, 1)}")
    cfg = config.build(model, sets)
    est = plan(cfg, cluster, nodes, ep=ep, search=False).estimate
    return {
        "attention": attention,
        "runs": attention_kind(cfg, load(cluster)),
        "memory": est.setup.attention,
        "seq_len": seq,
        "batch_size": step_tokens // seq,
        "micro_batch_tokens": est.setup.tokens,
        "activations_bytes": est.per_device["activations"],
    }


def plan_rows(s: Sizes) -> list[dict[str, Any]]:
    """Activations at each S: equal tokens per micro-batch for auto, chunked and xla, then
    auto with the preset's micro-batches (one sequence: the micro-batch grows with S)."""
    equal = max(s.seq_lens)
    rows = []
    for attention, micro in (("auto", equal), ("chunked", equal), ("xla", equal), ("auto", 0)):
        group = [_plan_row(s, attention, seq, micro) for seq in s.seq_lens]
        for r in group:
            r["equal_tokens"] = bool(micro)
            r["vs_first_seq"] = r["activations_bytes"] / group[0]["activations_bytes"]
        rows += group
    return rows


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def markdown(s: Sizes, rows: list[dict], plans: list[dict]) -> str:
    loss_table = markdown_table(
        [
            "vocab",
            "chunk (tokens)",
            "tile (columns)",
            "whole logits MiB",
            "chunked MiB",
            f"chunked / V={s.vocabs[0]}",
            "chunked / whole",
        ],
        [
            [
                r["vocab"],
                r["chunk"],
                r["tile"],
                mib(r["whole_temp_bytes"]),
                mib(r["chunked_temp_bytes"]),
                f"{r['vs_first_vocab']:.2f}" if r["vs_first_vocab"] else "-",
                f"{r['ratio']:.3f}" if r["ratio"] else "-",
            ]
            for r in rows
        ],
    )
    model, cluster, nodes, ep = s.job
    plan_table = markdown_table(
        [
            "model.attention",
            "runs",
            "kept per token",
            "S",
            "batch",
            "tokens per GPU micro-batch",
            "activations GiB",
            f"/ S={s.seq_lens[0]}",
        ],
        [
            [
                r["attention"],
                r["runs"],
                r["memory"],
                r["seq_len"],
                r["batch_size"],
                r["micro_batch_tokens"],
                _gib(r["activations_bytes"]),
                f"{r['vs_first_seq']:.2f}",
            ]
            for r in plans
        ],
    )
    return (
        f"## {TITLE}\n\nLM loss at T={s.tokens} tokens, H={s.hidden}, fp32, forward+backward; "
        f"XLA's compiled temp memory.\n\n{loss_table}\n\nPlanner activations per GPU, "
        f"`{model}` on {nodes} `{cluster}` nodes, EP {ep}, the preset's tokens per step; the "
        f"last pair keeps the preset's one-sequence micro-batches (the micro-batch grows "
        f"with S).\n\n{plan_table}\n"
    )


def run(s: Sizes) -> dict[str, Any]:
    rows, plans = loss_rows(s), plan_rows(s)
    return common.section_result(TITLE, s, rows=rows, plan_rows=plans, markdown=markdown(s, rows, plans))
