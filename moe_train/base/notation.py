"""The shape letters: one table for the whole kit.

An array's name ends in its axes, one uppercase letter each, outermost first: ``x_TH`` is
[tokens, hidden], ``wi_0_EHF`` [experts, hidden, ffn], ``q_BSND`` [batch, sequence, query
heads, head dim]. A letter means the same axis in every module; a module's docstring may list
the letters it uses, with these meanings. Sizes differ with context (T is the global token
count under ``jax.jit`` and this shard's inside ``shard_map``; R is a different buffer's rows
in each exchange), the axis a letter names does not. A digit is no axis letter: ``1`` is an
axis of size one (``mask_B1SS``, ``t_T1``), a digit after a letter a variant of that axis
(``R1``/``R2``, ``C1``/``C2``: stage 1/2 of an exchange; ``S1`` = S + 1; ``F2`` = 2F, the gate
and up projections side by side; ``R0``: no rows). Lowercase letters (``m`` tile rows, ``n``
devices, einsum subscripts, ...) are defined where they are used, never axis letters.

  A  arrived rows: the rows an exchange delivers to a shard, which the expert steps compute
  B  batch: the sequences of a batch
  C  rows of one block or chunk: a loss chunk's tokens, a chunked-attention query or key
     block, a tiled-kernel block, capacity slots (of one expert, or of one (source,
     destination) pair of an exchange)
  D  query/key head dim (MLA: D = U + I; RoPE: the rotated dims)
  E  experts (inside shard_map under expert parallelism: this shard's experts)
  F  ffn width: the hidden dim of a dense MLP or of one expert
  G  query heads per key/value head (GQA: N = Y * G)
  H  hidden: the model width
  I  RoPE dims per head (MLA, model.qk_rope_head_dim)
  J  value head dim
  K  top-k: a token's (a row's) expert choices
  L  layers: a stacked axis of blocks (a scanned group's layers, the MoE layers' stats, the
     main head and the MTP modules, one per depth)
  M  assignments: (token, expert choice) pairs, M = T * K, flat index t * K + k
  N  query heads
  O  fast-link domains of an expert-parallel group (mesh axis expert_x)
  P  blocks: how many blocks, chunks or tiles of C (or m) rows an axis is cut into
  R  rows of a dispatched layout or of an exchange buffer
  S  sequence positions
  T  tokens: B * S rows of activations
  U  no-RoPE dims per head (MLA, model.qk_nope_head_dim)
  V  vocab
  W  vocab columns of one tile of the chunked loss (vocab_tile)
  X  rows an exchange sends: a shard's tokens, or the rows an earlier stage delivered
  Y  key/value heads
  Z  key/value latent (MLA, model.kv_lora_rank)

Unassigned: Q. A new axis takes a free letter (adding it here) or is named in words, as the
EP size (``ep``), the local experts (``local_experts``: E inside shard_map), the shards per
domain (``domain_size``), the router's expert groups and MLA's query latent (``q_lora_rank``)
are: never a letter that already means something else.

tests/test_notation.py checks every identifier of the kit's packages that ends in a shape
suffix (``name_LETTERS``) against ``LETTERS``, and that this table and ``LETTERS`` agree.
"""

from __future__ import annotations

LETTERS: dict[str, str] = {
    "A": "arrived rows: the rows an exchange delivers to a shard, which the expert steps compute",
    "B": "batch: the sequences of a batch",
    "C": (
        "rows of one block or chunk: a loss chunk's tokens, a chunked-attention query or key block, "
        "a tiled-kernel block, capacity slots (of one expert, or of one (source, destination) pair "
        "of an exchange)"
    ),
    "D": "query/key head dim (MLA: D = U + I; RoPE: the rotated dims)",
    "E": "experts (inside shard_map under expert parallelism: this shard's experts)",
    "F": "ffn width: the hidden dim of a dense MLP or of one expert",
    "G": "query heads per key/value head (GQA: N = Y * G)",
    "H": "hidden: the model width",
    "I": "RoPE dims per head (MLA, model.qk_rope_head_dim)",
    "J": "value head dim",
    "K": "top-k: a token's (a row's) expert choices",
    "L": (
        "layers: a stacked axis of blocks (a scanned group's layers, the MoE layers' stats, "
        "the main head and the MTP modules, one per depth)"
    ),
    "M": "assignments: (token, expert choice) pairs, M = T * K, flat index t * K + k",
    "N": "query heads",
    "O": "fast-link domains of an expert-parallel group (mesh axis expert_x)",
    "P": "blocks: how many blocks, chunks or tiles of C (or m) rows an axis is cut into",
    "R": "rows of a dispatched layout or of an exchange buffer",
    "S": "sequence positions",
    "T": "tokens: B * S rows of activations",
    "U": "no-RoPE dims per head (MLA, model.qk_nope_head_dim)",
    "V": "vocab",
    "W": "vocab columns of one tile of the chunked loss (vocab_tile)",
    "X": "rows an exchange sends: a shard's tokens, or the rows an earlier stage delivered",
    "Y": "key/value heads",
    "Z": "key/value latent (MLA, model.kv_lora_rank)",
}
