"""Chunked LM cross-entropy: the [T, V] logits never exist whole, forward or backward.

Letter key for tensor names (as in ``moe_train.model.transformer``, plus the two chunk letters):
  T tokens, H hidden, V vocab, C tokens per chunk, G number of chunks (T padded to G*C).

``lm_loss`` equals ``optax.softmax_cross_entropy_with_integer_labels`` on the full fp32
logits ``(x_TH @ head_HV) * logit_scale``, averaged over tokens, plus an optional z-loss
term on the log-partition function. It loops (``jax.lax.map``) over chunks of C tokens; a
``jax.custom_vjp`` keeps only the per-token logsumexp (T floats) for the backward, which
scans the chunks again, recomputes each chunk's logits and turns them straight into that
chunk's ``dx`` and its share of ``dhead`` (accumulated in fp32). Peak memory is a few
[C, V] fp32 buffers plus the O(T*H) inputs and gradients, whatever T.

Chunks are strided: token t goes to chunk ``t % G`` at row ``t // G``. With the tokens
sharded in contiguous blocks over devices (the kit's batch sharding), every chunk takes the
same rows from each device's block, so under ``jax.jit`` each device works on its own C/n
tokens per step and no token moves. Two consequences of the partitioner seeing global
shapes there: T and ``chunk`` count tokens over all n devices (pass ``chunk=n * c`` for c
tokens per device), and the [H, V] head gradient is all-reduced once per chunk. Called per
device inside ``shard_map`` over the token axes instead, T and ``chunk`` are per device and
the head gradient is summed once, at the shard_map boundary (the loss is then the shard's
mean: average it with ``pmean``, or re-weight by each shard's weight sum).

Labels outside [0, V) are ignored: such a token gets weight 0 (no loss, no z term, no
gradient, not counted in the mean), like an ignore index. (optax instead wraps negative
labels numpy-style and returns NaN for labels >= V.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

CHUNK_LOGITS_BYTES = 256 << 20  # fp32 logits of one chunk (the backward holds a few such buffers)
MIN_CHUNK_TOKENS = 512  # below this the chunk's matmul is bound by re-reading the head
_ALIGN = 8


def default_chunk(num_tokens: int, vocab: int) -> int:
    """Tokens per chunk: about ``CHUNK_LOGITS_BYTES`` of fp32 logits, never below
    ``MIN_CHUNK_TOKENS``, and a size that divides ``num_tokens`` where possible.

    256 MiB keeps the loss's working set (logits, softmax and their cotangent of one chunk,
    under 1 GiB) small next to an accelerator's memory at any vocab. Each chunk re-reads the
    whole [H, V] head, so a [C, H] x [H, V] bf16 matmul does about C flops per byte of head
    read: under ~512 tokens it is memory-bound on H100/H200-class GPUs (ridge 200-300), hence
    the floor. All T tokens fit in one chunk when they are within budget (the whole-logits
    computation of old). Otherwise the chunk is the largest power of two within budget that
    divides T (T = batch * seq, a multiple of a large power of two, so no padding and an even
    split over power-of-two device counts), unless that is over 8x smaller than the budget;
    then T is split into equal chunks (a multiple of 8) and padded by less than one chunk.
    """
    if num_tokens < 1 or vocab < 1:
        raise ValueError(f"default_chunk needs num_tokens, vocab >= 1; got {num_tokens}, {vocab}")
    budget = max(CHUNK_LOGITS_BYTES // (4 * vocab), MIN_CHUNK_TOKENS)
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
    share), so one chunk's logits on each device stay within the budget whatever the job's
    size. Chunks are strided over the tokens, so each takes the same rows of every device."""
    local = max(num_tokens // max(devices, 1), 1)
    return min(num_tokens, devices * (per_device or default_chunk(local, vocab)))


def lm_loss(x_TH, head_HV, labels_T, *, chunk: int = 0, logit_scale: float = 1.0,
            z_loss_coef: float = 0.0, weights_T=None) -> tuple[jax.Array, dict]:
    """Mean token cross-entropy of logits = (x_TH @ head_HV) * logit_scale, computed in fp32
    (x and head may be bf16: the matmul accumulates in fp32 with preferred_element_type), in
    chunks of `chunk` tokens (0 = default_chunk(T, V)). Returns (loss, aux) where loss =
    ce + z_loss_coef * mean(logsumexp^2) and aux = {"ce": ce, "logit_z": mean(logsumexp^2)}.
    weights_T: optional float mask/weights per token (e.g. 0 for padding); the mean is
    sum(w*ce)/max(sum(w), 1) — with None all ones. Both means use the same weights.

    Gradients flow to ``x_TH`` and ``head_HV`` only (in their dtypes); the backward matmuls
    take the logits' cotangent in the matmul dtype and accumulate in fp32, as autodiff of a
    bf16 matmul does. ``head_HV`` may be a transposed tied embedding (``embed_VH.T``): XLA
    folds the transpose into the matmuls' dimension numbers. Labels outside [0, V) are
    ignored (weight 0), see the module docstring. ``chunk`` and ``logit_scale`` are static
    Python numbers.
    """
    T, H = x_TH.shape
    V = head_HV.shape[1]
    if T < 1 or head_HV.shape[0] != H or labels_T.shape != (T,):
        raise ValueError(f"lm_loss shapes: x {x_TH.shape}, head {head_HV.shape}, "
                         f"labels {labels_T.shape}")
    if chunk < 0:
        raise ValueError(f"lm_loss chunk must be >= 0 (0 picks), got {chunk}")
    chunk = min(chunk or default_chunk(T, V), T)
    valid_T = (labels_T >= 0) & (labels_T < V)
    w_T = jnp.ones((T,), jnp.float32) if weights_T is None else weights_T.astype(jnp.float32)
    w_T = jax.lax.stop_gradient(jnp.where(valid_T, w_T, 0.0))
    labels_T = jnp.where(valid_T, labels_T, 0).astype(jnp.int32)
    operands = _same_variance(x_TH, head_HV, labels_T, w_T)
    ce, logit_z = _ce_and_z(*operands, chunk, float(logit_scale))
    return ce + z_loss_coef * logit_z, {"ce": ce, "logit_z": logit_z}


def _to_chunks(a_T, chunk: int):
    """[T, ...] -> [G, C, ...], token t at [t % G, t // G]; padded at the end with zeros."""
    T = a_T.shape[0]
    G = -(-T // chunk)
    a_T = jnp.pad(a_T, [(0, G * chunk - T)] + [(0, 0)] * (a_T.ndim - 1))
    return jnp.swapaxes(a_T.reshape(chunk, G, *a_T.shape[1:]), 0, 1)


def _from_chunks(a_GC, num_tokens: int):
    """Inverse of ``_to_chunks``: [G, C, ...] -> [T, ...]."""
    a = jnp.swapaxes(a_GC, 0, 1)
    return a.reshape(-1, *a.shape[2:])[:num_tokens]


def _logits(x_CH, head_HV, scale: float):
    return jax.lax.dot_general(x_CH, head_HV, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32) * scale


def _operands(x_TH, head_HV):
    dt = jnp.promote_types(x_TH.dtype, head_HV.dtype)
    return x_TH.astype(dt), head_HV.astype(dt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ce_and_z(x_TH, head_HV, labels_T, w_T, chunk: int, scale: float):
    return _ce_and_z_fwd(x_TH, head_HV, labels_T, w_T, chunk, scale)[0]


def _ce_and_z_fwd(x_TH, head_HV, labels_T, w_T, chunk: int, scale: float):
    x_mm, head = _operands(x_TH, head_HV)

    def per_chunk(inputs):
        x_CH, labels_C = inputs
        logits_CV = _logits(x_CH, head, scale)
        picked_C = jnp.take_along_axis(logits_CV, labels_C[:, None], axis=-1)[:, 0]
        return jax.nn.logsumexp(logits_CV, axis=-1), picked_C

    T = x_TH.shape[0]
    lse_GC, picked_GC = jax.lax.map(per_chunk, (_to_chunks(x_mm, chunk),
                                                _to_chunks(labels_T, chunk)))
    lse_T, picked_T = _from_chunks(lse_GC, T), _from_chunks(picked_GC, T)
    denom = jnp.maximum(jnp.sum(w_T), 1.0)
    ce = jnp.sum(w_T * (lse_T - picked_T)) / denom
    logit_z = jnp.sum(w_T * lse_T ** 2) / denom
    return (ce, logit_z), (x_TH, head_HV, labels_T, w_T / denom, lse_T)


def _ce_and_z_bwd(chunk: int, scale: float, residuals, cotangents):
    x_in, head_in, labels_T, coef_T, lse_T = residuals
    g_ce, g_z = cotangents
    x_TH, head = _operands(x_in, head_in)
    x_GCH, labels_GC, coef_GC, lse_GC = (_to_chunks(a, chunk)
                                         for a in (x_TH, labels_T, coef_T, lse_T))

    def body(dhead_HV, inputs):
        x_CH, labels_C, coef_C, lse_C = inputs
        logits_CV = _logits(x_CH, head, scale)
        p_CV = jnp.exp(logits_CV - lse_C[:, None])
        onehot_CV = labels_C[:, None] == jnp.arange(logits_CV.shape[1], dtype=jnp.int32)
        # d/dlogits of coef * (g_ce * (lse - logit[label]) + g_z * lse^2)
        dlogits_CV = coef_C[:, None] * (p_CV * (g_ce + 2.0 * g_z * lse_C[:, None])
                                        - jnp.where(onehot_CV, g_ce, 0.0))
        dlogits_CV = (dlogits_CV * scale).astype(head.dtype)
        dx_CH = jax.lax.dot_general(dlogits_CV, head, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
        dhead_HV = dhead_HV + jax.lax.dot_general(x_CH, dlogits_CV, (((0,), (0,)), ((), ())),
                                                  preferred_element_type=jnp.float32)
        return dhead_HV, dx_CH.astype(x_in.dtype)

    dhead0 = _zeros_varying_like(head.shape, x_TH, head, g_ce, g_z)
    dhead_HV, dx_GCH = jax.lax.scan(body, dhead0, (x_GCH, labels_GC, coef_GC, lse_GC))
    return (_from_chunks(dx_GCH, x_TH.shape[0]), dhead_HV.astype(head_in.dtype), None, None)


def _empty_sum(*arrays):
    """0.0 that varies over the manual mesh axes (inside shard_map) of every array."""
    return sum(jnp.sum(a.reshape(-1)[:0]).astype(jnp.float32) for a in arrays)


def _same_variance(*arrays):
    """The arrays, each made to vary over the union of their manual mesh axes by adding an
    empty sum (0; XLA folds it; outside shard_map nothing changes). Inside shard_map the
    custom_vjp's cotangents then match its inputs' types, and the gradient of a replicated
    head is summed over the token shards once, by autodiff of this add."""
    zero = _empty_sum(*arrays)
    return [a + zero.astype(a.dtype) for a in arrays]


def _zeros_varying_like(shape, *arrays):
    """fp32 zeros of ``shape`` with the manual-axis type of ``arrays``: a scan carry must have
    the type of its update."""
    return jnp.zeros(shape, jnp.float32) + _empty_sum(*arrays)


_ce_and_z.defvjp(_ce_and_z_fwd, _ce_and_z_bwd)
