"""Chunked LM cross-entropy: the [T, V] logits never exist whole, forward or backward.

Shape letters (``moe_train.base.notation``): T tokens, H hidden, V vocab, C tokens per chunk,
P number of chunks (T padded to P*C), W vocab columns per tile (``vocab_tile``).

``lm_loss`` equals ``optax.softmax_cross_entropy_with_integer_labels`` on the full fp32
logits ``(x_TH @ head_HV) * logit_scale``, averaged over tokens, plus an optional z-loss
term on the log-partition function. It loops (``jax.lax.scan``) over chunks of C tokens and,
inside a chunk, over tiles of W vocab columns, combining the tiles' logsumexps; a
``jax.custom_vjp`` keeps only the per-token logsumexp (T floats) for the backward, which
loops over the same tiles and chunks again (tiles outside), recomputes each tile's logits
and turns them straight into the chunk's share of ``dx`` (carried in fp32) and of the tile's
``dhead`` columns (summed over the chunks in fp32, then added once into the [H, V] gradient,
carried in the head's dtype). Peak memory is a few [C, W] fp32 buffers, one [H, W] fp32
tile gradient, the O(T*H) inputs and gradients and the [H, V] head gradient in the head's
dtype, whatever T and V: the default C * W is a fixed budget (``CHUNK_LOGITS_BYTES``), so the vocab only adds
parameter-sized buffers. (With chunks outside, the [H, V] gradient was an fp32 loop carry:
XLA:GPU's while-loop double buffering held three copies of it, 3.7 GiB for Qwen3's head.)

Chunks are strided: token t goes to chunk ``t % P`` at row ``t // P``. With the tokens
sharded in contiguous blocks over devices (the kit's batch sharding), every chunk takes the
same rows from each device's block, so under ``jax.jit`` each device works on its own C/n
tokens per step and no token moves. Two consequences of the partitioner seeing global
shapes there: T and ``chunk`` count tokens over all n devices (pass ``chunk=n * c`` for c
tokens per device), and the head gradient is all-reduced tile by tile ([H, W] per tile of
each chunk). Called per device inside ``shard_map`` over the token axes instead, T and
``chunk`` are per device and the head gradient is summed once, at the shard_map boundary
(the loss is then the shard's mean: average it with ``pmean``, or re-weight by each
shard's weight sum). The trainer takes that form (``device_token_losses``).

Labels outside [0, V) are ignored: such a token gets weight 0 (no loss, no z term, no
gradient, not counted in the mean), like an ignore index. (optax instead wraps negative
labels numpy-style and returns NaN for labels >= V.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_train.base.arith import cdiv
from moe_train.moe.permute import zeros_after
from moe_train.moe.vjp import custom_vjp

CHUNK_LOGITS_BYTES = 16 << 20  # fp32 logits of one tile (the backward holds a few such buffers)
VOCAB_TILE = 2048  # most vocab columns of one tile: larger vocabularies are split
MIN_CHUNK_TOKENS = 512  # below this the tile's matmul is bound by re-reading the head
_ALIGN = 8
_VOCAB_ALIGN = 128


def vocab_tile(vocab: int, limit: int = 0) -> int:
    """Vocab columns per tile: all ``vocab`` up to ``limit`` (0: ``VOCAB_TILE``), else the
    fewest tiles of at most ``limit`` columns, balanced and rounded up to a multiple of 128
    (of ``limit`` when that is smaller). The last tile ends at V and overlaps the one before
    (its overlap is computed and masked): under 128 columns per tile at the default limit."""
    limit = limit or VOCAB_TILE
    if vocab < 1 or limit < 1:
        raise ValueError(f"vocab_tile needs vocab, limit >= 1; got {vocab}, {limit}")
    if vocab <= limit:
        return vocab
    align = min(_VOCAB_ALIGN, limit)
    return min(limit, cdiv(cdiv(vocab, cdiv(vocab, limit)), align) * align)


def default_chunk(num_tokens: int, vocab: int) -> int:
    """Tokens per chunk: about ``CHUNK_LOGITS_BYTES`` of fp32 logits per tile of
    ``vocab_tile(vocab)`` columns, never below ``MIN_CHUNK_TOKENS``, and a size that divides
    ``num_tokens`` where possible.

    A tile of [C, W] = [2048, 2048] (16 MiB) keeps the loss's working set (logits, softmax
    and their cotangent of one tile) under 64 MiB at any vocab: only W, not V, sets the
    chunk. Each chunk re-reads the whole [H, V] head and each tile re-reads the chunk's
    [C, H] rows, so a [C, H] x [H, W] bf16 matmul does about C*W/(C+W) flops per byte read:
    1024 at the square tile, far above the ridge of H100/H200-class GPUs (200-300); the floor
    (which the defaults never reach) keeps C from dropping under ~512, where it would not be.
    All T tokens fit in one chunk when they are within
    budget. Otherwise the chunk is the largest power of two within budget that divides T
    (T = batch * seq, a multiple of a large power of two, so no padding and an even split
    over power-of-two device counts), unless that is over 8x smaller than the budget; then T
    is split into equal chunks (a multiple of 8) and padded by less than one chunk.
    """
    if num_tokens < 1 or vocab < 1:
        raise ValueError(f"default_chunk needs num_tokens, vocab >= 1; got {num_tokens}, {vocab}")
    budget = max(CHUNK_LOGITS_BYTES // (4 * vocab_tile(vocab)), MIN_CHUNK_TOKENS)
    if num_tokens <= budget:
        return num_tokens
    pow2 = 1 << (budget.bit_length() - 1)
    divisor = math.gcd(num_tokens, pow2)
    if 8 * divisor >= pow2:
        return divisor
    chunks = -(-num_tokens // pow2)
    per_chunk = -(-num_tokens // chunks)
    return min(pow2, -(-per_chunk // _ALIGN) * _ALIGN)


def sharded_chunk(num_tokens: int, vocab: int, devices: int, per_device: int = 0) -> int:
    """``lm_loss``'s chunk for ``num_tokens`` split evenly over ``devices`` (batch-sharded):
    ``per_device`` tokens of each device per chunk (0: ``default_chunk`` of one device's
    share), so one tile's logits on each device stay within the budget whatever the job's
    size. Chunks are strided over the tokens, so each takes the same rows of every device."""
    local = max(num_tokens // max(devices, 1), 1)
    return min(num_tokens, devices * (per_device or default_chunk(local, vocab)))


def lm_loss(
    x_TH,
    head_HV,
    labels_T,
    *,
    chunk: int = 0,
    logit_scale: float = 1.0,
    z_loss_coef: float = 0.0,
    weights_T=None,
    vocab_chunk: int = 0,
) -> tuple[jax.Array, dict]:
    """Mean token cross-entropy of logits = (x_TH @ head_HV) * logit_scale, computed in fp32
    (x and head may be bf16: the matmul accumulates in fp32 with preferred_element_type), in
    chunks of `chunk` tokens (0 = default_chunk(T, V)) by tiles of ``vocab_tile(V,
    vocab_chunk)`` vocab columns (0: up to ``VOCAB_TILE``). Returns (loss, aux) where loss =
    ce + z_loss_coef * mean(logsumexp^2) and aux = {"ce": ce, "logit_z": mean(logsumexp^2)}.
    weights_T: optional float mask/weights per token (e.g. 0 for padding); the mean is
    sum(w*ce)/max(sum(w), 1) — with None all ones. Both means use the same weights.

    Gradients flow to ``x_TH`` and ``head_HV`` only (in their dtypes); the backward matmuls
    take the logits' cotangent in the matmul dtype and accumulate in fp32, as autodiff of a
    bf16 matmul does. ``head_HV`` may be a transposed tied embedding (``embed_VH.T``): XLA
    folds the transpose into the matmuls' dimension numbers. Labels outside [0, V) are
    ignored (weight 0), see the module docstring. ``chunk``, ``vocab_chunk`` and
    ``logit_scale`` are static Python numbers.
    """
    nll_T, lse_T = token_losses(
        x_TH, head_HV, labels_T, chunk=chunk, logit_scale=logit_scale, vocab_chunk=vocab_chunk
    )
    V = head_HV.shape[1]
    valid_T = (labels_T >= 0) & (labels_T < V)
    w_T = jnp.ones(labels_T.shape, jnp.float32) if weights_T is None else weights_T.astype(jnp.float32)
    w_T = jax.lax.stop_gradient(jnp.where(valid_T, w_T, 0.0))
    denom = jnp.maximum(jnp.sum(w_T), 1.0)
    ce = jnp.sum(w_T * nll_T) / denom
    logit_z = jnp.sum(w_T * lse_T**2) / denom
    return ce + z_loss_coef * logit_z, {"ce": ce, "logit_z": logit_z}


def token_losses(x_TH, head_HV, labels_T, *, chunk: int = 0, logit_scale: float = 1.0, vocab_chunk: int = 0):
    """Per token: (cross-entropy ``lse - logit[label]``, logsumexp ``lse``), both fp32 [T], of
    logits = (x_TH @ head_HV) * logit_scale, chunked and tiled as ``lm_loss`` (which takes
    their weighted means). A label outside [0, V) scores as label 0: weight such tokens 0.
    One call over several token sets (the main head's and the MTP depths', concatenated)
    loops over the head once, so its [H, V] gradient exists once, not once per set."""
    T, H = x_TH.shape
    V = head_HV.shape[1]
    if T < 1 or head_HV.shape[0] != H or labels_T.shape != (T,):
        raise ValueError(f"lm_loss shapes: x {x_TH.shape}, head {head_HV.shape}, labels {labels_T.shape}")
    if chunk < 0 or vocab_chunk < 0:
        raise ValueError(f"lm_loss chunk and vocab_chunk must be >= 0 (0 picks), got {chunk}, {vocab_chunk}")
    chunk = min(chunk or default_chunk(T, V), T)
    labels_T = jnp.where((labels_T >= 0) & (labels_T < V), labels_T, 0).astype(jnp.int32)
    operands = _same_variance(x_TH, head_HV, labels_T)
    return _nll_and_lse(*operands, chunk, vocab_tile(V, vocab_chunk), float(logit_scale))


def device_token_losses(
    x_TH, head_HV, labels_T, axes: tuple[str, ...], *, chunk: int, logit_scale: float = 1.0
):
    """``token_losses``' cross-entropies ([T] fp32), each device computing its own tokens'
    inside ``jax.shard_map`` over the mesh ``axes`` that split the tokens (the context
    mesh's; ``x_TH`` and ``labels_T`` split in contiguous blocks, ``head_HV`` whole):
    ``chunk`` counts one device's tokens. The head's gradient is then each device's sum over
    its chunks and tiles, reduced once at the map's boundary in the head's dtype, not
    all-reduced per tile in fp32 as under ``jax.jit`` (module docstring): XLA:GPU all-reduced
    DeepSeek-V3's [7168, 2048] fp32 tile gradients over all 256 GPUs of its 64-rack job, 64
    times per micro-batch (``make compile``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape[a] for a in axes) == 1:
        return token_losses(x_TH, head_HV, labels_T, chunk=chunk, logit_scale=logit_scale)[0]
    tokens = jax.sharding.PartitionSpec(axes)

    def local(x_TH, head_HV, labels_T):
        return token_losses(x_TH, head_HV, labels_T, chunk=chunk, logit_scale=logit_scale)[0]

    return jax.shard_map(
        local,
        in_specs=(jax.sharding.PartitionSpec(axes, None), jax.sharding.PartitionSpec(), tokens),
        out_specs=tokens,
    )(x_TH, head_HV, labels_T)


def _to_chunks(a_T, chunk: int):
    """[T, ...] -> [C, P, ...], token t at [t // P, t % P] (chunk g is column g): a reshape,
    no copy, unless T needs padding (at the end, with zeros) to P*C."""
    T = a_T.shape[0]
    P = cdiv(T, chunk)
    if P * chunk > T:
        a_T = jnp.pad(a_T, [(0, P * chunk - T)] + [(0, 0)] * (a_T.ndim - 1))
    return a_T.reshape(chunk, P, *a_T.shape[1:])


def _chunk(a_CP, g):
    """Chunk ``g`` of a ``_to_chunks`` array: [C, ...]."""
    return jax.lax.dynamic_index_in_dim(a_CP, g, axis=1, keepdims=False)


def _from_chunks(a_CP, num_tokens: int):
    """Inverse of ``_to_chunks``: [C, P, ...] -> [T, ...]."""
    return a_CP.reshape(-1, *a_CP.shape[2:])[:num_tokens]


def _loop(step, carry, n: int):
    """``jax.lax.scan`` of ``step(carry, i) -> (carry, out)`` over i = 0..n-1 (outputs
    stacked on a leading axis); a direct call when n = 1."""
    if n == 1:
        carry, out = step(carry, jnp.int32(0))
        return carry, jax.tree.map(lambda o: o[None], out)
    return jax.lax.scan(step, carry, jnp.arange(n, dtype=jnp.int32))


def _logits(x_CH, head_HV, scale: float):
    return (
        jax.lax.dot_general(x_CH, head_HV, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        * scale
    )


def _operands(x_TH, head_HV):
    dt = jnp.promote_types(x_TH.dtype, head_HV.dtype)
    return x_TH.astype(dt), head_HV.astype(dt)


@custom_vjp(nondiff_argnums=(3, 4, 5))
def _nll_and_lse(x_TH, head_HV, labels_T, chunk: int, width: int, scale: float):
    return _nll_and_lse_fwd(x_TH, head_HV, labels_T, chunk, width, scale)[0]


def _tiles(x_CH, head_HV, width: int, scale: float, body, carry):
    """``body(carry, tile) -> carry`` over the vocab tiles of one chunk. A tile is
    ``(logits_CW, start, first, fresh_W)``: the fp32 logits of W = ``width`` vocab
    columns from ``start``, of which those from ``first`` on (``fresh_W``) are new: the last
    tile ends at V and overlaps the one before when W does not divide V; the overlap counts
    once, in the earlier tile."""

    def step(carry, v):
        head_HW, start, first, fresh_W = _vocab_tile(head_HV, v, width)
        tile = (_logits(x_CH, head_HW, scale), start, first, fresh_W)
        return body(carry, tile), None

    return _loop(step, carry, cdiv(head_HV.shape[1], width))[0]


def _vocab_tile(head_HV, v, width: int):
    """Vocab tile ``v``: ``(head_HW, start, first, fresh_W)``, the head's W = ``width``
    columns from ``start`` = min(``first``, V - W), ``first`` = v * W, and which of them are
    new (from ``first`` on: the last tile ends at V and may overlap the one before)."""
    first = v * width
    start = jnp.minimum(first, head_HV.shape[1] - width)
    head_HW = jax.lax.dynamic_slice_in_dim(head_HV, start, width, axis=1)
    fresh_W = start + jnp.arange(width, dtype=jnp.int32) >= first
    return head_HW, start, first, fresh_W


def _chunk_lse_and_picked(x_CH, labels_C, head_HV, width: int, scale: float):
    """(logsumexp over the vocab, the label's logit) of one chunk's tokens, tile by tile."""

    def body(carry, tile):
        lse_C, picked_C = carry
        logits_CW, start, first, fresh_W = tile
        logits_CW = jnp.where(fresh_W, logits_CW, -jnp.inf)
        lse_C = jnp.logaddexp(lse_C, jax.nn.logsumexp(logits_CW, axis=-1))
        col_C = jnp.clip(labels_C - start, 0, width - 1)
        hit_C = jnp.take_along_axis(logits_CW, col_C[:, None], axis=-1)[:, 0]
        here_C = (labels_C >= first) & (labels_C < start + width)
        return lse_C, picked_C + jnp.where(here_C, hit_C, 0.0)

    zero_C = _zeros_varying_like(labels_C.shape, x_CH, head_HV)
    return _tiles(x_CH, head_HV, width, scale, body, (zero_C - jnp.inf, zero_C))


def _nll_and_lse_fwd(x_TH, head_HV, labels_T, chunk: int, width: int, scale: float):
    x_mm, head = _operands(x_TH, head_HV)
    T = x_TH.shape[0]
    x_CPH, labels_CP = _to_chunks(x_mm, chunk), _to_chunks(labels_T, chunk)

    def per_chunk(_, g):
        return None, _chunk_lse_and_picked(_chunk(x_CPH, g), _chunk(labels_CP, g), head, width, scale)

    _, out_PC = _loop(per_chunk, None, x_CPH.shape[1])
    lse_T, picked_T = (_from_chunks(a_PC.T, T) for a_PC in out_PC)
    return (lse_T - picked_T, lse_T), (x_TH, head_HV, labels_T, lse_T)


def _dlogits(inputs, logits_CW, start, fresh_W, head_dtype, width: int, scale: float):
    """One tile's logits cotangent, in the matmul dtype: d/dlogits of g_nll * (lse -
    logit[label]) + g_lse * lse per token, zero on the tile's columns an earlier tile owns."""
    labels_C, g_nll_C, g_lse_C, lse_C = inputs
    p_CW = jnp.exp(logits_CW - lse_C[:, None])
    onehot_CW = (labels_C - start)[:, None] == jnp.arange(width, dtype=jnp.int32)
    dlogits_CW = p_CW * (g_nll_C + g_lse_C)[:, None] - jnp.where(onehot_CW, g_nll_C[:, None], 0.0)
    return (jnp.where(fresh_W, dlogits_CW, 0.0) * scale).astype(head_dtype)


def _nll_and_lse_bwd(chunk: int, width: int, scale: float, residuals, cotangents):
    """Vocab tiles outside, chunks inside: each tile's [H, W] head gradient is summed over
    the chunks in fp32, then added once into the [H, V] gradient, which is carried in the
    head's dtype (not in fp32 through every chunk); ``dx`` is carried in fp32 across tiles."""
    x_in, head_in, labels_T, lse_T = residuals
    g_nll_T, g_lse_T = (g.astype(jnp.float32) for g in cotangents)
    x_TH, head = _operands(x_in, head_in)
    chunked = (_to_chunks(a, chunk) for a in (x_TH, labels_T, g_nll_T, g_lse_T, lse_T))
    x_CPH, labels_CP, g_nll_CP, g_lse_CP, lse_CP = chunked
    H, V = head.shape

    def per_tile(carry, v):
        dx_CPH, dhead_HV = carry
        head_HW, start, _, fresh_W = _vocab_tile(head, v, width)

        def per_chunk(carry, g):
            dhead_HW, dx_CPH = carry
            x_CH = _chunk(x_CPH, g)
            inputs = tuple(_chunk(a, g) for a in (labels_CP, g_nll_CP, g_lse_CP, lse_CP))
            dlogits_CW = _dlogits(
                inputs, _logits(x_CH, head_HW, scale), start, fresh_W, head.dtype, width, scale
            )
            dx_CH = _chunk(dx_CPH, g) + jax.lax.dot_general(
                dlogits_CW, head_HW, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            dhead_HW = dhead_HW + jax.lax.dot_general(
                x_CH, dlogits_CW, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            return (dhead_HW, jax.lax.dynamic_update_index_in_dim(dx_CPH, dx_CH, g, axis=1)), None

        dhead0 = _zeros_varying_like((H, width), x_TH, head, g_nll_T, g_lse_T)
        (dhead_HW, dx_CPH), _ = _loop(per_chunk, (dhead0, dx_CPH), x_CPH.shape[1])
        # added, not written: the last tile overlaps the one before (zeros on its columns)
        old_HW = jax.lax.dynamic_slice_in_dim(dhead_HV, start, width, axis=1)
        new_HW = (old_HW + dhead_HW).astype(dhead_HV.dtype)
        return (dx_CPH, jax.lax.dynamic_update_slice_in_dim(dhead_HV, new_HW, start, axis=1)), None

    dx0 = _zeros_varying_like(x_CPH.shape, x_TH, head, g_nll_T, g_lse_T)
    # made from the head, not a constant held from early on (``permute.zeros_after``)
    dhead0 = (zeros_after(head.shape, jnp.float32, head) + _empty_sum(x_TH, g_nll_T, g_lse_T)).astype(
        head_in.dtype
    )
    (dx_CPH, dhead_HV), _ = _loop(per_tile, (dx0, dhead0), cdiv(V, width))
    return (_from_chunks(dx_CPH, x_TH.shape[0]).astype(x_in.dtype), dhead_HV, None)


def _empty_sum(*arrays):
    """0.0 that varies over the manual mesh axes (inside shard_map) of every array."""
    return sum(jnp.sum(a.reshape(-1)[:0]).astype(jnp.float32) for a in arrays)


def _same_variance(*arrays):
    """The arrays, each made to vary over the union of their manual mesh axes by adding an
    empty sum (0; XLA folds it; outside shard_map nothing changes). Inside shard_map the
    custom_vjp's cotangents then match its inputs' types, and the gradient of a replicated
    head is summed over the token shards once, by autodiff of this add."""
    zero = _empty_sum(*arrays)
    assert isinstance(zero, jax.Array), "a sum over at least one array"
    return [a + zero.astype(a.dtype) for a in arrays]


def _zeros_varying_like(shape, *arrays):
    """fp32 zeros of ``shape`` with the manual-axis type of ``arrays``: a scan carry must have
    the type of its update."""
    return jnp.zeros(shape, jnp.float32) + _empty_sum(*arrays)


_nll_and_lse.defvjp(_nll_and_lse_fwd, _nll_and_lse_bwd)
