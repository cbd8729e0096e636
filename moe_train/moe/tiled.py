"""The ``tiled`` grouped-GEMM backend: per-expert row blocks in a loop, hand-written VJP.

Shape letters (``moe_train.base.notation``): R dispatched rows (tile-padded layout), H hidden,
F expert ffn (F2 = 2F), E experts, M assignments, C rows of one block; scalars: m tile rows
(padding granularity), b the largest block's rows (b = m * 2**j).

Layout (``permute.make_dispatch`` with ``tile_rows=m``): rows sorted by expert, each
expert's group padded with zero rows to a multiple of m, trailing zero rows after the last
group. Expert e owns rows [start_e, start_e + ceil(g_e/m)*m).

Execution: an outer loop over the experts that have rows slices expert e's weights once;
inner loops run the expert's rows in blocks: as many of b rows as fit, then of b/4, b/16,
..., then of m (``block_sizes``, at most three sizes for b = 16m). Every block is one fused
SwiGLU: ``a = x_b @ [wi_0|wi_1]``, ``h = silu(a0) * a1 * s``, ``y_b = h @ wo`` (``s``: each
row's scale, its combine weight: ``layer.expert_steps``). Only the rows
the routing uses run: executed rows = sum_e ceil(g_e/m)*m <= M + E*(m-1), whatever the static
buffer size R is (padding and trailing rows cost nothing), and there is no weight gather.
Loop bounds are traced values, so routing changes never recompile.

The VJP is written by hand (autodiff through the loops would store every block): the
forward pass keeps ``a`` [R, 2F] in fp32. The backward pass walks the same blocks, once or
twice. One walk makes dx, ds and each expert's weight gradients (accumulated in fp32, written
once), so dx is complete only after the last expert's weight GEMMs. Two walks (on GPU): the
row walk makes dx and ds and keeps da [R, 2F] in x's dtype; the weight walk makes the weight
gradients from x, dy, da and ``a``. The exchange that returns dx to its tokens can then run
while the weight walk computes (``make compile``: deepseek-v3 on 64 gb200-nvl72 nodes hides
29% of its exchange at 1 chunk, 1.4% with one walk; docs/compile.md). The gradients are
bitwise the same; on CPU, with no collective to hide, two walks took 11-14% longer.
Rows outside every expert's span (trailing padding) get y = 0 and dx = 0.

Settings: every default of the backend is here (``default_tile_rows`` for m,
``default_block_rows`` for b, and their caps); ``moe.tile_rows`` (0: ``default_tile_rows``)
is the one the config sets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from moe_train.base.platform import Platform
from moe_train.moe.permute import zeros_after
from moe_train.moe.vjp import custom_vjp, vary, varying_axes

F32 = jnp.float32

# ----------------------------------------------------------------------------- settings

MAX_PADDING = 0.1  # executed rows <= (1 + MAX_PADDING) * useful rows under any routing
CPU_MAX_TILE_ROWS = 32
GPU_MAX_TILE_ROWS = 128
CPU_MAX_BLOCK_ROWS = 256
GPU_MAX_BLOCK_ROWS = 512
MAX_BLOCK_TILES = 16


def _pow2_floor(n: float) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def default_tile_rows(num_assignments: int, num_experts: int, platform: str | None = None) -> int:
    """Tile rows m of the tiled backend (the padding granularity of each expert's group).

    The tiled backend executes sum_e ceil(g_e/m)*m <= M + E*(m-1) rows for M useful ones,
    whatever the routing. m is the largest power of two with E*(m-1) <= MAX_PADDING * M
    (so padding waste <= 1.1 under any routing), capped at 32 on CPU and 128 on GPU
    (``platform``: a JAX platform name; None: this process's). Speed
    comes from the blocks (``default_block_rows``, up to 256 rows on CPU), not from m:
    each expert's span runs as full blocks plus at most one block of each smaller size.
    """
    platform = platform or Platform.here().name
    cap = GPU_MAX_TILE_ROWS if platform == "gpu" else CPU_MAX_TILE_ROWS
    return min(cap, _pow2_floor(1 + MAX_PADDING * num_assignments / num_experts))


def default_block_rows(tile_rows: int, platform: str | None = None) -> int:
    """Largest row block of the tiled backend: tile_rows * 2**j, at most 16 tiles and at
    most 256 rows on CPU (512 on GPU).

    Each expert's span runs as full blocks plus at most one block of each smaller size, so
    there are at most 5 block sizes (each one compiled code path). The block depends on the
    tile alone, never on the buffer size, so every capacity bucket of an expert-parallel
    step runs the same blocks and gives bitwise the same rows.
    """
    platform = platform or Platform.here().name
    cap = GPU_MAX_BLOCK_ROWS if platform == "gpu" else CPU_MAX_BLOCK_ROWS
    return max(block_sizes(tile_rows, min(cap, MAX_BLOCK_TILES * tile_rows)))


# ----------------------------------------------------------------------------- blocks


def expert_spans(group_sizes_E: jax.Array, tile_rows: int) -> tuple[jax.Array, jax.Array]:
    """(first row, padded rows) of every expert's span in the tile-padded layout, int32."""
    padded_E = (group_sizes_E.astype(jnp.int32) + (tile_rows - 1)) // tile_rows * tile_rows
    return jnp.cumsum(padded_E) - padded_E, padded_E


def block_sizes(tile_rows: int, block_rows: int) -> tuple[int, ...]:
    """Block sizes, largest first: b, b/4, b/16, ... (while >= 2m), then m.

    b is block_rows rounded down to m * 2**j (at least m). Each size is a multiple of the
    next, so the greedy split in ``for_blocks`` covers any multiple of m exactly. Steps of 4
    keep the number of sizes (each is separately compiled code) at 3 for b = 16m.
    """
    big = tile_rows
    while big * 2 <= block_rows:
        big *= 2
    sizes = [big]
    while sizes[-1] // 4 >= 2 * tile_rows:
        sizes.append(sizes[-1] // 4)
    if sizes[-1] != tile_rows:
        sizes.append(tile_rows)
    return tuple(sizes)


def for_blocks(start, rows, sizes: tuple[int, ...], body, carry):
    """carry = body(offset, size, carry) over the rows [start, start + rows) in blocks.

    ``rows`` is a multiple of sizes[-1]. Greedy split: as many blocks of sizes[0] as fit,
    then of sizes[1] (fewer than sizes[0] / sizes[1] of them), and so on. Each size is a
    loop whose trip count is a traced value, so XLA updates the carried buffers in place;
    offsets use the trip index, so XLA cannot hoist a block out of a loop of 0 or 1 trips
    and run it every time.
    """
    offset, rest = start, rows
    for size in sizes:
        n = rest // size
        carry = lax.fori_loop(0, n, lambda i, c, o=offset, s=size: body(o + i * s, s, c), carry)
        offset, rest = offset + n * size, rest - n * size
    return carry


def for_experts(group_sizes_E, tile_rows: int, expert, carry):
    """carry = expert(e, first row, padded rows, carry) for every expert with rows, in order.

    Empty experts are skipped (no weight slice is copied for them).
    """
    start_E, padded_E = expert_spans(group_sizes_E, tile_rows)
    used = padded_E > 0
    order = jnp.argsort(~used, stable=True).astype(jnp.int32)  # used experts first, in order

    def step(k, carry):
        e = order[k]
        return expert(e, start_E[e], padded_E[e], carry)

    return lax.fori_loop(0, jnp.sum(used.astype(jnp.int32)), step, carry)


def expert_operands(x_RH, wi_0_EHF, wi_1_EHF, wo_EFH, group_sizes_E, scale_R=None, *, with_scale=True):
    """(x, w0, w1, wo, group sizes[, s]) as the grouped-GEMM backends take them: the weights in
    x's dtype, the group sizes int32, the rows' scale fp32 (1 where None; left out without
    ``with_scale``), every one typed as varying along every mesh axis any of them does
    (``vary``: the custom VJPs' gradients then have their operands' types, and the transpose
    of that cast sums the weights' gradients over the token axes)."""
    dtype = x_RH.dtype
    ops = [x_RH, wi_0_EHF.astype(dtype), wi_1_EHF.astype(dtype), wo_EFH.astype(dtype)]
    ops.append(group_sizes_E.astype(jnp.int32))
    if with_scale:
        ops.append(jnp.ones(x_RH.shape[:1], F32) if scale_R is None else scale_R.astype(F32))
    axes = varying_axes(*ops)
    return tuple(vary(a, axes) for a in ops)


def _zeros(shape, dtype, axes: tuple, after: jax.Array):
    """Zeros typed as varying along ``axes``, so loop carries keep one type under shard_map;
    made after ``after`` (``permute.zeros_after``: not scheduled early and held)."""
    z = zeros_after(shape, dtype, after)
    missing = tuple(ax for ax in axes if ax not in varying_axes(z))
    return lax.pcast(z, missing, to="varying") if missing else z


def _rows(a, offset, size):
    return lax.dynamic_slice_in_dim(a, offset, size, axis=0)


def _put(a, rows, offset):
    return lax.dynamic_update_slice_in_dim(a, rows.astype(a.dtype), offset, axis=0)


def _dot(a, b, contract=((1,), (0,))):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=F32)


def _swiglu_act(a_CF2):
    """(h, silu(a0), sigmoid(a0), a0, a1) of the fused gate|up activations, fp32."""
    a0, a1 = jnp.split(a_CF2, 2, axis=1)
    sig = jax.nn.sigmoid(a0)
    s = a0 * sig
    return s * a1, s, sig, a0, a1


def _expert_w01(w0_EHF, w1_EHF, e):
    """[wi_0[e] | wi_1[e]] [H, 2F]: one fused slice-and-concatenate copy per expert."""
    return jnp.concatenate([w0_EHF[e], w1_EHF[e]], axis=1)


def _forward(x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, tile_rows, block_rows, save_a: bool = True):
    """(y [R, H] in x's dtype, a [R, 2F] fp32 residual, or None without ``save_a``).

    Without a backward pass (inference, evaluation) ``a`` is not written: storing it costs
    about a fifth of the forward time on XLA:CPU, and XLA cannot drop a loop carry.
    """
    R, H = x_RH.shape
    E, _, F = w0_EHF.shape
    F2 = 2 * F
    sizes = block_sizes(tile_rows, block_rows)

    def expert(e, start, rows, carry):
        w01, wo = _expert_w01(w0_EHF, w1_EHF, e), wo_EFH[e]

        def block(offset, size, carry):
            y, a_res = carry
            a = _dot(_rows(x_RH, offset, size), w01)
            h = (_swiglu_act(a)[0] * _rows(s_R, offset, size)[:, None]).astype(x_RH.dtype)
            return _put(y, _dot(h, wo), offset), _put(a_res, a, offset) if save_a else a_res

        return for_blocks(start, rows, sizes, block, carry)

    axes = varying_axes(x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E)
    init = (_zeros((R, H), x_RH.dtype, axes, x_RH), _zeros((R, F2) if save_a else (), F32, axes, x_RH))
    y, a = for_experts(group_sizes_E, tile_rows, expert, init)
    return y, a if save_a else None


def _block_rows_grad(x_RH, s_R, a_RF2, dy_RH, w01, wo, offset, size):
    """One block's (dx [C, H] fp32, ds [C] fp32, da [C, 2F] in x's dtype, h * s [C, F] in
    x's dtype) from the block's rows and its expert's weights."""
    dtype = x_RH.dtype
    dy_b = _rows(dy_RH, offset, size).astype(dtype)
    s_b = _rows(s_R, offset, size).astype(F32)[:, None]
    h, s, sig, a0, a1 = _swiglu_act(_rows(a_RF2, offset, size))
    dhs = _dot(dy_b, wo, ((1,), (1,)))  # [C, F]: of h * s_b
    dh = dhs * s_b
    da0 = dh * a1 * sig * (1.0 + a0 * (1.0 - sig))
    da = jnp.concatenate([da0, dh * s], axis=1).astype(dtype)
    return _dot(da, w01, ((1,), (1,))), jnp.sum(dhs * h, axis=1), da, (h * s_b).astype(dtype)


def _add_weight_grads(dw01, dwo, x_RH, dy_RH, da, hs, offset, size):
    """The running fp32 weight gradients of an expert plus one block's."""
    dy_b = _rows(dy_RH, offset, size).astype(x_RH.dtype)
    return dw01 + _dot(_rows(x_RH, offset, size), da, ((0,), (0,))), dwo + _dot(hs, dy_b, ((0,), (0,)))


def _set_expert(dws, e, dw01, dwo):
    """(dw0, dw1, dwo) of every expert with expert e's fp32 gradients written in."""
    dw0, dw1 = jnp.split(dw01, 2, axis=1)
    return tuple(all_.at[e].set(g.astype(all_.dtype)) for all_, g in zip(dws, (dw0, dw1, dwo), strict=True))


def _weight_zeros(w0_EHF, axes, after):
    H, F = w0_EHF.shape[1:]
    return _zeros((H, 2 * F), F32, axes, after), _zeros((F, H), F32, axes, after)


def _backward(ops, tile_rows, block_rows, two_walks):
    """(dx [R, H], dw0, dw1 [E, H, F], dwo [E, F, H], ds [R]) of ``ops`` = (x, w0, w1, wo,
    group sizes, s, a, dy); weight grads in the weights' dtype, ds in s's. ``two_walks``: the
    row walk (dx, ds, and da kept in x's dtype), then the weight walk (from x, dy, da and
    ``a``); else one walk makes everything (module doc)."""
    x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, a_RF2, dy_RH = ops
    sizes = block_sizes(tile_rows, block_rows)
    axes = varying_axes(*ops)
    rows_at = (x_RH, s_R, a_RF2, dy_RH)

    def rows_expert(e, start, rows, carry):
        w01, wo = _expert_w01(w0_EHF, w1_EHF, e), wo_EFH[e]

        def block(offset, size, inner):
            dx, ds, keep, dw01, dwo = inner
            dx_b, ds_b, da, hs = _block_rows_grad(*rows_at, w01, wo, offset, size)
            if two_walks:
                keep = _put(keep, da, offset)
            else:
                dw01, dwo = _add_weight_grads(dw01, dwo, x_RH, dy_RH, da, hs, offset, size)
            return _put(dx, dx_b, offset), _put(ds, ds_b, offset), keep, dw01, dwo

        dx, ds, keep, dws = carry
        weights = (None, None) if two_walks else _weight_zeros(w0_EHF, axes, dy_RH)
        dx, ds, keep, dw01, dwo = for_blocks(start, rows, sizes, block, (dx, ds, keep, *weights))
        return dx, ds, keep, dws if two_walks else _set_expert(dws, e, dw01, dwo)

    def weights_expert(e, start, rows, dws):
        def block(offset, size, inner):
            dw01, dwo = inner
            s_b = _rows(s_R, offset, size).astype(F32)[:, None]
            hs = (_swiglu_act(_rows(a_RF2, offset, size))[0] * s_b).astype(x_RH.dtype)
            return _add_weight_grads(dw01, dwo, x_RH, dy_RH, _rows(keep, offset, size), hs, offset, size)

        return _set_expert(dws, e, *for_blocks(start, rows, sizes, block, _weight_zeros(w0_EHF, axes, keep)))

    dws = tuple(_zeros(w.shape, w.dtype, axes, dy_RH) for w in (w0_EHF, w1_EHF, wo_EFH))
    keep_shape = (x_RH.shape[0], 2 * w0_EHF.shape[2]) if two_walks else ()
    init = (
        _zeros(x_RH.shape, x_RH.dtype, axes, dy_RH),
        _zeros(s_R.shape, s_R.dtype, axes, dy_RH),
        _zeros(keep_shape, x_RH.dtype, axes, dy_RH),
        dws,
    )
    dx, ds, keep, dws = for_experts(group_sizes_E, tile_rows, rows_expert, init)
    if two_walks:
        dws = for_experts(group_sizes_E, tile_rows, weights_expert, dws)
    return (dx, *dws, ds)


@custom_vjp(nondiff_argnums=(6, 7, 8))
def _tiled(x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, tile_rows, block_rows, two_walks):
    ops = (x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R)
    return _forward(*ops, tile_rows, block_rows, save_a=False)[0]


def _tiled_fwd(x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, tile_rows, block_rows, two_walks):
    ops = (x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R)
    y, a = _forward(*ops, tile_rows, block_rows)
    return y, (*ops, a)


def _tiled_bwd(tile_rows, block_rows, two_walks, res, dy_RH):
    dx, dw0, dw1, dwo, ds = _backward((*res, dy_RH), tile_rows, block_rows, two_walks)
    return (dx, dw0, dw1, dwo, None, ds)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_swiglu(
    ops: tuple[jax.Array, ...], *, tile_rows: int, block_rows: int, two_walks: bool | None = None
) -> jax.Array:
    """SwiGLU experts on the tile-padded layout [R, H] -> [R, H] (x's dtype); ``ops`` is
    ``expert_operands(x_RH, wi_0_EHF, wi_1_EHF, wo_EFH, group_sizes_E, scale_R)``.

    ``group_sizes_E`` may cover only the first E' experts of the layout (E' = weights' E):
    rows of later groups are left out (their y is 0). ``scale_R``: each row's activation is
    scaled by it before ``wo``.
    ``two_walks``: the backward's row and weight walks (module doc); None: on this process's
    GPU, where a collective can run under the weight walk (the MoE layer passes its target's).
    Both give bitwise the same gradients.
    """
    if two_walks is None:
        two_walks = Platform.here().name == "gpu"
    # Blocks larger than R never run (a span has at most R rows): the same blocks run for
    # every R, so results do not depend on the buffer size.
    block_rows = min(block_rows, ops[0].shape[0])
    return _tiled(*ops, tile_rows, block_rows, two_walks)


def executed_rows(group_sizes_E, tile_rows: int):
    """Rows the tiled backend computes for these group sizes (sum of padded spans)."""
    return jnp.sum(expert_spans(jnp.asarray(group_sizes_E), tile_rows)[1])
