"""Device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes, outermost first: ``data`` (data parallel; expert weights and their optimizer
state are FSDP-sharded over it, the other weights over every device where the width allows), ``expert_x`` (expert
parallel across fast-link domains) and
``expert`` (expert parallel inside one domain). An EP group is ``expert_x * expert``
consecutive devices of the device order the caller passes: ``moe_train.layout`` orders
them with the topology module, so EP groups stay inside NVLink domains.

Model code names axes logically (``embed``, ``expert``, ``activation_batch``, ...);
``LOGICAL_RULES`` is the only place that says which mesh axes each one is split over.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moe_train.config import ConfigError, ParallelConfig

MESH_AXES = ("data", "expert_x", "expert")
TOKEN_AXES = MESH_AXES  # a batch is split over every device
EP_AXES = ("expert_x", "expert")

# logical axis -> mesh axes (None: replicated)
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("activation_batch", TOKEN_AXES),
    ("activation_seq", None),
    ("activation_embed", None),
    # The leading axis of scanned layer groups' variables [layers, ...] (moe_train.model):
    # each device holds every layer's shard; the other dims follow the rules below as unstacked.
    ("layers", None),
    # Rules apply in order and a mesh axis serves one dimension of a tensor: expert weights
    # [expert, embed, mlp] take the EP axes for `expert` first, so their width falls back to
    # `data`; every other weight (attention, dense MLP, embeddings, router) is FSDP-sharded
    # along its width over every device, so an EP group does not hold copies of them.
    ("expert", EP_AXES),
    ("embed", TOKEN_AXES),
    ("embed", "data"),
    ("vocab", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
    ("mlp", None),
    ("norm", None),
    ("expert_gate", None),
)
# The same, for a width that the device count does not divide: every weight's width over data.
DATA_FSDP_RULES = tuple(r for r in LOGICAL_RULES if r != ("embed", TOKEN_AXES))


def logical_rules(hidden: int, num_devices: int):
    """The rules for a model of width ``hidden`` on ``num_devices``: non-expert weights are
    sharded over every device when that divides the width, else over ``data`` only."""
    return LOGICAL_RULES if hidden % num_devices == 0 else DATA_FSDP_RULES


def mesh_shape(p: ParallelConfig, num_devices: int, num_experts: int,
               hidden: int) -> tuple[int, int]:
    """(dp, ep) for ``num_devices``; ConfigError names sizes that would work.

    How an EP group splits into ``expert_x`` x ``expert`` follows from the NVLink domains it
    is placed on (``moe_train.layout``), not from these sizes.
    """
    ep = p.ep
    if ep < 1 or num_devices % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the {num_devices} devices; valid ep: "
                          f"{', '.join(str(d) for d in range(1, num_devices + 1) if num_devices % d == 0)}")
    if num_experts % ep:
        valid = [d for d in range(1, num_devices + 1) if num_devices % d == 0 and num_experts % d == 0]
        raise ConfigError(f"moe.num_experts={num_experts} is not divisible by parallel.ep={ep}; "
                          f"valid ep for {num_devices} devices: {', '.join(map(str, valid))}")
    dp = p.dp or num_devices // ep
    if dp * ep != num_devices:
        raise ConfigError(f"parallel.dp={dp} x parallel.ep={ep} = {dp * ep} but the mesh has "
                          f"{num_devices} devices; set parallel.dp={num_devices // ep} (or 0)")
    if hidden % dp:
        raise ConfigError(f"model.hidden={hidden} is not divisible by the data-parallel size {dp}")
    return dp, ep


def make_mesh(devices: Sequence[jax.Device], shape: tuple[int, int, int] | None = None) -> Mesh:
    """Mesh over ``devices`` in the order given: EP groups are consecutive runs of them."""
    shape = shape or (len(devices), 1, 1)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches [B, S+1] split over every device along B."""
    return NamedSharding(mesh, P(TOKEN_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_shardings(boxed_params, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedShardings for a tree of logically-partitioned (boxed) Flax variables."""
    specs = nn.get_partition_spec(boxed_params)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def activate(mesh: Mesh, rules=LOGICAL_RULES) -> contextlib.ExitStack:
    """Context in which traced model code resolves logical axis names on ``mesh``."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(nn.logical_axis_rules(rules))
    return stack
