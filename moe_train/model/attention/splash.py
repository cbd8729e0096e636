"""TPU flash attention: JAX's Pallas TPU splash attention (``jax.experimental.pallas.ops.tpu.
splash_attention``), causal, grouped-query, packed documents through its segment ids.

The kernel takes one sequence's heads [N, S, D] with its key/value heads [Y, S, D] (Y divides
N: grouped-query attention without repeating k and v), applies no softmax scale (q is scaled
here) and has its own forward and backward Pallas kernels; the batch is a ``vmap``. Blocks of
``block`` rows (query and key, forward and both backward kernels): S is padded to a multiple
of it, and the padding sits after every real query, hidden by the causal mask (its segment id
is the last real one's). Off a TPU the kernels run in Pallas interpret mode (the tests on CPU);
``splash_unavailable`` offers it on TPUs only.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from moe_train.base.imports import import_failure
from moe_train.base.platform import Platform
from moe_train.model.attention.chunked import pad_sequence

BLOCKS = (512, 256, 128)  # block rows tried, largest first; the kernel's tiles are multiples of 128
LANES = 128  # the head dim is a multiple of this (the TPU's lane width)


def _splash():
    """(kernel module, mask module) of JAX's splash attention."""
    base = "jax.experimental.pallas.ops.tpu.splash_attention."
    return (
        importlib.import_module(base + "splash_attention_kernel"),
        importlib.import_module(base + "splash_attention_mask"),
    )


def splash_unavailable(platform: Platform, head_dim: int, v_head_dim: int) -> str | None:
    """Why ``splash`` cannot run on ``platform`` (None: it can)."""
    if platform.name != "tpu":
        return f"needs a TPU (JAX's Pallas TPU splash attention; this is {platform.name})"
    if head_dim != v_head_dim or head_dim % LANES:
        return (
            f"needs equal query/key and value head dims, a multiple of {LANES} "
            f"(got {head_dim} and {v_head_dim})"
        )
    base = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_"
    return import_failure("JAX's splash attention", base + "kernel", base + "mask")


def block_rows(seq_len: int, block: int = 0) -> int:
    """The block rows for ``seq_len``: ``block`` where given, else the largest of ``BLOCKS``
    that leaves at most one block of padding and no more blocks than needed."""
    if block:
        return block
    return next((b for b in BLOCKS if seq_len >= b), BLOCKS[-1])


def _kernel(seq_len: int, heads: int, block: int, interpret: bool):
    """The splash kernel for one sequence: causal over ``seq_len``, ``heads`` query heads.
    Built anew in each trace, never cached: its mask arrays are made by ``jnp.array`` and so
    are tracers of the trace that builds it (under flax's scan even inside
    ``ensure_compile_time_eval``); a cached kernel leaked them into the next trace (the TPU
    train step failed with an UnexpectedTracerError of int8[1, 4, 4])."""
    kernel_lib, mask_lib = _splash()
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((seq_len, seq_len)) for _ in range(heads)])
    sizes = kernel_lib.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    return kernel_lib.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_attention(
    q_BSND, k_BSYD, v_BSYD, segment_ids_BS, *, scale: float, interpret: bool, block: int = 0
):
    """Causal GQA attention by the splash kernels; returns [B, S, N, D]. ``interpret``: Pallas
    interpret mode (off a TPU)."""
    B, S, N, D = q_BSND.shape
    m = block_rows(S, block)
    q_BSND, k_BSYD, v_BSYD, segment_ids_BS = pad_sequence(q_BSND, k_BSYD, v_BSYD, segment_ids_BS, m)
    kernel_lib, _ = _splash()
    kernel = _kernel(q_BSND.shape[1], N, m, interpret)
    q_BNSD = (q_BSND * jnp.asarray(scale, q_BSND.dtype)).transpose(0, 2, 1, 3)
    k_BYSD, v_BYSD = k_BSYD.transpose(0, 2, 1, 3), v_BSYD.transpose(0, 2, 1, 3)
    if segment_ids_BS is None:
        o_BNSD = jax.vmap(kernel)(q_BNSD, k_BYSD, v_BYSD)
    else:
        one = lambda q, k, v, seg: kernel(q, k, v, segment_ids=kernel_lib.SegmentIds(q=seg, kv=seg))
        o_BNSD = jax.vmap(one)(q_BNSD, k_BYSD, v_BYSD, segment_ids_BS)
    return o_BNSD.transpose(0, 2, 1, 3)[:, :S]
