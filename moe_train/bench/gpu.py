"""The grouped GEMM alone at GPU model shapes, per backend (``make gpu-check``'s speed rows).

On one GPU, in bf16: the experts' grouped GEMM (``moe_train.bench.gemm.group_rows``; uniform
and one-hot-expert routing) of Mixtral-8x7B-shaped experts (H=4096, F=14336, E=8, top-2) and
DeepSeek-V3-shaped experts (H=7168, F=2048, E=256, top-8) per backend, against a dense GEMM
chain of the same useful FLOPs. ``TINY`` runs the same code at toy sizes (on CPU the GPU
backends are reported unavailable). The MoE layer and the train step on an accelerator (TPU or
GPU) are ``moe_train.bench.accel`` (``python -m moe_train.bench --accel``; ``--gpu`` is the
same).
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp

from moe_train.bench import common, gemm
from moe_train.bench import experts as X
from moe_train.moe.routings import MoEShape, assignments


@dataclasses.dataclass(frozen=True)
class Model:
    """One model's expert shape."""

    name: str  # the model it is taken from
    shape: MoEShape  # T, H, F, E, top-k


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes and timing bounds of the GEMM rows."""

    models: tuple[Model, ...]  # expert shapes
    gemm_routings: tuple[str, ...]  # routings of the rows (moe.routings.assignments)
    min_reps: int = 3  # timed rounds, at least
    max_reps: int = 10  # timed rounds, at most
    target_s: float = 3.0  # timed seconds per group of rows
    dtype: str = "bfloat16"  # operands (fp32 accumulation)


FULL = Sizes(
    models=tuple(Model(name, common.preset_shape(name, 4096)) for name in ("mixtral-8x7b", "deepseek-v3")),
    gemm_routings=("uniform", "hot"),
)
TINY = Sizes(
    models=(
        Model("mixtral-tiny", MoEShape(256, 64, 128, 8, 2)),
        Model("deepseek-tiny", MoEShape(256, 64, 64, 16, 4)),
    ),
    gemm_routings=("hot",),
    **common.QUICK_TIMING,
)


def gemm_rows(model: Model, s: Sizes, deadline: float, modes: tuple[str, ...] = ("fwd+bwd",)) -> list[dict]:
    """The grouped GEMM alone per backend, routing and mode, like the CPU section."""
    if time.perf_counter() > deadline:
        return [{"model": model.name, "backend": "all", "skipped": "over the run's time budget"}]
    shape = model.shape
    cases = {
        r: X.Case(
            assignments(shape.tokens, shape.experts, shape.top_k, r),
            shape.experts,
            shape.hidden,
            shape.ffn,
            jnp.dtype(s.dtype),
        )
        for r in s.gemm_routings
    }
    sizes = gemm.Sizes(
        experts=(shape.experts,),
        rows_per_expert=0,
        hidden=shape.hidden,
        ffn=shape.ffn,
        top_k=shape.top_k,
        routings=s.gemm_routings,
        fwd_routings=(),
        modes=modes,
        candidates=("mgpu", "ragged_dot", "tiled", "te"),
        min_reps=s.min_reps,
        max_reps=s.max_reps,
        target_s=s.target_s,
        budget_s=max(1.0, deadline - time.perf_counter()),
        max_bytes=60e9,
        dtype=s.dtype,
    )
    rows = []
    for mode in modes:
        rows += gemm.group_rows(cases, mode, sizes.candidates, sizes)
    for r in rows:
        r["model"] = model.name
    return rows
