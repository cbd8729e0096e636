"""Flash-style causal attention in plain JAX: memory linear in S on every platform.

The sequence is padded to P blocks of ``block`` rows (queries and keys use the same blocks)
and laid out block-major ([P, B, Y, G, C, ...]; shape letters: ``moe_train.base.notation``, as
listed in ``moe_train.model.attention``). The forward pass scans the query blocks; for query block i it loops
over key blocks 0..i-1 without a causal mask and then the diagonal block i with one, keeping a
running row max and row sum in fp32 (online softmax), so blocks above the diagonal are never
computed. GQA works on grouped queries [Y, G]: K/V are never repeated per query head.

``jax.custom_vjp``: the forward saves q, k, v, the output and the per-row logsumexp (all
O(S)); the backward scans the key blocks, recomputes each block's probabilities from q, k and
the logsumexp, accumulates dk/dv in the loop carry and dq into a [P, ...] fp32 buffer.
Every [P, ...] result (the forward's output and logsumexp, dq, dk, dv) is a loop-carried
buffer written block by block and made by ``zeros_after`` from the input it follows: a scan's
stacked outputs start as constant buffers, which XLA:GPU made early and held side by side
(eight [P, ...] dk buffers at the MTP block's backward of deepseek-v3, ``make compile PEAK=1``);
dk and dv are stored in k's and v's dtype (fp32 stacks held twice the bytes).

Padding: padded keys sit after every real query, so the causal mask alone hides them; padded
query rows (their segment id repeats the last real one) produce finite garbage that is sliced
off, and their zero cotangent contributes nothing to dk/dv. Masked scores are a large finite
negative, not -inf: a row whose first key blocks are all masked (another document) briefly
counts them, then the first unmasked block's running max scales them by exp(NEG - m) = 0;
every row has at least one unmasked key (itself), so no row ends up empty.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_train.moe.permute import zeros_after
from moe_train.moe.vjp import custom_vjp

F32 = jnp.float32
NEG = -0.7 * float(np.finfo(np.float32).max)  # masked score (finite; see the module doc)


def pad_sequence(q_BSND, k_BSYD, v_BSYJ, segment_ids_BS, multiple: int):
    """q, k, v and the segment ids with S padded to a multiple of ``multiple``: the padding
    sits after every real query, hidden by the causal mask, in the last real segment."""
    pad = -q_BSND.shape[1] % multiple
    if not pad:
        return q_BSND, k_BSYD, v_BSYJ, segment_ids_BS
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    q_BSND, k_BSYD, v_BSYJ = (jnp.pad(x, widths) for x in (q_BSND, k_BSYD, v_BSYJ))
    if segment_ids_BS is not None:
        segment_ids_BS = jnp.pad(segment_ids_BS, ((0, 0), (0, pad)), mode="edge")
    return q_BSND, k_BSYD, v_BSYJ, segment_ids_BS


def chunked_attention(q_BSND, k_BSYD, v_BSYJ, segment_ids_BS, *, scale: float, block: int):
    """Causal GQA attention through blocks of ``block`` rows; returns [B, S, N, J]."""
    B, S, N, D = q_BSND.shape
    Y, J = k_BSYD.shape[2], v_BSYJ.shape[3]
    G, P = N // Y, -(-S // block)
    q_BSND, k_BSYD, v_BSYJ, segment_ids_BS = pad_sequence(q_BSND, k_BSYD, v_BSYJ, segment_ids_BS, block)
    q_PBYGCD = q_BSND.reshape(B, P, block, Y, G, D).transpose(1, 0, 3, 4, 2, 5)
    k_PBYCD = k_BSYD.reshape(B, P, block, Y, D).transpose(1, 0, 3, 2, 4)
    v_PBYCJ = v_BSYJ.reshape(B, P, block, Y, J).transpose(1, 0, 3, 2, 4)
    seg_PBC = None
    if segment_ids_BS is not None:
        seg_PBC = segment_ids_BS.reshape(B, P, block).transpose(1, 0, 2)
    o_PBYGCJ = _flash(q_PBYGCD, k_PBYCD, v_PBYCJ, seg_PBC, float(scale))
    o_BSNJ = o_PBYGCJ.transpose(1, 0, 4, 2, 3, 5).reshape(B, P * block, N, J)
    return o_BSNJ[:, :S]


def _masked_scores(q_BYGCD, k_BYCD, seg_PBC, i, j, diagonal: bool, scale: float):
    """fp32 scores of query block i against key block j, masked: [B, Y, G, C, C]."""
    s = jnp.einsum("bkgqd,bkrd->bkgqr", q_BYGCD, k_BYCD, preferred_element_type=F32) * scale
    mask = None
    if diagonal:  # same block: row q sees columns r <= q
        rows = s.shape[-2]
        mask = jnp.tril(jnp.ones((rows, rows), bool))
    if seg_PBC is not None:
        same_BCC = seg_PBC[i][:, :, None] == seg_PBC[j][:, None, :]
        same = same_BCC[:, None, None]
        mask = same if mask is None else mask & same
    return s if mask is None else jnp.where(mask, s, NEG)


def _forward(q_PBYGCD, k_PBYCD, v_PBYCJ, seg_PBC, scale):
    """(output [P, B, Y, G, C, J] in v's dtype, logsumexp [P, B, Y, G, C] fp32)."""

    def query_block(out, xs):
        i, q_BYGCD = xs

        def step(j, carry, diagonal):
            m, l, acc = carry
            s = _masked_scores(q_BYGCD, k_PBYCD[j], seg_PBC, i, j, diagonal, scale)
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            pv = jnp.einsum(
                "bkgqr,bkrj->bkgqj", p.astype(v_PBYCJ.dtype), v_PBYCJ[j], preferred_element_type=F32
            )
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

        rows = q_BYGCD.shape[:-1]
        init = (jnp.full(rows, NEG, F32), jnp.zeros(rows, F32), jnp.zeros((*rows, v_PBYCJ.shape[-1]), F32))
        carry = jax.lax.fori_loop(0, i, lambda j, c: step(j, c, False), init)
        m, l, acc = step(i, carry, True)
        o, lse = out
        return (o.at[i].set((acc / l[..., None]).astype(o.dtype)), lse.at[i].set(m + jnp.log(l))), None

    P = q_PBYGCD.shape[0]
    lse = zeros_after(q_PBYGCD.shape[:-1], F32, q_PBYGCD[..., 0])
    o = jnp.broadcast_to(lse[..., None].astype(v_PBYCJ.dtype), (*lse.shape, v_PBYCJ.shape[-1]))
    (o, lse), _ = jax.lax.scan(query_block, (o, lse), (jnp.arange(P), q_PBYGCD))
    return o, lse


def _backward(scale, res, do_PBYGCJ):
    """dq, dk, dv from the saved (q, k, v, segments, output, logsumexp); no [S, S] array."""
    q_PBYGCD, k_PBYCD, v_PBYCJ, seg_PBC, o_PBYGCJ, lse_PBYGC = res
    P = q_PBYGCD.shape[0]
    delta_PBYGC = jnp.sum(do_PBYGCJ.astype(F32) * o_PBYGCJ.astype(F32), axis=-1)

    def key_block(bufs, xs):
        dq_buf, dk_buf, dv_buf = bufs
        j, k_BYCD, v_BYCJ = xs

        def step(i, carry, diagonal):
            dq_buf, dk, dv = carry
            q_BYGCD, do_BYGCJ = q_PBYGCD[i], do_PBYGCJ[i]
            s = _masked_scores(q_BYGCD, k_BYCD, seg_PBC, i, j, diagonal, scale)
            p = jnp.exp(s - lse_PBYGC[i][..., None])
            dv = dv + jnp.einsum(
                "bkgqr,bkgqj->bkrj", p.astype(do_BYGCJ.dtype), do_BYGCJ, preferred_element_type=F32
            )
            dp = jnp.einsum("bkgqj,bkrj->bkgqr", do_BYGCJ, v_BYCJ, preferred_element_type=F32)
            ds = (p * (dp - delta_PBYGC[i][..., None]) * scale).astype(q_BYGCD.dtype)
            dq_i = jnp.einsum("bkgqr,bkrd->bkgqd", ds, k_BYCD, preferred_element_type=F32)
            dk = dk + jnp.einsum("bkgqr,bkgqd->bkrd", ds, q_BYGCD, preferred_element_type=F32)
            return dq_buf.at[i].add(dq_i), dk, dv

        init = (dq_buf, jnp.zeros(k_BYCD.shape, F32), jnp.zeros(v_BYCJ.shape, F32))
        carry = step(j, init, True)
        dq_buf, dk, dv = jax.lax.fori_loop(j + 1, P, lambda i, c: step(i, c, False), carry)
        return (
            dq_buf,
            dk_buf.at[j].set(dk.astype(dk_buf.dtype)),
            dv_buf.at[j].set(dv.astype(dv_buf.dtype)),
        ), None

    bufs = tuple(
        zeros_after(x.shape, dt, x)
        for x, dt in ((q_PBYGCD, F32), (k_PBYCD, k_PBYCD.dtype), (v_PBYCJ, v_PBYCJ.dtype))
    )
    (dq_buf, dk, dv), _ = jax.lax.scan(key_block, bufs, (jnp.arange(P), k_PBYCD, v_PBYCJ))
    return (dq_buf.astype(q_PBYGCD.dtype), dk, dv, None)


@custom_vjp(nondiff_argnums=(4,))
def _flash(q_PBYGCD, k_PBYCD, v_PBYCJ, seg_PBC, scale):
    return _forward(q_PBYGCD, k_PBYCD, v_PBYCJ, seg_PBC, scale)[0]


def _flash_fwd(q_PBYGCD, k_PBYCD, v_PBYCJ, seg_PBC, scale):
    o, lse = _forward(q_PBYGCD, k_PBYCD, v_PBYCJ, seg_PBC, scale)
    return o, (q_PBYGCD, k_PBYCD, v_PBYCJ, seg_PBC, o, lse)


_flash.defvjp(_flash_fwd, _backward)
