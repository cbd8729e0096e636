"""The ``megablox`` grouped-GEMM backend: JAX's Pallas TPU grouped matmuls (megablox ``gmm`` and
``tgmm``) with the SwiGLU fused into one custom VJP and a tile per GEMM.

Shape letters (``moe_train.base.notation``): R dispatched rows (sorted by expert, then rows in no
group: padding to the row tile and, under expert parallelism, the spare group of rows that no
expert here takes), H hidden, F expert ffn, E experts.

Forward, on rows sorted by expert (``permute.make_dispatch`` with ``row_multiple``):
``a0 = x @ wi_0``, ``a1 = x @ wi_1`` (two GEMMs: one of ``[wi_0|wi_1]`` would need the weights
concatenated, which cost more than it saved on the v5e), ``h = silu(a0) * a1 * s`` in fp32
(``s``: each row's scale, its combine weight), ``y = h @ wo``. Backward: ``dhs = dy @ wo^T``,
``da`` from ``a`` and ``dhs`` in fp32, ``dx = [da0|da1] @ [wi_0|wi_1]^T`` (one GEMM of 2F
contraction; the weights are concatenated there, never kept, so checkpoints and conversions
keep ``wi_0`` and ``wi_1``), ``dw0 = x^T da0``, ``dw1 = x^T da1`` and ``dwo = (h s)^T dy`` per
expert (``tgmm``; no [E, H, 2F] gradient to split). Eight GEMMs of three kinds, each with its
own tile (``tiles_for``): ``fwd`` (the forward's three), ``dlhs`` (the rows' gradients),
``drhs`` (the weights' gradients), as MaxText exposes them.

Tiles (tm, tk, tn) come from a table measured on the chip and shipped with the kit
(``moe_train/assets/megablox_tiles.json``, written by ``python -m moe_train.bench --accel
--tune``), keyed by the JAX device kind, the GEMM kind and (k, n); a shape the table lacks
takes ``DEFAULT_TILE`` clamped to the shape. On a TPU v5e (2026-12-06, the sweep at the
Mixtral, Qwen3 and DeepSeek-V3 shapes, docs/benchmarks.md) (512, 1024, 1024) compiled at every
GEMM and came within 0.02x of the fastest tile at 13 of 14 (1.02-1.38x the dense limit),
where (512, 512, 512) took 1.25-1.63x. megablox needs the rows to be a multiple of tm: the
dispatch pads them to ``default_row_tile`` (at most ``MAX_ROW_TILE``; rows in no group are
neither read by the kernels nor computed; the outputs zero them).

Off a TPU the kernels run in Pallas interpret mode (the tests on CPU); ``gemm.resolve_backend``
offers the backend on TPUs only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from moe_train.base.imports import import_failure
from moe_train.base.platform import Platform, or_here
from moe_train.config.checks import MEGABLOX_ROWS
from moe_train.moe.vjp import custom_vjp, vary, varying_axes

F32 = jnp.float32
Tile = tuple[int, int, int]  # (tm, tk, tn): rows, contraction and output columns of one block
KINDS = ("fwd", "dlhs", "drhs")  # the GEMM kinds a tile is chosen for
DEFAULT_TILE: Tile = (512, 1024, 1024)
MAX_ROW_TILE = 1024  # rows are padded to at most this: the sweep's fastest tm at several GEMMs
# A group boundary inside a tile of rows makes megablox run that tile once per group. The row
# tile below trades those repeats against smaller tiles; the layer can instead pad each group to
# the tile (``moe.tile_rows``: the tiled layout), which leaves no boundary inside a tile but
# makes the permutation a scatter into a larger buffer. On a TPU v5e (2026-12-07, fwd+bwd /
# dense, docs/benchmarks.md) unpadded with LOAD_PER_TILE 4 took 2.90 / 1.60 / 1.40 at Qwen3 /
# DeepSeek-V3 / Mixtral (LOAD_PER_TILE 1: 2.97 / 1.64 / 1.43); padded to the same tile
# 3.06 / 1.63 / 1.30, and the step model's train step 9% slower than unpadded.
LOAD_PER_TILE = 4  # the row tile is at most the experts' mean load over this
MIN_ROW_TILE = MEGABLOX_ROWS  # rows: bf16 packs 16 rows in a TPU vreg's sublanes
LANES = 128  # tk and tn are multiples of this (the TPU's lane width) or the whole dimension
TILE_FILE = Path(__file__).resolve().parents[1] / "assets" / "megablox_tiles.json"
# A tile's VMEM (``vmem_bytes``) is held to this. megablox sets no VMEM limit, so Mosaic's
# default scoped one applies (16 MiB on a TPU v5e). On the v5e (2026-12-07) tiles of 16.0 and
# 17.5 MiB by that count failed to compile (CompileTimeScopedVmemOom: Mixtral's and
# DeepSeek-V3's ``dy @ wo^T`` at (1024, 512, 1024) with fp32 output); 12.5 MiB compiled.
VMEM_BUDGET = 14 * 2**20


def _kernels():
    """JAX's megablox kernel module (``gmm``, ``tgmm``); the package re-exports only ``gmm``."""
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def import_error() -> str | None:
    """Why the megablox kernels cannot be imported here (None when they can)."""
    return import_failure("JAX's Pallas megablox kernels", "jax.experimental.pallas.ops.tpu.megablox.gmm")


# ----------------------------------------------------------------------------- tiles


@functools.cache
def load_table(path: Path = TILE_FILE) -> dict:
    """The measured tiles: {device kind: {kind: {"KxN": [tm, tk, tn]}}} ({} without a file)."""
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("tiles", {})


def _pow2_floor(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def default_row_tile(rows: int, experts: int) -> int:
    """The row tile that the dispatch pads the rows to a multiple of, and the largest tm a
    GEMM then takes: the largest power of two within the experts' mean load over
    ``LOAD_PER_TILE``, in [``MIN_ROW_TILE``, ``MAX_ROW_TILE``] (tiles repeated at group
    boundaries add about (E - 1) * tm rows of work)."""
    mean = max(1, rows // max(1, experts))
    return max(MIN_ROW_TILE, min(MAX_ROW_TILE, _pow2_floor(max(1, mean // LOAD_PER_TILE))))


def _clamp(t: int, dim: int) -> int:
    """A tile of at most ``dim`` rounded up to the lane width: the whole dimension in one block
    where it is smaller than ``t``."""
    return t if dim >= t else -(-dim // LANES) * LANES


def tiles_for(
    kind: str, row_tile: int, k: int, n: int, device_kind: str | None = None, *, in_bytes=2, out_bytes=2
) -> Tile:
    """The tile of one GEMM: the table's entry for (device kind, ``kind``, k x n), else
    ``DEFAULT_TILE``, fitted by ``clamp_tile`` (``in_bytes``, ``out_bytes``: bytes per element
    of the operands and of the output). ``device_kind`` None: this process's device."""
    if kind not in KINDS:
        raise ValueError(f"unknown GEMM kind {kind!r}; one of {KINDS}")
    kind_of_device = device_kind if device_kind is not None else Platform.here().device_kind
    entry = load_table().get(kind_of_device, {}).get(kind, {}).get(f"{k}x{n}")
    tile = tuple(entry) if entry else DEFAULT_TILE
    return clamp_tile(tile, row_tile, k, n, kind=kind, in_bytes=in_bytes, out_bytes=out_bytes)


def clamp_tile(tile, row_tile: int, k: int, n: int, *, kind="fwd", in_bytes=2, out_bytes=2) -> Tile:
    """``tile`` fitted to a GEMM: tm at most ``row_tile``, tk and tn at most k and n rounded up
    to the lane width, then halved until its VMEM (``vmem_bytes``) is within ``VMEM_BUDGET``."""
    tm, tk, tn = tile
    fitted = (min(tm, row_tile), _clamp(tk, k), _clamp(tn, n))
    return fit_vmem(kind, fitted, in_bytes, out_bytes)


def vmem_bytes(kind: str, tile: Tile, in_bytes: int, out_bytes: int) -> int:
    """VMEM one megablox kernel holds at ``tile``: its two inputs' blocks and its output block,
    each double-buffered, and the fp32 accumulator of one output block. ``gmm``'s blocks are
    lhs (tm, tk), rhs (tk, tn) and out (tm, tn); ``tgmm``'s (``drhs``) lhs^T (tk, tm), rhs
    (tm, tn) and out (tk, tn)."""
    tm, tk, tn = tile
    if kind == "drhs":
        return 2 * (tk * tm + tm * tn) * in_bytes + tk * tn * (2 * out_bytes + 4)
    return 2 * (tm * tk + tk * tn) * in_bytes + tm * tn * (2 * out_bytes + 4)


def fit_vmem(kind: str, tile: Tile, in_bytes: int, out_bytes: int) -> Tile:
    """``tile`` with the dimensions of its output block halved, the larger first (tm before
    tn before tk on ties; none below ``LANES`` nor off a multiple of it), until
    ``vmem_bytes`` is within ``VMEM_BUDGET``; as it is where no halving is left."""
    sizes = dict(zip("mkn", tile))
    order = "kn" if kind == "drhs" else "mn"
    while vmem_bytes(kind, (sizes["m"], sizes["k"], sizes["n"]), in_bytes, out_bytes) > VMEM_BUDGET:
        halvable = [d for d in order + "k" if sizes[d] >= 2 * LANES and (sizes[d] // 2) % LANES == 0]
        if not halvable:
            break
        dim = max(halvable, key=lambda d: sizes[d])  # max keeps the first of equal sizes
        sizes[dim] //= 2
    return sizes["m"], sizes["k"], sizes["n"]


# ----------------------------------------------------------------------------- GEMMs


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the GEMMs of one call read besides their operands (hashable: a nondiff argument)."""

    row_tile: int  # the rows are a multiple of it, and no tm exceeds it
    device_kind: str  # the tile table's key (the target's ``Platform.device_kind``)
    interpret: bool  # Pallas interpret mode: the target is not a TPU (the tests on CPU)
    all_grouped: bool = False  # every row is in a group: no rows after them to zero

    @staticmethod
    def of(row_tile: int, platform: Platform, all_grouped: bool = False) -> Setup:
        return Setup(row_tile, platform.device_kind, platform.name != "tpu", all_grouped)


def _gmm(kind, lhs, rhs, group_sizes_E, setup: Setup, out_dtype, transpose_rhs=False):
    """Per-group ``lhs @ rhs[e]`` (``rhs[e]^T`` with ``transpose_rhs``) on the sorted rows."""
    k = lhs.shape[1]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    nbytes = dict(in_bytes=lhs.dtype.itemsize, out_bytes=jnp.dtype(out_dtype).itemsize)
    out = _kernels().gmm(
        lhs,
        rhs,
        group_sizes_E,
        preferred_element_type=out_dtype,
        tiling=tiles_for(kind, setup.row_tile, k, n, setup.device_kind, **nbytes),
        transpose_rhs=transpose_rhs,
        interpret=setup.interpret,
    )
    return vary(out, varying_axes(lhs, rhs))


def _tgmm(lhs_RK, rhs_RN, group_sizes_E, setup: Setup, out_dtype):
    """Per-group ``lhs[rows of e]^T @ rhs[rows of e]`` [E, K, N] (zero for empty groups)."""
    k, n = lhs_RK.shape[1], rhs_RN.shape[1]
    nbytes = dict(in_bytes=lhs_RK.dtype.itemsize, out_bytes=jnp.dtype(out_dtype).itemsize)
    out = _kernels().tgmm(
        lhs_RK.swapaxes(0, 1),
        rhs_RN,
        group_sizes_E,
        preferred_element_type=out_dtype,
        tiling=tiles_for("drhs", setup.row_tile, k, n, setup.device_kind, **nbytes),
        interpret=setup.interpret,
    )
    return vary(out, varying_axes(lhs_RK, rhs_RN))


def _rows_in_groups(a, group_sizes_E, setup: Setup):
    """``a`` with the rows after the last group zeroed (the kernels leave them unwritten); as it
    is where every row is in a group (an [R, H] select is a pass over HBM of its own)."""
    if setup.all_grouped:
        return a
    row_R = jax.lax.broadcasted_iota(jnp.int32, (a.shape[0],) + (1,) * (a.ndim - 1), 0)
    return jnp.where(row_R < jnp.sum(group_sizes_E), a, jnp.zeros((), a.dtype))


def _swiglu(a0_RF, a1_RF, s_R):
    """(h * s, silu(a0), sigmoid(a0), a0, a1) in fp32."""
    a0, a1 = a0_RF.astype(F32), a1_RF.astype(F32)
    sig = jax.nn.sigmoid(a0)
    silu = a0 * sig
    return silu * a1 * s_R[:, None], silu, sig, a0, a1


def _w01(w0_EHF, w1_EHF):
    """[wi_0 | wi_1] [E, H, 2F] for the rows' gradient: made in the backward, never kept."""
    return jnp.concatenate([w0_EHF, w1_EHF], axis=2)


def _forward(x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, setup):
    dtype = x_RH.dtype
    # Two GEMMs, not one of [wi_0|wi_1]: on the v5e (2026-12-07) the fused GEMM saved 0.5-0.8 ms
    # of the two's time at the three bench shapes, and concatenating the weights cost 1.2-2.9.
    a0_RF = _gmm("fwd", x_RH, w0_EHF, group_sizes_E, setup, dtype)
    a1_RF = _gmm("fwd", x_RH, w1_EHF, group_sizes_E, setup, dtype)
    hs_RF = _swiglu(a0_RF, a1_RF, s_R)[0].astype(dtype)
    y_RH = _gmm("fwd", hs_RF, wo_EFH, group_sizes_E, setup, dtype)
    return _rows_in_groups(y_RH, group_sizes_E, setup), (a0_RF, a1_RF)


@custom_vjp(nondiff_argnums=(6,))
def _fused(x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, setup):
    return _forward(x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, setup)[0]


def _fused_fwd(x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, setup):
    y_RH, (a0_RF, a1_RF) = _forward(x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, setup)
    return y_RH, (x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, a0_RF, a1_RF)


def _fused_bwd(setup, res, dy_RH):
    """(dx, dw0, dw1, dwo, None, ds): the rows' gradients by ``gmm`` with the weights
    transposed, the weights' by ``tgmm``; rows in no group get zero."""
    x_RH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E, s_R, a0_RF, a1_RF = res
    dtype = x_RH.dtype
    dy_RH = dy_RH.astype(dtype)
    hs, silu, sig, a0, a1 = _swiglu(a0_RF, a1_RF, s_R)
    dhs_RF = _gmm("dlhs", dy_RH, wo_EFH, group_sizes_E, setup, F32, transpose_rhs=True)
    ds_R = _rows_in_groups(jnp.sum(dhs_RF * silu * a1, axis=1), group_sizes_E, setup)
    dh = dhs_RF * s_R[:, None]
    da0_RF, da1_RF = (
        _rows_in_groups(d.astype(dtype), group_sizes_E, setup)
        for d in (dh * a1 * sig * (1.0 + a0 * (1.0 - sig)), dh * silu)
    )
    dx_RH = _gmm(
        "dlhs",
        jnp.concatenate([da0_RF, da1_RF], axis=1),
        _w01(w0_EHF, w1_EHF),
        group_sizes_E,
        setup,
        dtype,
        transpose_rhs=True,
    )
    # Each weight's gradient by a tgmm of its own half of da: one tgmm of [da0|da1] would need
    # its [E, H, 2F] output split, a pass over it (5.6 ms of DeepSeek-V3's 141 on the v5e).
    dw0 = _tgmm(x_RH, da0_RF, group_sizes_E, setup, w0_EHF.dtype)
    dw1 = _tgmm(x_RH, da1_RF, group_sizes_E, setup, w1_EHF.dtype)
    dwo = _tgmm(hs.astype(dtype), dy_RH, group_sizes_E, setup, wo_EFH.dtype)
    return _rows_in_groups(dx_RH, group_sizes_E, setup), dw0, dw1, dwo, None, ds_R


_fused.defvjp(_fused_fwd, _fused_bwd)


def megablox_swiglu(
    ops: tuple[jax.Array, ...], *, row_tile: int, platform: Platform | None = None, all_grouped: bool = False
) -> jax.Array:
    """SwiGLU experts on rows sorted by expert [R, H] -> [R, H] (x's dtype); ``ops`` is
    ``tiled.expert_operands(x_RH, wi_0_EHF, wi_1_EHF, wo_EFH, group_sizes_E, scale_R)``.

    ``group_sizes_E`` counts each expert's rows from row 0 (they may sum to less than R: the
    rest is in no group and reads zero). R must be a multiple of ``row_tile`` (``default_row_tile``).
    ``scale_R``: each row's activation is scaled by it before ``wo``. The GEMMs run in x's
    dtype (bf16 or fp32) and accumulate in fp32.
    ``platform``: the target (its tile table key; interpret mode off a TPU); None: this process's.
    ``all_grouped``: the groups cover all R rows (the outputs' rows after them need no zeroing).
    """
    R = ops[0].shape[0]
    if R % row_tile:
        raise ValueError(f"megablox needs rows ({R}) to be a multiple of the row tile ({row_tile})")
    return _fused(*ops, Setup.of(row_tile, or_here(platform), all_grouped))
