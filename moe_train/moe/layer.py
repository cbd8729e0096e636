"""Dropless MoE layer: route -> permute -> grouped GEMM -> unpermute.

Shape key: T tokens, H hidden, E experts, F expert ffn, K top-k, N = T*K assignments,
R dispatched rows, m tile rows.

Every assignment is computed (no capacity, no dropping). Shapes are static: routing only
changes array values, so a jitted layer compiles once and never syncs with the host.
"""

from __future__ import annotations

import jax

from moe_train.moe.gemm import grouped_swiglu, resolve_backend
from moe_train.moe.permute import make_dispatch, permute, unpermute
from moe_train.moe.router import route_tokens

MAX_PADDING = 0.1  # executed rows <= (1 + MAX_PADDING) * useful rows under any routing
CPU_MAX_TILE_ROWS = 32
GPU_MAX_TILE_ROWS = 128


def _pow2_floor(n: float) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def default_tile_rows(num_assignments: int, num_experts: int, platform: str | None = None) -> int:
    """Tile rows m of the tiled backend (the padding granularity of each expert's group).

    The tiled backend executes sum_e ceil(g_e/m)*m <= N + E*(m-1) rows for N useful ones,
    whatever the routing. m is the largest power of two with E*(m-1) <= MAX_PADDING * N
    (so padding waste <= 1.1 under any routing), capped at 32 on CPU and 128 on GPU. Speed
    comes from the blocks (gemm.default_block_rows, up to 256 rows on CPU), not from m:
    each expert's span runs as full blocks plus at most one block of each smaller size.
    """
    platform = platform or jax.default_backend()
    cap = GPU_MAX_TILE_ROWS if platform == "gpu" else CPU_MAX_TILE_ROWS
    return min(cap, _pow2_floor(1 + MAX_PADDING * num_assignments / num_experts))


def check_expert_shapes(x_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH) -> tuple[int, int, int]:
    """Validate operand shapes; returns (H, E, F)."""
    H = x_TH.shape[-1]
    if gate_kernel_HE.ndim != 2 or gate_kernel_HE.shape[0] != H:
        raise ValueError(f"gate kernel must be [H={H}, E], got {gate_kernel_HE.shape}")
    E = gate_kernel_HE.shape[1]
    if wi_0_EHF.ndim != 3 or wi_0_EHF.shape[:2] != (E, H):
        raise ValueError(f"wi_0 must be [E={E}, H={H}, F], got {wi_0_EHF.shape}")
    F = wi_0_EHF.shape[2]
    if wi_1_EHF.shape != (E, H, F) or wo_EFH.shape != (E, F, H):
        raise ValueError(f"expected wi_1 {(E, H, F)} and wo {(E, F, H)}, "
                         f"got {wi_1_EHF.shape} and {wo_EFH.shape}")
    return H, E, F


def dropless_moe(x_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH, *, top_k,
                 score_function="softmax", normalize_top_k=True, num_groups=None,
                 group_top_k=None, routed_scaling=1.0, expert_bias=None, backend="auto",
                 tile_rows=None, seq_len=None, expert_input=None):
    """Dropless top-k SwiGLU mixture of experts.

    y[t] = sum over chosen e of w[t, e] * (silu(x[t] @ wi_0[e]) * (x[t] @ wi_1[e])) @ wo[e].

    Args:
      x_TH: activations [T, H] (leading dims [..., H] are flattened into T); bf16 or fp32.
        Expert matmuls run in this dtype with fp32 accumulation; y has this dtype.
      gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH: router and expert weights (any float
        dtype; experts are cast to x's dtype, the router runs in fp32).
      top_k, score_function, normalize_top_k, num_groups, group_top_k, routed_scaling,
        expert_bias: routing, see router.route (num_groups None or 0 disables groups).
      backend: one of BACKENDS ("auto" picks per platform, see gemm.resolve_backend).
      tile_rows: rows per tile of the tiled backend (None or 0: default_tile_rows).
      seq_len: rows per sequence for seq_aux_loss (None: all T rows are one sequence).
      expert_input: what the experts compute on in place of x_TH (same shape and dtype, e.g.
        an fp8 quantize-dequantized copy); routing always uses x_TH. None: x_TH.

    Returns:
      (y, stats): y shaped like x; stats as router.router_stats (dropped_tokens is 0).
    """
    H, E, F = check_expert_shapes(x_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH)
    lead_shape = x_TH.shape[:-1]
    x_TH = x_TH.reshape(-1, H)
    N = x_TH.shape[0] * top_k
    name = resolve_backend(backend, x_TH.dtype, hidden=H, ffn=F)
    with jax.named_scope("route"):
        weights_TK, experts_TK, stats = route_tokens(
            x_TH, gate_kernel_HE, top_k=top_k, score_function=score_function,
            normalize_top_k=normalize_top_k, num_groups=num_groups, group_top_k=group_top_k,
            routed_scaling=routed_scaling, expert_bias=expert_bias, seq_len=seq_len)
    m = (tile_rows or default_tile_rows(N, E)) if name == "tiled" else None
    with jax.named_scope("permute"):
        plan = make_dispatch(experts_TK, E, m)
        x_RH = permute(x_TH if expert_input is None else expert_input.reshape(-1, H), plan)
    with jax.named_scope("grouped_gemm"):
        y_RH = grouped_swiglu(x_RH, plan, wi_0_EHF, wi_1_EHF, wo_EFH, name)
    with jax.named_scope("unpermute"):
        y_TH = unpermute(y_RH, plan, weights_TK, out_dtype=x_TH.dtype)
    return y_TH.reshape(*lead_shape, H), stats
