"""Which Hugging Face tensors make each of the kit's parameters, and how.

The kit's tree is taken in its looped layout (``layer_{i}``, ``mtp_{k}``; ``moe_train.model.transformer``)
with ``params`` and ``moe_state`` side by side. Every leaf has one ``Entry``:

* ``same``: the tensor as it is (embeddings, norm scales, DeepSeek-V3's router bias);
* ``linear``: a torch ``Linear`` weight ``[out, in]`` transposed to the kit's ``[in..., out...]``
  and reshaped (the first ``n_in`` kit dims are the input: 1, or 2 for the attention output
  ``[heads, head_dim, hidden]``);
* ``experts``: one ``[out, in]`` weight per expert, transposed and stacked to ``[E, in, out]``;
* ``zeros``: kit state the family does not have (the expert bias of Mixtral and Qwen3):
  zeros from Hugging Face, nothing written back.

DeepSeek-V3's MTP module ``mtp_{k}`` is Hugging Face layer ``num_hidden_layers + k``: its block
under the usual names, plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``; the
files also hold copies of the embedding and the head there (``embed_tokens``,
``shared_head.head``), which ``extra_copies`` names for ``to-hf`` and ``from-hf`` skips.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from moe_train.config import Config
from moe_train.convert.families import Family

ATTN = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "q_a": "q_a_proj",
    "q_b": "q_b_proj",
    "kv_a": "kv_a_proj_with_mqa",
    "kv_b": "kv_b_proj",
    "q_norm": "q_norm",
    "k_norm": "k_norm",
    "q_a_norm": "q_a_layernorm",
    "kv_a_norm": "kv_a_layernorm",
}
DENSE = {"wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}
# leaves that are one HF tensor each (_one): the model's own, an MTP module's (under its layer's
# prefix) and a block's norms
TOP = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
MTP = {
    "enorm": "enorm.weight",
    "hnorm": "hnorm.weight",
    "eh_proj": "eh_proj.weight",
    "norm": "shared_head.norm.weight",
}
NORMS = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}
LAYER = re.compile(r"(layer|mtp)_(\d+)")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One kit leaf and the Hugging Face tensors it is made of."""

    kit: tuple[str, ...]  # ("params" | "moe_state", *path) in the looped layout
    hf: tuple[str, ...]  # HF tensor names (one per expert for ``experts``; none for ``zeros``)
    kind: str  # same | linear | experts | zeros
    shape: tuple[int, ...]  # the kit leaf's shape
    n_in: int = 1  # linear: leading kit dims that are the torch input

    def to_kit(self, arrays: list[np.ndarray]) -> np.ndarray:
        if self.kind == "zeros":
            return np.zeros(self.shape, np.float32)
        if self.kind == "same":
            return arrays[0]
        if self.kind == "linear":
            return arrays[0].T.reshape(self.shape)
        return np.stack([a.T for a in arrays])  # experts: [E, in, out]

    def to_hf(self, kit: np.ndarray) -> list[np.ndarray]:
        if self.kind == "zeros":
            return []
        if self.kind == "same":
            return [kit]
        if self.kind == "linear":
            rows = int(np.prod(self.shape[: self.n_in]))
            return [np.ascontiguousarray(kit.reshape(rows, -1).T)]
        return [np.ascontiguousarray(kit[e].T) for e in range(kit.shape[0])]

    def hf_shapes(self) -> list[tuple[int, ...]]:
        """The shapes the HF tensors must have."""
        if self.kind == "same":
            return [self.shape]
        if self.kind == "linear":
            rows = int(np.prod(self.shape[: self.n_in]))
            return [(int(np.prod(self.shape)) // rows, rows)]
        if self.kind == "experts":
            return [(self.shape[2], self.shape[1])] * self.shape[0]
        return []


def entries(fam: Family, cfg: Config, tree: dict[str, Any]) -> list[Entry]:
    """An Entry for every leaf of ``tree`` ({"params": ..., "moe_state": ...}, abstract or
    real, looped layout), in tree order."""
    out = []
    for collection in ("params", "moe_state"):
        for path, leaf in _leaves(tree.get(collection, {})):
            out.append(_entry(fam, cfg, (collection, *path), tuple(leaf.shape)))
    return out


def _leaves(tree, prefix=()):
    if isinstance(tree, dict):
        for k in tree:
            yield from _leaves(tree[k], (*prefix, str(k)))
    else:
        yield prefix, tree


def _entry(fam: Family, cfg: Config, kit: tuple[str, ...], shape) -> Entry:
    path = kit[1:]
    if path[0] in TOP:
        return _one(kit, path[0], TOP[path[0]], shape)
    match = LAYER.fullmatch(path[0])
    if not match:
        raise ValueError(f"no Hugging Face name for {'/'.join(kit)}")
    i = int(match[2]) + (cfg.model.num_layers if match[1] == "mtp" else 0)
    prefix, rest = f"model.layers.{i}.", path[1:]
    if match[1] == "mtp":
        if rest[0] in MTP:
            return _one(kit, rest[0], prefix + MTP[rest[0]], shape)
        rest = rest[1:]  # the block
    return _block(fam, kit, prefix, rest, shape)


def _one(kit, leaf: str, name: str, shape, n_in: int = 1) -> Entry:
    """Leaf ``leaf`` as the one HF tensor ``name``: as it is for the embedding and the norm
    scales, else a torch Linear weight (its input the first ``n_in`` kit dims)."""
    kind = "same" if leaf == "embed" or leaf.endswith("norm") else "linear"
    return Entry(kit, (name,), kind, shape, n_in=n_in)


def _block(fam: Family, kit, prefix: str, rest: tuple[str, ...], shape) -> Entry:
    if rest[0] in NORMS:
        return _one(kit, rest[0], prefix + NORMS[rest[0]], shape)
    if rest[0] == "attn":
        name = f"{prefix}self_attn.{ATTN[rest[1]]}.weight"
        return _one(kit, rest[1], name, shape, n_in=2 if rest[1] == "o" else 1)
    if rest[0] == "mlp":
        return _one(kit, rest[1], f"{prefix}mlp.{DENSE[rest[1]]}.weight", shape)
    moe = f"{prefix}{fam.moe_prefix}."
    if rest[1] == "gate":
        return _one(kit, rest[1], moe + "gate.weight", shape)
    if rest[1] == "expert_bias":
        if fam.name != "deepseek_v3":
            return Entry(kit, (), "zeros", shape)
        return Entry(kit, (moe + "gate.e_score_correction_bias",), "same", shape)
    if rest[1] == "shared":
        return _one(kit, rest[2], f"{moe}shared_experts.{DENSE[rest[2]]}.weight", shape)
    proj = fam.expert_names[("wi_0", "wi_1", "wo").index(rest[1])]
    return Entry(kit, tuple(f"{moe}experts.{e}.{proj}.weight" for e in range(shape[0])), "experts", shape)


def extra_copies(cfg: Config) -> list[tuple[str, str]]:
    """(HF name, kit leaf it copies) of the MTP layers' embedding and head copies."""
    out = []
    for k in range(cfg.model.mtp_depth):
        prefix = f"model.layers.{cfg.model.num_layers + k}."
        out += [
            (prefix + "embed_tokens.weight", "model.embed_tokens.weight"),
            (prefix + "shared_head.head.weight", "lm_head.weight"),
        ]
    return out
