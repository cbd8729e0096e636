"""Device mesh and the one table that maps logical axis names to mesh axes.

Model code names axes logically (``batch``, ``embed``, ``expert``, ...). ``LOGICAL_RULES`` is
the only place that says which mesh axis each one is split over. With the data-parallel mesh
of this module, activations are split over ``data`` along ``batch`` and parameters are
replicated; expert and FSDP axes are added to the mesh by the expert-parallel work.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"

# logical axis -> mesh axis (None: replicated)
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", DATA_AXIS),
    ("seq", None),
    ("embed", None),
    ("vocab", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
    ("mlp", None),
    ("expert", None),
    ("expert_gate", None),
)


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D data-parallel mesh over ``devices`` in the order given (the caller picks it)."""
    return Mesh(np.asarray(devices).reshape(len(devices)), (DATA_AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches [B, S+1] split over the data axis along B."""
    return NamedSharding(mesh, P(DATA_AXIS, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_shardings(boxed_params, mesh: Mesh):
    """NamedShardings for a tree of logically-partitioned (boxed) Flax variables."""
    specs = nn.get_partition_spec(boxed_params)
    return nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_RULES)


def activate(mesh: Mesh):
    """Context in which traced model code resolves logical axis names on ``mesh``."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(nn.logical_axis_rules(LOGICAL_RULES))
    return stack
