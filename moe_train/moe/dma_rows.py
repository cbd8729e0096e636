"""Summing gathered rows by per-row DMAs: a Pallas TPU kernel for ``out[t] = sum_k src[idx[t, k]]``.

Shape letters (``moe_train.base.notation``): T tokens, K rows per token, R source rows, H hidden,
C = H / 128 lane groups, L = 128 lanes, b tokens per grid step.

The unpermute (each token's K expert outputs, summed) and the permute's backward (each token's K
row gradients, summed) are this sum. XLA's gather from an [R, H] source of T*K rows ran at a
third of a copy's speed on a TPU v5e (the unpermute at Qwen3's shape: 6.19 ms, where an
elementwise pass over the rows took 2.36 ms); this kernel copies each row from HBM into VMEM by
its own DMA, sums a token's K rows in fp32 there and writes [b, H] blocks. A DMA of one row of a
2-D [R, H] array does not compile (Mosaic: a slice along the tiled dimensions must be whole
tiles), so the rows are the leading dimension of [R, C, L], and an [R, H] source is relaid out
first. Measured (2026-12-07, one v5e, the relayout included; docs/benchmarks.md): 5.39 against
XLA's 6.19 ms at Qwen3's shape, 2.60 against 2.82 at the bench's step model, 5.29 against 9.13
at DeepSeek-V3's.

``DmaRows.prefetch``: a second kernel with two row buffers, whose step i starts step i+1's DMAs
before it waits for its own (the first waits for each block's DMAs before starting the next's),
so the DMAs' latency overlaps the issuing of the next block's; `make bench-accel`'s permutation
table times both (not yet measured on a chip: the layer keeps the first).

Off a TPU the kernels run in Pallas interpret mode (the tests on CPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_train.base.arith import cdiv
from moe_train.base.platform import Platform
from moe_train.moe.vjp import varying_axes

LANES = 128  # the TPU's lane width: H must be a multiple of it
BLOCK_BYTES = 4 * 2**20  # one grid step's K*b rows in VMEM (Mosaic's scoped VMEM is 16 MiB on a v5e)
MAX_BLOCK_TOKENS = 128  # b: 32, 64 and 128 ran within 5% of each other at Qwen3's shape
UNROLL = 8  # DMA starts (and waits) per loop iteration


@dataclasses.dataclass(frozen=True)
class DmaRows:
    """Row sums by this kernel (hashable: a static argument of the custom VJPs that use it)."""

    interpret: bool  # Pallas interpret mode: this process has no TPU (the tests on CPU; Platform.here())
    prefetch: bool = False  # two row buffers: the next block's DMAs start before this one's wait


def for_target(platform: Platform, x_TH: jax.Array) -> DmaRows | None:
    """The kernel for rows like ``x_TH`` where ``platform`` is a TPU, the hidden size a multiple
    of the lane width and ``x_TH`` not inside ``shard_map``; else None (XLA's gather). Under
    ``shard_map`` (expert parallelism) the kernel is not verified: both Pallas interpreters fail
    there on CPU (the TPU one hangs, the other trips JAX's varying-axes check of its loops)."""
    if platform.name != "tpu" or x_TH.shape[-1] % LANES or varying_axes(x_TH):
        return None
    return DmaRows(interpret=Platform.here().name != "tpu")


def block_tokens(tokens: int, per_token: int, hidden: int, itemsize: int) -> int:
    """b: the largest power of two of at most ``MAX_BLOCK_TOKENS`` whose K*b rows fit
    ``BLOCK_BYTES``, and no larger than the tokens rounded up to a power of two."""
    fit = max(1, BLOCK_BYTES // (per_token * hidden * itemsize))
    b = min(MAX_BLOCK_TOKENS, 1 << (fit.bit_length() - 1))
    return max(1, min(b, 1 << max(0, (tokens - 1).bit_length())))


def gather_sum(src_RH: jax.Array, idx_TK: jax.Array, out_dtype, dma: DmaRows) -> jax.Array:
    """[T, H] of ``out_dtype``: ``sum_k src[idx[t, k]]`` in fp32. Every index must be in [0, R)."""
    (T, K), (R, H) = idx_TK.shape, src_RH.shape
    if H % LANES:
        raise ValueError(f"row DMAs need the hidden size ({H}) to be a multiple of {LANES}")
    b = block_tokens(T, K, H, src_RH.dtype.itemsize)
    padded = cdiv(T, b) * b
    idx_TK = jnp.pad(idx_TK.astype(jnp.int32), ((0, padded - T), (0, 0)))  # extra tokens read row 0
    idx_N = idx_TK.reshape(-1)
    src_RCL = src_RH.reshape(R, H // LANES, LANES)
    call = _call_prefetch if dma.prefetch else _call
    out = call(K, b, jnp.dtype(out_dtype), dma.interpret, idx_N, src_RCL)
    return out[:T].reshape(T, H)


def _start_rows(K: int, b: int, idx_ref, src_hbm, rows_ref, sem) -> None:
    """Start the DMAs of b tokens' K rows each: row k of token j into rows_ref[k, j]."""

    def start(n, carry):
        copy = pltpu.make_async_copy(
            src_hbm.at[pl.ds(idx_ref[n], 1)], rows_ref.at[n % K, pl.ds(n // K, 1)], sem
        )
        copy.start()
        return carry

    lax.fori_loop(0, K * b, start, 0, unroll=UNROLL)


def _wait_rows(K: int, b: int, src_hbm, rows_ref, sem) -> None:
    """Wait for K*b row DMAs on ``sem`` (each wait takes one row's bytes off it)."""

    def wait(n, carry):
        pltpu.make_async_copy(src_hbm.at[pl.ds(0, 1)], rows_ref.at[0, pl.ds(0, 1)], sem).wait()
        return carry

    lax.fori_loop(0, K * b, wait, 0, unroll=UNROLL)


def _sum_rows(K: int, rows_ref, out_ref) -> None:
    """out = sum over k of rows_ref[k], in fp32."""
    acc = rows_ref[0].astype(jnp.float32)
    for k in range(1, K):
        acc = acc + rows_ref[k].astype(jnp.float32)
    out_ref[...] = acc.astype(out_ref.dtype)


def _kernel(K: int, b: int, idx_ref, src_hbm, out_ref, rows_ref, sem):
    """One step: start the DMAs of b tokens' K rows, wait for all, sum over k."""
    _start_rows(K, b, idx_ref, src_hbm, rows_ref, sem)
    _wait_rows(K, b, src_hbm, rows_ref, sem)
    _sum_rows(K, rows_ref, out_ref)


def _kernel_prefetch(K: int, b: int, steps: int, idx_ref, next_ref, src_hbm, out_ref, rows_ref, sems):
    """One step of the prefetching kernel: the first starts its own rows into buffer 0; each
    starts the next step's rows into the other buffer, then waits for its own and sums them."""
    i = pl.program_id(0)
    slot = i % 2

    @pl.when(i == 0)
    def _():
        _start_rows(K, b, idx_ref, src_hbm, rows_ref.at[0], sems.at[0])

    @pl.when(i + 1 < steps)
    def _():
        _start_rows(K, b, next_ref, src_hbm, rows_ref.at[1 - slot], sems.at[1 - slot])

    _wait_rows(K, b, src_hbm, rows_ref.at[slot], sems.at[slot])
    _sum_rows(K, rows_ref.at[slot], out_ref)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _call(K: int, b: int, out_dtype, interpret: bool, idx_N: jax.Array, src_RCL: jax.Array) -> jax.Array:
    N, (_, C, L) = idx_N.shape[0], src_RCL.shape
    return pl.pallas_call(
        functools.partial(_kernel, K, b),
        grid=(N // (K * b),),
        in_specs=[
            pl.BlockSpec((K * b,), lambda i: (i,), memory_space=pltpu.SMEM),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((b, C, L), lambda i: (i, 0, 0)),
        scratch_shapes=[pltpu.VMEM((K, b, C, L), src_RCL.dtype), pltpu.SemaphoreType.DMA],
        out_shape=jax.ShapeDtypeStruct((N // K, C, L), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(idx_N, src_RCL)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _call_prefetch(
    K: int, b: int, out_dtype, interpret: bool, idx_N: jax.Array, src_RCL: jax.Array
) -> jax.Array:
    """``_call`` with two row buffers; its steps run in order (each starts the next one's DMAs)."""
    N, (_, C, L) = idx_N.shape[0], src_RCL.shape
    steps = N // (K * b)
    return pl.pallas_call(
        functools.partial(_kernel_prefetch, K, b, steps),
        grid=(steps,),
        in_specs=[
            pl.BlockSpec((K * b,), lambda i: (i,), memory_space=pltpu.SMEM),
            pl.BlockSpec((K * b,), lambda i: (jnp.minimum(i + 1, steps - 1),), memory_space=pltpu.SMEM),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((b, C, L), lambda i: (i, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2, K, b, C, L), src_RCL.dtype), pltpu.SemaphoreType.DMA((2,))],
        out_shape=jax.ShapeDtypeStruct((N // K, C, L), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(idx_N, idx_N, src_RCL)
