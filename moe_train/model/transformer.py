"""Decoder-only MoE transformer (Flax linen), written against logical axis names.

Shape letters (``moe_train.base.notation``): B batch, S sequence, T tokens (B*S), H hidden,
V vocab, N query heads, Y key/value heads, D head dim, F ffn width, E experts, L layers (of one
scanned group; the MoE layers, for per-layer MoE stats and the expert bias; the MTP modules).

Parameters are created with logical axes (``embed``, ``mlp``, ``heads``, ``expert``, ...);
``moe_train.parallel.sharding.LOGICAL_RULES`` maps them to mesh axes. The expert bias of
aux-loss-free balancing lives in the ``moe_state`` collection: it is read here and updated by
the train step from the returned expert loads, never by the optimizer. Matmul precision
follows ``[precision]`` (``moe_train.model.precision``): under fp8 the fp8 scaling state lives in
the ``_overwrite_with_gradient`` collection and the router still sees the un-quantized input.

Layer layout (``model.scan_layers``). Scanned (the default): the first
``model.first_dense_layers`` blocks form the group ``dense_layers``, the others ``moe_layers``;
each group is one ``nn.scan`` over a block, so it compiles once whatever the depth, and every
variable of the group (``params``, ``moe_state``, the fp8 collection) has a leading ``layers``
axis [L, ...] (logical axis ``layers``, never sharded). A group of no layers does not exist.
Looped (``scan_layers=false``, for debugging): blocks ``layer_0`` ... ``layer_{n-1}`` in a Python
loop, the same computation. ``to_scanned`` / ``to_looped`` convert any tree holding a layer
layout (params, moe_state, fp8 state, Adam moments, a whole train state) between the two.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_train.config import head_dim
from moe_train.data import packing
from moe_train.model import precision, remat, rope
from moe_train.model.layers import (
    ACTIVATION_AXES,
    CausalAttention,
    RMSNorm,
    SwiGLU,
    fan_in_init,
    gathered,
    weight,
)
from moe_train.model.mla import MLA
from moe_train.model.mtp import MTPModule
from moe_train.model.precision import FP8_COLLECTION
from moe_train.model.settings import ModelSettings
from moe_train.moe import Routing, capacity_moe, dropless_moe
from moe_train.parallel.jobplan import EPPlan

GROUPS = ("dense_layers", "moe_layers")  # scanned layer groups, in depth order
LAYER_NAME = re.compile(r"layer_(\d+)")  # a block of the looped layout
# Collections that hold one entry per layer (scanned along the layer axis); "intermediates"
# makes capture_intermediates work under scan (stacked [L, ...]).
LAYER_COLLECTIONS = ("params", "moe_state", FP8_COLLECTION, "intermediates")


class Attention(CausalAttention):
    """Causal grouped-query attention through ``moe_train.model.attention`` (``model.attention``
    resolved for this platform, ``model.attention_block`` rows per block of ``chunked``).
    With ``segment_ids_BS`` a token attends only to its own document; ``positions_BS``
    are the RoPE positions (default 0..S-1)."""

    def qkv(self, x_BSH, positions_BS):
        m, pol = self.cfg.model, self.cfg.policy
        d, dt = head_dim(m), pol.dtype

        def proj(name, heads, axes):
            w = weight(self, name, (m.hidden, heads, d), axes)
            return precision.dot(pol, name, x_BSH, gathered(w, axes, dt))  # [B, S, heads, D]

        q_BSND = proj("q", m.num_heads, ("embed", "heads", "head_dim"))
        k_BSYD = proj("k", m.num_kv_heads, ("embed", "kv_heads", "head_dim"))
        v_BSYD = proj("v", m.num_kv_heads, ("embed", "kv_heads", "head_dim"))
        if m.qk_norm:
            q_BSND = RMSNorm(m.norm_eps, "head_dim", name="q_norm")(q_BSND)
            k_BSYD = RMSNorm(m.norm_eps, "head_dim", name="k_norm")(k_BSYD)
        r = self.cfg.rope
        q_BSND = rope.apply(q_BSND, m.rope_theta, r, positions_BS)
        k_BSYD = rope.apply(k_BSYD, m.rope_theta, r, positions_BS)
        return q_BSND, k_BSYD, v_BSYD


class MoEBlock(nn.Module):
    """Routed experts (dropless) plus optional shared experts.

    The experts run in ``dropless_moe``: with an ``ep_plan``, expert-parallel on the context
    mesh; without one, on this device.
    """

    cfg: ModelSettings
    ep_plan: EPPlan | None = None

    @nn.compact
    def __call__(self, x_BSH):
        m, e = self.cfg.model, self.cfg.moe
        pdt, part = jnp.dtype(m.param_dtype), nn.with_logical_partitioning
        E, H, F = e.num_experts, m.hidden, e.expert_ffn
        gate_HE = self.param(
            "gate", part(nn.initializers.normal(0.02), ("embed", "expert_gate")), (H, E), jnp.float32
        )
        expert_init = fan_in_init((1,), (2,), (0,))
        wi_0_EHF = self.param("wi_0", part(expert_init, ("expert", "embed", "mlp")), (E, H, F), pdt)
        wi_1_EHF = self.param("wi_1", part(expert_init, ("expert", "embed", "mlp")), (E, H, F), pdt)
        wo_EFH = self.param("wo", part(expert_init, ("expert", "mlp", "embed")), (E, F, H), pdt)
        bias_E = self.variable("moe_state", "expert_bias", jnp.zeros, (E,), jnp.float32).value
        B, S, _ = x_BSH.shape
        pol = self.cfg.policy
        x_TH = x_BSH.reshape(B * S, H)
        # self.param returns the unboxed array, not the LogicallyPartitioned its init makes
        w = (wi_0_EHF.astype(pol.dtype), wi_1_EHF.astype(pol.dtype), wo_EFH.astype(pol.dtype))  # pyright: ignore[reportAttributeAccessIssue]
        expert_x_TH = None
        if pol.fp8:  # the router keeps x_TH; the experts get e4m3 rows and weights
            expert_x_TH = precision.quantize_operand(self, "expert_input", x_TH, pol)
            w = tuple(
                precision.quantize_operand(self, f"{n}_kernel", w_, pol)
                for n, w_ in zip(("wi_0", "wi_1", "wo"), w)
            )
        y_TH, stats = self.routed(x_TH, gate_HE, w, bias_E, S, expert_x_TH)
        if pol.fp8:  # e5m2 gradient into the experts' output
            y_TH = precision.quantize_cotangent(self, "expert_output_grad", y_TH, pol)
        y_BSH = y_TH.reshape(B, S, H)
        if e.num_shared_experts:
            width = e.num_shared_experts * (e.shared_ffn or F)
            y_BSH = y_BSH + SwiGLU(width, self.cfg, name="shared")(x_BSH)
        return y_BSH, stats

    def routed(self, x_TH, gate_HE, w, bias_E, seq_len: int, expert_x_TH=None):
        """The routed experts: (y_TH, MoEStats) of ``w`` = (wi_0, wi_1, wo) on the T tokens
        (``moe.layer``'s pipeline, local or expert-parallel, or the capacity baseline). A
        method of its own so that ``flax.linen.intercept_methods`` can replace it (the
        benchmark's MoE-removed ablation)."""
        e = self.cfg.moe
        study = self.cfg.study
        operands = (x_TH, gate_HE, *w)
        common = dict(routing=Routing.of(e, study), seq_len=seq_len, expert_bias=bias_E)  # both layers take
        if study.capacity_factor:  # the token-dropping baseline of studies (ep 1, no fp8)
            return capacity_moe(*operands, capacity_factor=study.capacity_factor, **common)
        return dropless_moe(
            *operands,
            **common,
            plan=self.ep_plan,
            backend=e.backend,
            tile_rows=e.tile_rows or None,
            expert_input=expert_x_TH,
            platform=self.cfg.target,
        )


def _attention_sublayer(block: nn.Module, x_BSH, segment_ids_BS=None, positions_BS=None):
    """``attn(attn_norm(x))`` as submodules of ``block`` (a function, so ``train.remat=moe``
    can rematerialise it alone); ``attn`` is GQA or MLA (``model.attention_kind``)."""
    kind = MLA if block.cfg.model.attention_kind == "mla" else Attention
    return kind(block.cfg, name="attn")(
        RMSNorm(block.cfg.model.norm_eps, name="attn_norm")(x_BSH), segment_ids_BS, positions_BS
    )


class Block(nn.Module):
    """Pre-norm transformer block; ``dense`` selects a SwiGLU MLP instead of MoE.

    ``x -> (x, stats)``: the carry/output signature of ``nn.scan`` (stats None when dense);
    the packed documents' segment ids and positions (or None) are the same for every layer
    (broadcast by the scan).
    """

    cfg: ModelSettings
    dense: bool
    ep_plan: EPPlan | None = None

    @nn.compact
    def __call__(self, x_BSH, segment_ids_BS=None, positions_BS=None):
        m = self.cfg.model
        sublayer = remat.wrap_attention(_attention_sublayer, self.cfg.remat, prevent_cse=not m.scan_layers)
        x_BSH = x_BSH + sublayer(self, x_BSH, segment_ids_BS, positions_BS)
        h_BSH = RMSNorm(m.norm_eps, name="mlp_norm")(x_BSH)
        if self.dense:
            y_BSH, stats = SwiGLU(m.dense_ffn, self.cfg, name="mlp")(h_BSH), None
        else:
            y_BSH, stats = MoEBlock(self.cfg, self.ep_plan, name="moe")(h_BSH)
        return nn.with_logical_constraint(x_BSH + y_BSH, ACTIVATION_AXES), stats


def layer_groups(m) -> tuple[tuple[str, bool, range], ...]:
    """(scanned group name, dense, layer indices) of every non-empty group, in depth order."""
    groups = (
        ("dense_layers", True, range(0, m.first_dense_layers)),
        ("moe_layers", False, range(m.first_dense_layers, m.num_layers)),
    )
    return tuple(g for g in groups if len(g[2]))


def scanned(block_cls: type[nn.Module], length: int) -> type[nn.Module]:
    """``block_cls`` run ``length`` times under ``nn.scan``: one compiled body, every layer
    collection stacked on a leading ``layers`` axis, a fresh init key per layer; the
    arguments after the carry (segment ids, positions) are the same in every layer."""
    return nn.scan(
        block_cls,
        variable_axes={c: 0 for c in LAYER_COLLECTIONS},
        split_rngs={"params": True},
        length=length,
        in_axes=(nn.broadcast, nn.broadcast),  # pyright: ignore[reportArgumentType]  (flax: untyped, default 0)
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


class LMHead(NamedTuple):
    """What the logits are made of: logits_BSV = (x_BSH @ head_HV) * scale in fp32."""

    x_BSH: jax.Array  # final-normed hidden states, compute dtype
    head_HV: jax.Array  # lm_head, or the tied embedding transposed, compute dtype
    scale: float  # 1, or model.tied_logit_scale (hidden**-0.5 by default) for the tied embedding
    mtp_LBSH: jax.Array | None = None  # each MTP depth's normed hidden states (same head)


def head_logits(h: LMHead):
    """fp32 logits [B, S, V] of ``h`` (fp32 accumulation, as ``moe_train.model.loss.lm_loss``)."""
    return (
        jax.lax.dot_general(h.x_BSH, h.head_HV, (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        * h.scale
    )


def _stacked(stats):
    """Per-layer MoE stats with a leading layer axis of 1."""
    return jax.tree.map(lambda v: v[None], stats)


class Transformer(nn.Module):
    """Token ids [B,S] -> (fp32 logits [B,S,V], per-MoE-layer stats stacked on axis 0: [L, ...]);
    with ``logits=False`` -> (``LMHead``, stats): the train step's chunked loss then never
    materialises the [B, S, V] logits.

    With ``model.mtp_depth`` > 0 and ``mtp_ids_LBS`` (``moe_train.model.mtp.shifted``) the MTP
    modules run too: ``LMHead.mtp_LBSH`` holds their normed outputs and their MoE layers'
    stats follow the main model's in the stats (L = main MoE layers + depths, the depth order
    of the released checkpoints, where the MTP module is the layer after the last). Without
    ids they do not run (scoring, evaluation), except at init, which creates their weights.

    Packed documents (``moe_train.data.packing``): ``segment_ids_BS`` [B, S] keeps every
    attention (the MTP modules' too) inside its document, and the RoPE positions restart per
    document (``positions_BS``, derived from the segment ids unless given).

    ``cfg`` is what the model reads of the run's config (``moe_train.model.settings``:
    ``model_settings(cfg)``), shared by every submodule.
    """

    cfg: ModelSettings
    ep_plan: EPPlan | None = None  # expert-parallel MoE layers on the context mesh

    @nn.compact
    def __call__(
        self, tokens_BS, logits: bool = True, mtp_ids_LBS=None, segment_ids_BS=None, positions_BS=None
    ):
        m = self.cfg.model
        dt = self.cfg.policy.dtype  # bf16 under fp8: embedding and head unquantized
        embed_VH = self.param(
            "embed",
            nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
            (m.vocab_size, m.hidden),
            jnp.dtype(m.param_dtype),
        )
        table_VH = gathered(embed_VH, ("vocab", "embed"), dt)
        x_BSH = nn.with_logical_constraint(table_VH[tokens_BS], ACTIVATION_AXES)
        if segment_ids_BS is not None and positions_BS is None:
            positions_BS = packing.positions(segment_ids_BS)
        seq = (segment_ids_BS, positions_BS)
        h_BSH, stats_L = self._blocks(x_BSH, seq)
        x_BSH = RMSNorm(m.norm_eps, name="final_norm")(h_BSH)
        if m.mtp_depth and mtp_ids_LBS is None and self.is_initializing():
            mtp_ids_LBS = jnp.zeros((m.mtp_depth, *tokens_BS.shape), jnp.int32)
        mtp_LBSH = None
        if m.mtp_depth and mtp_ids_LBS is not None:
            mtp_LBSH, stats_L = self._mtp(h_BSH, table_VH, mtp_ids_LBS, stats_L, seq)
        if m.tie_embeddings:
            # The embedding is initialised at unit scale; 1/sqrt(H) keeps tied logits O(1)
            # (model.tied_logit_scale=0); released tied checkpoints use 1.
            head = LMHead(x_BSH, table_VH.T, m.tied_logit_scale or m.hidden**-0.5, mtp_LBSH)
        else:
            head_HV = self.param(
                "lm_head",
                nn.with_logical_partitioning(fan_in_init(), ("embed", "vocab")),
                (m.hidden, m.vocab_size),
                jnp.dtype(m.param_dtype),
            )
            head = LMHead(x_BSH, gathered(head_HV, ("embed", "vocab"), dt), 1.0, mtp_LBSH)
        return (head_logits(head) if logits else head), stats_L

    def _blocks(self, x_BSH, seq):
        """Every block, scanned per group or looped: (x, MoEStats stacked [L, ...] or None).
        ``seq``: (segment ids, positions), each [B, S] or None."""
        m, scan = self.cfg.model, self.cfg.model.scan_layers
        # Under scan the body is already a loop iteration: no CSE barrier needed for remat.
        block_cls = remat.wrap_block(Block, self.cfg.remat, prevent_cse=not scan)
        layer_stats = []
        for name, dense, layers in layer_groups(m):
            if scan:
                x_BSH, stats = scanned(block_cls, len(layers))(
                    self.cfg, dense=dense, ep_plan=self.ep_plan, name=name
                )(x_BSH, *seq)
                layer_stats += [] if dense else [stats]
                continue
            for i in layers:
                x_BSH, stats = block_cls(self.cfg, dense=dense, ep_plan=self.ep_plan, name=f"layer_{i}")(
                    x_BSH, *seq
                )
                layer_stats += [] if dense else [_stacked(stats)]
        return x_BSH, _concat(layer_stats)

    def _mtp(self, h_BSH, table_VH, ids_LBS, stats_L, seq):
        """The MTP depths in turn: (normed outputs [L, B, S, H], stats with theirs appended)."""
        m = self.cfg.model
        block_cls = remat.wrap_block(Block, self.cfg.remat, prevent_cse=True)
        dense = m.first_dense_layers >= m.num_layers  # V3's MTP block is a MoE block
        outs, layer_stats = [], [] if stats_L is None else [stats_L]
        for k in range(m.mtp_depth):
            emb_BSH = nn.with_logical_constraint(table_VH[ids_LBS[k]], ACTIVATION_AXES)
            h_BSH, normed_BSH, stats = MTPModule(self.cfg, block_cls, dense, self.ep_plan, name=f"mtp_{k}")(
                h_BSH, emb_BSH, *seq
            )
            outs.append(normed_BSH)
            layer_stats += [] if dense else [_stacked(stats)]
        return jnp.stack(outs), _concat(layer_stats)


def _concat(layer_stats: list):
    """Per-layer stats lists [l, ...] concatenated along the layer axis (None if empty)."""
    if not layer_stats:
        return None
    return jax.tree.map(lambda *v: jnp.concatenate(v), *layer_stats)


# ----------------------------------------------------------------------------- layouts


def _is_layered(looped: bool) -> Callable[[Any], bool]:
    if looped:
        return lambda t: isinstance(t, dict) and any(LAYER_NAME.fullmatch(str(k)) for k in t)
    return lambda t: isinstance(t, dict) and any(k in GROUPS for k in t)


def to_scanned(tree, m, stack: Callable = jnp.stack):
    """``tree`` with every dict of ``layer_{i}`` entries turned into the scanned groups
    (``stack(list of per-layer leaves)`` stacks one leaf). A collection may hold only some
    groups' layers (moe_state: the MoE layers); a group is all there or not at all."""

    def convert(d):
        if not _is_layered(True)(d):
            return d
        out = {k: v for k, v in d.items() if not LAYER_NAME.fullmatch(str(k))}
        for name, _, layers in layer_groups(m):
            present = [d[f"layer_{i}"] for i in layers if f"layer_{i}" in d]
            if len(present) not in (0, len(layers)):
                raise ValueError(f"{name}: {len(present)} of layers {layers} present")
            if present:
                out[name] = jax.tree.map(lambda *xs: stack(list(xs)), *present)
        return out

    return jax.tree.map(convert, tree, is_leaf=_is_layered(True))


def to_looped(tree, m, take: Callable = lambda x, j: x[j]):
    """The inverse of ``to_scanned``: each group's [L, ...] leaves split into ``layer_{i}``
    entries (``take(leaf, j)`` is layer j of the group)."""

    def convert(d):
        if not _is_layered(False)(d):
            return d
        out = {k: v for k, v in d.items() if k not in GROUPS}
        for name, _, layers in layer_groups(m):
            for j, i in enumerate(layers if name in d else ()):
                out[f"layer_{i}"] = jax.tree.map(lambda x, j=j: take(x, j), d[name])
        return out

    return jax.tree.map(convert, tree, is_leaf=_is_layered(False))


def is_scanned(tree) -> bool:
    """Whether a params tree has the scanned layout (False: looped)."""
    return any(k in GROUPS for k in tree)
