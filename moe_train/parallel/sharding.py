"""Device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes, outermost first: ``data`` (data parallel; expert weights and their optimizer
state are FSDP-sharded over it, the other weights over every device where the width allows), ``expert_x`` (expert
parallel across fast-link domains) and
``expert`` (expert parallel inside one domain). An EP group is ``expert_x * expert``
consecutive devices of the device order the caller passes: ``moe_train.parallel.layout`` orders
them with the topology module, so EP groups stay inside NVLink domains.

Model code names axes logically (``embed``, ``expert``, ``activation_batch``, ...);
``LOGICAL_RULES`` is the only place that says which mesh axes each one is split over.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moe_train.config import ParallelConfig
from moe_train.parallel import jobplan

DATA = "data"  # data parallel (FSDP for the weights)
EXPERT_X = "expert_x"  # expert parallel across fast-link domains (the slow links)
EXPERT = "expert"  # expert parallel inside one fast-link domain
MESH_AXES = (DATA, EXPERT_X, EXPERT)
TOKEN_AXES = MESH_AXES  # a batch is split over every device
EP_AXES = (EXPERT_X, EXPERT)

# logical axis -> mesh axes (None: replicated)
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("activation_batch", TOKEN_AXES),
    ("activation_seq", None),
    ("activation_embed", None),
    # The leading axis of scanned layer groups' variables [layers, ...] (moe_train.model.transformer):
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
    ("mtp_concat", None),  # the [embedding; hidden] input rows of an MTP module's eh_proj
    # MLA's latent widths: FSDP over every device where the count divides them
    # (``logical_rules``), else whole on each device like the activations' own copies
    ("q_lora", None),
    ("kv_lora", None),
    ("activation_latent", None),
)
# The same, for a width that the device count does not divide: every weight's width over data.
DATA_FSDP_RULES = tuple(r for r in LOGICAL_RULES if r != ("embed", TOKEN_AXES))


def latent_widths(m) -> dict[str, int]:
    """The MLA latent axes of model config ``m`` and their widths ({} for GQA)."""
    if m.attention_kind != "mla":
        return {}
    return {"kv_lora": m.kv_lora_rank, **({"q_lora": m.q_lora_rank} if m.q_lora_rank else {})}


def logical_rules(hidden: int, num_devices: int, latents: dict[str, int] | None = None):
    """The rules for a model of width ``hidden`` on ``num_devices``: non-expert weights are
    sharded over every device when that divides the width, else over ``data`` only; an MLA
    latent axis (``latents``: name -> width) over every device where that divides it, else
    not at all."""
    rules = LOGICAL_RULES if hidden % num_devices == 0 else DATA_FSDP_RULES
    split = tuple((name, TOKEN_AXES) for name, width in sorted((latents or {}).items())
                  if width % num_devices == 0)
    return split + rules if split else rules


def mesh_shape(p: ParallelConfig, num_devices: int, num_experts: int,
               hidden: int) -> tuple[int, int]:
    """(dp, ep) for ``num_devices``; ConfigError names sizes that would work.

    How an EP group splits into ``expert_x`` x ``expert`` follows from the NVLink domains it
    is placed on (``moe_train.parallel.layout``), not from these sizes.
    """
    jobplan.check_ep(num_devices, p.ep, num_experts)
    dp = jobplan.check_dp(num_devices, p.ep, p.dp)
    jobplan.check_width(hidden, dp)
    return dp, p.ep


def make_mesh(devices: Sequence[jax.Device], shape: tuple[int, int, int] | None = None) -> Mesh:
    """Mesh over ``devices`` in the order given: EP groups are consecutive runs of them."""
    shape = shape or (len(devices), 1, 1)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def ep_size(mesh: Mesh) -> int:
    """Devices of one expert-parallel group: ``expert_x`` x ``expert``."""
    return mesh.shape[EXPERT_X] * mesh.shape[EXPERT]


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


def logical_spec(*names: str | None, rules=LOGICAL_RULES) -> P:
    """The PartitionSpec of an array whose dimensions have these logical ``names`` (None:
    not split), e.g. the ``shard_map`` specs of the MoE layer."""
    return P(*nn.logical_to_mesh_axes(names, rules))


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A run's mesh and the logical-axis rules chosen for it, built once (``of``)."""

    mesh: Mesh  # axes MESH_AXES; EP groups are consecutive devices (moe_train.parallel.layout)
    rules: tuple  # LOGICAL_RULES, or DATA_FSDP_RULES for a width the devices do not divide

    @classmethod
    def of(cls, mesh: Mesh, m) -> "Sharding":
        """For model config ``m`` (``cfg.model``) on ``mesh``."""
        return cls(mesh, logical_rules(m.hidden, mesh.size, latent_widths(m)))

    def activate(self) -> contextlib.ExitStack:
        """The context in which traced model code resolves logical names on this mesh."""
        return activate(self.mesh, self.rules)

    def params(self, boxed_params):
        """NamedShardings of a tree of logically-partitioned (boxed) Flax variables."""
        return param_shardings(boxed_params, self.mesh, self.rules)

    @property
    def batch(self) -> NamedSharding:
        return batch_sharding(self.mesh)

    @property
    def replicated(self) -> NamedSharding:
        return replicated(self.mesh)

    def wrap(self, jitted) -> "InContext":
        """``jitted`` (a ``jax.jit`` function) traced, lowered and run in this context, so
        its callers need no context of their own."""
        return InContext(jitted, self)


class InContext:
    """A jitted function that enters its ``Sharding``'s context whenever it is called or
    lowered (where tracing happens)."""

    def __init__(self, jitted, sharding: Sharding):
        self.jitted, self.sharding = jitted, sharding

    def __call__(self, *args):
        with self.sharding.activate():
            return self.jitted(*args)

    def lower(self, *args):
        with self.sharding.activate():
            return self.jitted.lower(*args)
