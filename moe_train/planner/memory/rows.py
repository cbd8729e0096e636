"""The memory planner's MoE buffers: the dispatched rows of one MoE layer on one device and
the bytes each row keeps, by dispatcher, grouped-GEMM backend and compiler
(``moe_train.planner.memory``'s docstring states the formulas; ``estimate`` adds them up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_train.base.arith import cdiv
from moe_train.config import Config
from moe_train.parallel import jobplan

if TYPE_CHECKING:
    from moe_train.planner.memory.estimate import Setup

# Bytes kept per dispatched row per unit of expert_ffn F, by backend (compute itemsize a):
# tiled: its hand-written VJP keeps a = x @ [wi_0|wi_1] [R, 2F] in fp32 (moe_train.moe.tiled);
# sorted: gemm.swiglu_product's VJP keeps a0 and a1 in the compute dtype and the wo GEMM keeps
# h (3a), recomputed or stacked by a scan alike (compiled for H100: the recomputed layer's
# [R, F] buffers are those three, tests/test_compile.py; mixtral-8x7b at 4 layers under remat
# none stacks them, 2026-12-07). Until swiglu_product autodiff kept a0, a1, silu(a0) and the
# product in fp32 beside h, 16 + 4a stacked under remat none.
ROW_F_BYTES = {
    "tiled": lambda a: 8,
    "sorted": lambda a: 3 * a,
}


def tile_rows(cfg: Config, assignments: int, local_experts: int, nominal: bool) -> int:
    """m of the tiled backend: ``moe.tile_rows`` or the layer's own default for the platform
    (imported on demand: the tiled backend is the CPU path, where JAX is at hand)."""
    if cfg.moe.tile_rows:
        return cfg.moe.tile_rows
    from moe_train.moe.tiled import default_tile_rows  # JAX: make plan stays JAX-free

    return default_tile_rows(assignments, local_experts, "cpu" if nominal else "gpu")


def moe_rows(cfg: Config, s: Setup, factor: float | None) -> tuple[int, int]:
    """(expert GEMM rows, exchange buffer rows) of one MoE layer on one device."""
    T, K, E = s.tokens, cfg.moe.top_k, cfg.moe.num_experts
    L, P = E // s.ep, s.ep
    if s.dispatcher == "local":
        rows, exchange = T * K, 0
    elif s.dispatcher == "allgather":
        rows, exchange = P * T * K, P * T
    elif s.dispatcher == "a2a":
        stage = jobplan.a2a_stage(T, K, L, P, factor)
        rows = stage.peers * stage.slots
        exchange = 2 * rows
    else:  # hierarchical: stage 1 over the slow links, stage 2 inside the domain
        one, two = jobplan.hierarchical_stages(T, K, L, s.domains, s.domain_size, factor)
        r1, rows = one.peers * one.slots, two.peers * two.slots
        exchange = 2 * r1 + 2 * rows
    if s.backend != "tiled":
        return rows, exchange
    # tile-padded static layout (permute.tiled_padding), one extra group on the EP paths
    return (cdiv(rows, s.tile_rows) + L) * s.tile_rows, exchange


def moe_layer_bytes(cfg: Config, s: Setup, factor: float | None) -> tuple[int, int]:
    """(residual bytes of one MoE layer's dispatched rows, its transient buffers: the send
    buffers, and on GPU the tiled backward's kept da, ``weight_walk_bytes``)."""
    H, F, a = cfg.model.hidden, cfg.moe.expert_ffn, s.a
    rows, exchange = moe_rows(cfg, s, factor)
    per_f = ROW_F_BYTES[s.backend]
    kept = rows * (F * per_f(a) + 2 * H * a) + exchange * H * a
    return kept, exchange * H * a + weight_walk_bytes(s, rows, F)


def weight_walk_bytes(s: Setup, rows: int, F: int) -> int:
    """On GPU the tiled backend's backward keeps the gradient of ``a`` [R, 2F] in the compute
    dtype from its row walk to its weight walk (``moe_train.moe.tiled._backward``), one layer
    at a time (deepseek-v3 at full depth on 64 gb200-nvl72 nodes, bucket 1x: XLA's peak +1.3
    GiB with the walks split, 0.75 GiB of it this buffer). On CPU it walks once."""
    return rows * 2 * F * s.a if s.backend == "tiled" and s.gpu else 0


def moe_buffer_bytes(cfg: Config, s: Setup, factor: float | None, n_moe: int) -> int:
    """Dispatched-row residuals: every MoE layer's (``none``, ``moe``) or two layers' (the
    recomputed one and its gradients: ``full``, ``matmuls``; on GPU the recomputed one: XLA:GPU
    fuses the gradients' elementwise steps into the GEMMs that consume them), plus one
    layer's send buffers."""
    if n_moe == 0:
        return 0
    kept, transient = moe_layer_bytes(cfg, s, factor)
    layers = n_moe + 1 if s.remat in ("none", "moe") else (1 if s.gpu else 2)
    return layers * kept + transient + deferred_mtp_bytes(cfg, s, factor)


def deferred_mtp_bytes(cfg: Config, s: Setup, factor: float | None) -> int:
    """On GPU under ``full``/``matmuls`` remat: each MTP block's expert weight-gradient
    operands, held through the main layers' backward pass. The MTP block runs outside the
    layer loop and only the optimizer reads its weight gradients, so XLA:GPU's
    latency-hiding scheduler, below its memory limit, defers those GEMMs past the main
    layers' backward and keeps their operands: the dispatched rows x and dy (2 H) and a0, a1
    and h (3 F), in the compute dtype (deepseek-v3 at 4 layers, 8 h100-dgx, EP 64, 4x
    bucket: 5.0 GiB of such buffers in XLA's peak live set, ``make compile PEAK=1``)."""
    if not (s.gpu and cfg.model.mtp_depth and s.remat in ("full", "matmuls")):
        return 0
    rows, _ = moe_rows(cfg, s, factor)
    return cfg.model.mtp_depth * rows * (2 * cfg.model.hidden + 3 * cfg.moe.expert_ffn) * s.a
