"""Multi-Token Prediction (MTP), DeepSeek-V3's training objective (arXiv:2412.19437, 2.2).

Shape letters (``moe_train.base.notation``): B batch, S sequence, H hidden, L the MTP modules
(one per depth: ``model.mtp_depth``).

Module k (k = 1..L, named ``mtp_{k-1}``) reads, at every position i, the hidden state
h^{k-1}_i of the depth before (k = 1: the main model's last block, before its final norm) and
the embedding of token i+k, and predicts token i+k+1:

    x      = [RMSNorm(Emb(t_{i+k})) ; RMSNorm(h^{k-1}_i)] @ eh_proj      [B, S, 2H] @ [2H, H]
    h^k    = Block(x)              one transformer block (a MoE block, as in V3), causal
    logits = RMSNorm(h^k) @ head   the main model's output head (shared, as is the embedding)

The concatenation puts the embedding first, the order of the released checkpoints'
``eh_proj`` (``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` of layer 61 in
DeepSeek-V3's files). Shapes stay static: ``shifted`` builds each depth's input ids and labels
from the step's [B, S+1] batch by shifting; positions whose token i+k or i+k+1 lies past the
batch get label -1, which the loss ignores (``moe_train.model.loss``), so depth k scores S-k
positions of every row (with packed documents, fewer: no label crosses a document). The
training loss adds ``mtp_weight(step)`` times the mean of the depths' cross-entropies; the
main ``loss`` metric stays next-token cross-entropy.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moe_train.model import precision
from moe_train.model.layers import RMSNorm, gathered, weight
from moe_train.model.settings import ModelSettings


class MTPModule(nn.Module):
    """One MTP depth: (h^{k-1} [B,S,H], Emb(t_{i+k}) [B,S,H]) -> (h^k, RMSNorm(h^k), stats);
    packed documents' segment ids and positions as the main model's blocks take them."""

    cfg: ModelSettings
    block_cls: Any  # the model's (remat-wrapped) Block class
    dense: bool  # a dense block (only for models without MoE layers)
    ep_plan: Any = None  # the MoE block's expert-parallel plan, as the main model's

    @nn.compact
    def __call__(self, h_BSH, emb_BSH, segment_ids_BS=None, positions_BS=None):
        m, pol = self.cfg.model, self.cfg.policy
        e_BSH = RMSNorm(m.norm_eps, name="enorm")(emb_BSH)
        h_BSH = RMSNorm(m.norm_eps, name="hnorm")(h_BSH)
        axes = ("mtp_concat", "embed")
        w = weight(self, "eh_proj", (2 * m.hidden, m.hidden), axes)
        x_BSH = precision.dot(
            pol, "eh_proj", jnp.concatenate([e_BSH, h_BSH], axis=-1), gathered(w, axes, pol.dtype)
        )
        x_BSH, stats = self.block_cls(self.cfg, dense=self.dense, ep_plan=self.ep_plan, name="block")(
            x_BSH, segment_ids_BS, positions_BS
        )
        return x_BSH, RMSNorm(m.norm_eps, name="norm")(x_BSH), stats


def mtp_weight(m: Any, step):
    """The MTP loss weight at optimizer ``step`` (traced): ``mtp_loss_weight``, then
    ``mtp_loss_weight_late`` from ``mtp_late_step`` on (0: never)."""
    if not m.mtp_late_step:
        return jnp.float32(m.mtp_loss_weight)
    return jnp.where(
        step >= m.mtp_late_step, jnp.float32(m.mtp_loss_weight_late), jnp.float32(m.mtp_loss_weight)
    )


def shifted(batch_BS1, depth: int, segments_BS1=None):
    """(input ids [L, B, S], labels [L, B, S]) of each depth from a [B, S+1] batch: depth k's
    row i holds token i+k and, as its label, token i+k+1; past the batch: id 0, label -1.
    With packed documents (``segments_BS1``) nothing crosses a document either: where token
    i+k is in another document than token i the id is 0, where token i+k+1 is, the label
    is -1 (so a position's MTP input depends on its own document only)."""
    B, S = batch_BS1.shape[0], batch_BS1.shape[1] - 1
    pad = jnp.full((B, depth + 1), -1, batch_BS1.dtype)
    ext_BS = jnp.concatenate([batch_BS1, pad], axis=1)  # [B, S + 1 + L + 1]
    ids = jnp.stack([ext_BS[:, k : k + S] for k in range(1, depth + 1)])
    labels = jnp.stack([ext_BS[:, k + 1 : k + 1 + S] for k in range(1, depth + 1)])
    if segments_BS1 is not None:
        seg_BS = jnp.concatenate([segments_BS1, jnp.full((B, depth + 1), -1, segments_BS1.dtype)], axis=1)
        own_BS = seg_BS[:, :S]
        ids = jnp.where(jnp.stack([seg_BS[:, k : k + S] == own_BS for k in range(1, depth + 1)]), ids, -1)
        labels = jnp.where(
            jnp.stack([seg_BS[:, k + 1 : k + 1 + S] == own_BS for k in range(1, depth + 1)]), labels, -1
        )
    return jnp.maximum(ids, 0), labels
