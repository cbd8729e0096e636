"""Dropless mixture-of-experts: router, dispatch, grouped GEMM backends, baselines.

* ``layer``: the pipeline of named steps (``route``, ``dispatch``, ``permute``, ``grouped_gemm``,
  ``unpermute``, ``combine``) for every EP size; ``router``, ``permute``, ``stats``: its steps
  and its statistics; ``dispatch/``: one module per token exchange (local, allgather, a2a,
  hierarchical) and the ``Dispatcher`` contract they implement (``dispatch/contract.py``);
* ``gemm``, ``tiled``: the grouped GEMM backends (``tiled`` also holds its settings:
  tile and block rows); ``swiglu``: the SwiGLU product with a VJP that keeps its inputs in the
  compute dtype (the sorted-row backends);
  ``reference``: the obviously-correct per-expert loop they are tested against; ``capacity``:
  the token-dropping GShard baseline;
* ``routings``: synthetic routings (uniform, Zipf, one hot expert) shared by the self-test,
  the benchmarks and the tests.

May import: ``moe_train.parallel`` (mesh axes, job rules). Never the model, the training
loop, the launcher, the planners or the benchmarks.
"""

from moe_train.moe.capacity import capacity_moe, expert_capacity
from moe_train.moe.gemm import BACKENDS, BackendUnavailable, available_backends, resolve_backend
from moe_train.moe.layer import dropless_moe
from moe_train.moe.permute import tiled_padding
from moe_train.moe.reference import dense_reference_moe, swiglu_mlp
from moe_train.moe.router import Routing, route, route_tokens, router_logits, router_stats
from moe_train.moe.stats import MoEStats
from moe_train.moe.tiled import default_tile_rows

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "MoEStats",
    "Routing",
    "available_backends",
    "capacity_moe",
    "default_tile_rows",
    "dense_reference_moe",
    "dropless_moe",
    "expert_capacity",
    "resolve_backend",
    "route",
    "route_tokens",
    "router_logits",
    "router_stats",
    "swiglu_mlp",
    "tiled_padding",
]
