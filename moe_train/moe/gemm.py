"""Grouped GEMM backends for the SwiGLU experts, and backend selection.

Shape letters (``moe_train.base.notation``): R dispatched rows, M = T*K assignments (rows sorted
by expert), H hidden, F expert ffn, E experts, P tiles, m tile rows (R = P*m in the tiled layout).
The grouped GEMM wrappers are generic: ``lhs`` [rows, k] times ``rhs`` [E, k, f] gives [rows, f].

Every backend computes, for each row r owned by expert e,
    y[r] = (s[r] * silu(x[r] @ wi_0[e]) * (x[r] @ wi_1[e])) @ wo[e]
with operands in x's dtype, fp32 accumulation and the SwiGLU product in fp32 (s: the row's
scale, 1 where none is given). The sorted-row backends (ragged_dot, mgpu, te) write
x @ wi_0[e] and x @ wi_1[e] in x's dtype, as their kernels do, and ``swiglu_product`` keeps
only those for the backward.

- tiled: portable (moe_train.moe.tiled); rows in a tile-padded layout, a loop over the
  experts that have rows and, inside, over blocks of their rows, each block one fused
  SwiGLU; hand-written VJP. Only used rows run; no weight gather. The CPU default.
- ragged_dot: jax.lax.ragged_dot on sorted rows. XLA lowers it to a dense dot over a
  zero-masked [rows, E x H] operand on CPU and, in jax 0.11.2, on GPU too (seen on an H200:
  DeepSeek-V3's 256 experts asked for a 112 GiB operand): E times the FLOPs and
  ``ragged_dot_expansion_bytes`` of memory. Never chosen by ``auto``; explicit use only.
- mgpu: JAX's Pallas Mosaic-GPU Hopper kernels with a custom VJP (bf16/fp16, sm_90).
  blackwell_ragged_dot_mgpu is not used: it needs the row count to be a multiple of its
  tile and has no weight-gradient kernel (the Hopper transposed kernel uses wgmma).
- te: Transformer Engine's grouped_dense (custom VJP inside TE).
- megablox: JAX's Pallas TPU grouped matmuls, the SwiGLU fused into one custom VJP with a
  tile per GEMM (moe_train.moe.megablox); rows sorted and padded to its row tile. TPU only
  (the tests run it in Pallas interpret mode on CPU); ``auto``'s pick on a TPU.
"""

# transformer_engine is imported only where installed (GPU containers), never from .venv
# pyright: reportMissingImports=false
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from moe_train.base.choices import BACKENDS
from moe_train.base.imports import import_failure
from moe_train.base.platform import Platform, or_here
from moe_train.moe import megablox
from moe_train.moe.permute import cdiv_array
from moe_train.moe.swiglu import swiglu_product
from moe_train.moe.tiled import default_block_rows, expert_operands, tiled_swiglu
from moe_train.moe.vjp import vary, varying_axes

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MGPU_ALIGN = 64  # H and F must be multiples of this (block_k and block_n of the kernels)
# the pipelining both Mosaic GPU kernels (ragged_dot, transposed_ragged_dot) run with
_MGPU_PIPELINE: dict[str, Any] = {"block_k": _MGPU_ALIGN, "max_concurrent_steps": 4, "grid_block_n": 1}
_TE_HINT = (
    "install Transformer Engine for JAX on a CUDA machine: "
    "pip install --no-build-isolation 'transformer_engine[jax]'"
)


class BackendUnavailable(RuntimeError):
    """The requested grouped-GEMM backend cannot run on this machine or for these inputs."""


# ----------------------------------------------------------------------------- selection


def _te_import_error() -> str | None:
    why = import_failure("transformer_engine.jax", "transformer_engine.jax.dense:grouped_dense")
    return None if why is None else f"{why}; {_TE_HINT}"


def _mgpu_import_error() -> str | None:
    gpu = "jax.experimental.pallas.ops.gpu."
    return import_failure(
        "the Pallas Mosaic-GPU kernels", gpu + "ragged_dot_mgpu", gpu + "transposed_ragged_dot_mgpu"
    )


def _unavailable_reason(
    name: str, dtype=None, hidden=None, ffn=None, platform: Platform | None = None
) -> str | None:
    """Why backend `name` cannot run on ``platform`` (None: this process's) for these inputs
    (None when it can)."""
    if name in ("tiled", "ragged_dot"):
        return None
    on = or_here(platform)
    if name == "megablox":
        return _megablox_unavailable(dtype, on)
    if on.name != "gpu":
        return f"needs an NVIDIA GPU, but the platform is {on.name!r}"
    if name == "te":
        return _te_import_error()
    if on.compute_capability is not None and on.compute_capability[0] != 9:
        return f"the Mosaic-GPU ragged_dot kernels need Hopper (sm_90), found sm_{on.cc}"
    if dtype is not None and jnp.dtype(dtype) not in _HALF:
        return f"needs bfloat16 or float16 activations, got {jnp.dtype(dtype)}"
    bad = [d for d in (hidden, ffn) if d is not None and d % _MGPU_ALIGN]
    if bad:
        return f"hidden and expert ffn must be multiples of {_MGPU_ALIGN}, got {bad}"
    return _mgpu_import_error()


def _megablox_unavailable(dtype, on: Platform) -> str | None:
    if on.name != "tpu":
        return f"needs a TPU, but the platform is {on.name!r}"
    if dtype is not None and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"needs bfloat16 or float32 activations, got {jnp.dtype(dtype)}"
    return megablox.import_error()


def available_backends(
    dtype=None, hidden=None, ffn=None, *, platform: Platform | None = None
) -> tuple[str, ...]:
    """Concrete backends that can run on ``platform`` (None: this process's) for these inputs."""
    on = or_here(platform)
    return tuple(b for b in BACKENDS[1:] if _unavailable_reason(b, dtype, hidden, ffn, on) is None)


def resolve_backend(
    name: str,
    dtype=None,
    *,
    hidden: int | None = None,
    ffn: int | None = None,
    platform: Platform | None = None,
) -> str:
    """Map a backend name to a concrete backend that can run on ``platform`` (None: this
    process's, ``Platform.here()``).

    "auto": TPU -> megablox; CPU (or any other non-GPU) -> tiled; GPU with bf16/fp16 -> te if
    Transformer Engine imports, else mgpu when it fits (Hopper, H and F multiples of 64), else tiled;
    GPU with fp32 -> tiled (ragged_dot runs densely: see the module docstring).
    Unknown names raise ValueError; a named backend that cannot run raises
    BackendUnavailable naming the ones that can.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; choose one of {BACKENDS}")
    on = or_here(platform)
    if name == "auto":
        if _megablox_unavailable(dtype, on) is None:
            return "megablox"
        if on.name != "gpu" or (dtype is not None and jnp.dtype(dtype) not in _HALF):
            return "tiled"
        return next(
            (c for c in ("te", "mgpu") if _unavailable_reason(c, dtype, hidden, ffn, on) is None), "tiled"
        )
    reason = _unavailable_reason(name, dtype, hidden, ffn, on)
    if reason is not None:
        raise BackendUnavailable(
            f"MoE backend {name!r} is unavailable: {reason}. "
            f"Available here: {available_backends(dtype, hidden, ffn, platform=on)}"
        )
    return name


def ragged_dot_expansion_bytes(rows: int, experts: int, hidden: int, ffn: int, dtype) -> int:
    """Bytes of the zero-masked operands XLA builds for the ragged_dot backend's SwiGLU
    forward and backward ([rows, E, H] and [rows, E, F], twice each)."""
    return rows * experts * (2 * hidden + 2 * ffn) * jnp.dtype(dtype).itemsize


# ----------------------------------------------------------------------------- sorted rows


def _ragged_dot(lhs, rhs, group_sizes_E):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes_E, preferred_element_type=jnp.float32)


def _te_gmm(lhs, rhs, group_sizes_E):
    from transformer_engine.jax.dense import grouped_dense

    return grouped_dense(lhs, rhs, group_sizes_E, contracting_dims=((1,), (1,)))


def _mgpu_blocks(n: int) -> int:
    return 128 if n % 128 == 0 else 64


def _mgpu_forward(lhs, rhs, group_sizes_E, transpose_rhs=False):
    """Hopper ragged_dot: out [rows, f] (or [rows, k'] with rhs [E, k', k] when transposed)."""
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot

    n_out = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return ragged_dot(
        lhs,
        rhs,
        group_sizes=group_sizes_E,
        block_m=128,
        block_n=_mgpu_blocks(n_out),
        transpose_rhs=transpose_rhs,
        **_MGPU_PIPELINE,
    )


def _typed_like(out, *operands):
    """``out`` typed as varying along the mesh axes its operands vary along: a Pallas call's
    result inside ``shard_map`` does not carry them, and a custom VJP's gradient must have
    its primal operand's type (a no-op outside shard_map)."""
    return vary(out, varying_axes(*operands))


@jax.custom_vjp
def _mgpu_gmm(lhs, rhs, group_sizes_E):
    return _typed_like(_mgpu_forward(lhs, rhs, group_sizes_E), lhs, rhs)


def _mgpu_gmm_fwd(lhs, rhs, group_sizes_E):
    y = _typed_like(_mgpu_forward(lhs, rhs, group_sizes_E), lhs, rhs)
    return y, (lhs, rhs, group_sizes_E)


def _mgpu_gmm_bwd(res, dy):
    """dX = dY @ W[e]^T (ragged_dot, transpose_rhs); dW[e] = X_e^T @ dY_e (transposed)."""
    from jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu import transposed_ragged_dot

    lhs, rhs, group_sizes_E = res
    dy = dy.astype(lhs.dtype)
    dx = _mgpu_forward(dy, rhs, group_sizes_E, transpose_rhs=True)
    k, f = rhs.shape[1:]
    dw = transposed_ragged_dot(
        lhs,
        dy,
        group_sizes=group_sizes_E,
        block_m=_mgpu_blocks(k),
        block_n=_mgpu_blocks(f),
        **_MGPU_PIPELINE,
    )
    return (_typed_like(dx, lhs), _typed_like(dw.astype(rhs.dtype), rhs), None)


_mgpu_gmm.defvjp(_mgpu_gmm_fwd, _mgpu_gmm_bwd)

_GMM = {"ragged_dot": _ragged_dot, "mgpu": _mgpu_gmm, "te": _te_gmm}


def sorted_swiglu(ops: tuple[jax.Array, ...], backend: str, scale_M: jax.Array | None = None) -> jax.Array:
    """SwiGLU experts on rows sorted by expert -> [M, H]: ``ops`` is ``tiled.expert_operands``'
    (x_MH, wi_0_EHF, wi_1_EHF, wo_EFH, group_sizes_E) without the scale; ``scale_M`` scales
    each row's activation before ``wo`` (fp32; None: 1).

    Inside ``shard_map`` every operand is typed as varying along every mesh axis any of them
    varies along (``expert_operands``): a custom VJP (mgpu, te) must return gradients of its
    operands' own types, and the transpose of that cast sums the weight gradients over the
    token axes the weights do not vary along. (Without it mgpu's backward failed to trace at
    EP > 1: "Custom VJP bwd rule must produce an output with the same type".)"""
    gmm = _GMM[backend]
    x_MH, w0_EHF, w1_EHF, wo_EFH, group_sizes_E = ops
    dtype = x_MH.dtype
    a0_MF = gmm(x_MH, w0_EHF, group_sizes_E).astype(dtype)
    a1_MF = gmm(x_MH, w1_EHF, group_sizes_E).astype(dtype)
    if scale_M is not None:  # its cotangent must have its type: vary it as the rows do
        scale_M = _typed_like(scale_M, a0_MF)
    h_MF = swiglu_product(a0_MF, a1_MF, scale_M)
    return gmm(h_MF, wo_EFH, group_sizes_E).astype(dtype)


def grouped_swiglu(
    x_RH: jax.Array,
    plan,
    wi_0_EHF: jax.Array,
    wi_1_EHF: jax.Array,
    wo_EFH: jax.Array,
    backend: str,
    block_rows: int | None = None,
    scale_R: jax.Array | None = None,
    row_tile: int = 1,
    platform: Platform | None = None,
    all_grouped: bool = False,
) -> jax.Array:
    """Dispatch to a concrete backend; `plan` is the permute.Dispatch for x_RH's layout.

    The tiled backend reads the tile rows m from the layout (R = P*m) and runs blocks of up
    to `block_rows` rows (None: default_block_rows(m)); only plan.group_sizes_E's experts
    are computed. ``scale_R`` [R]: each row's SwiGLU activation is scaled by it before
    ``wo`` (the combine weights, so the weights' gradient needs no [R, H] output kept).
    ``row_tile``: megablox's row tile, which R is a multiple of (the dispatch padded it).
    ``platform``: the target the tiled blocks and megablox's tiles are chosen for (None: this
    process's). ``all_grouped``: every row is in a group (no padding, no spare group), so
    megablox need not zero the rows after the groups.
    """
    if backend in _GMM:
        ops = expert_operands(x_RH, wi_0_EHF, wi_1_EHF, wo_EFH, plan.group_sizes_E, with_scale=False)
        return sorted_swiglu(ops, backend, scale_R)
    if backend not in ("tiled", "megablox"):
        raise ValueError(f"not a concrete backend: {backend!r}; resolve it first")
    if backend == "tiled" and plan.tile_expert_P is None:
        raise ValueError("the tiled backend needs a plan built with tile_rows")
    on = or_here(platform)
    ops = expert_operands(x_RH, wi_0_EHF, wi_1_EHF, wo_EFH, plan.group_sizes_E, scale_R)
    if backend == "megablox":
        if plan.tile_expert_P is not None:  # groups padded to the tile: the kernels see whole tiles
            m = x_RH.shape[0] // plan.tile_expert_P.shape[0]
            ops = (*ops[:4], cdiv_array(ops[4], m) * m, *ops[5:])
        return megablox.megablox_swiglu(ops, row_tile=row_tile, platform=on, all_grouped=all_grouped)
    m = x_RH.shape[0] // plan.tile_expert_P.shape[0]  # R = P * m
    block_rows = block_rows or default_block_rows(m, on.name)
    return tiled_swiglu(ops, tile_rows=m, block_rows=block_rows, two_walks=on.name == "gpu")
