"""When FSDP gathers the weights over the ``data`` axis (``parallel.weight_gather``).

``micro_batch`` (the default, least memory): the fp32 master weights stay sharded and each
micro-batch's forward pass (and its backward, and a remat recomputation) gathers what it uses,
so a step of n micro-batches gathers every weight over ``data`` 2n times (forward, backward) and
reduce-scatters its gradient n times.

``step``: once per step, before the first micro-batch, every weight is cast to the compute
dtype and gathered over ``data`` (the axis that spans NVLink domains); the micro-batches use
that copy, so the only per-micro-batch traffic across domains is the gradient's reduction.
Weights sharded over the EP group too (attention, dense MLPs, embeddings: sharded over every
device) stay sharded inside the group and are still gathered per use over the group's fast
links. Each micro-batch's gradient is reduced in two stages where a weight spans both:
inside the EP group (reduce-scatter over NVLink) and then across ``data`` on the group's
shard; expert weights (split over the EP group by expert) reduce-scatter over ``data`` alone.
The reductions move the compute dtype: XLA:GPU reduces the weight-gradient matmuls' bf16
partial sums where they are made, before the cast to the master dtype (``make compile``: bf16
reduce-scatters and all-reduces of every gradient but the fp32 router's). The running sum
over micro-batches is in the master dtype and keeps the master sharding. Costs: the
compute-dtype copy of every weight's EP-group shard for the whole step, and each
micro-batch's gradient at that size before its reduction.

Weights the model reads in fp32 whatever the compute dtype (the router, norm scales) are
gathered in their master dtype, so both modes compute the same values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_train.parallel import sharding

FP32_AXES = ("expert_gate", "norm")  # a weight with one of these logical axes is not cast


def without_data(spec: P, alone_too: bool) -> P:
    """``spec`` with the ``data`` axis dropped from each dimension that it splits together
    with other axes, and (``alone_too``) from those it splits alone."""
    out = []
    for entry in spec:
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        rest = tuple(a for a in axes if a != sharding.DATA)
        if rest == axes or (not rest and not alone_too):
            out.append(entry)
        else:
            out.append(rest if len(rest) > 1 else (rest[0] if rest else None))
    return P(*out)


def cast_in_use(axes: tuple[str | None, ...]) -> bool:
    """Whether the model reads a weight with these logical axes in the compute dtype: every
    matrix (a scanned group's ``layers`` axis does not count) but the router's."""
    named = [a for a in axes if a != "layers"]
    return len(named) >= 2 and not set(named) & set(FP32_AXES)


@dataclasses.dataclass(frozen=True)
class StepGather:
    """``parallel.weight_gather=step`` for one run: per-leaf trees of the same structure as
    the parameters."""

    master: Any  # NamedSharding of each fp32 master weight (the train state's)
    use: Any  # NamedSharding of the gathered copy: the master's without ``data``
    reduce: Any  # NamedSharding a micro-batch's gradient is reduced to before the master's
    dtype: Any  # dtype of each gathered copy: the compute dtype, or the master's (FP32_AXES)

    @classmethod
    def of(cls, boxed_params, master_shardings, compute_dtype) -> StepGather:
        """From the logically-boxed parameters (their axis names) and their shardings."""
        mesh = jax.tree.leaves(master_shardings)[0].mesh

        def sharded(alone_too):
            return jax.tree.map(
                lambda s: NamedSharding(mesh, without_data(s.spec, alone_too)), master_shardings
            )

        def dtype_of(boxed):
            names = tuple(getattr(boxed, "names", ()))  # an unboxed leaf: no names
            master = getattr(boxed, "value", boxed).dtype
            return jnp.dtype(compute_dtype if cast_in_use(names) else master)

        dtype = jax.tree.map(dtype_of, boxed_params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
        return cls(master=master_shardings, use=sharded(True), reduce=sharded(False), dtype=dtype)

    def gather(self, params):
        """The step's copy of the master ``params``: cast, then gathered over ``data``."""
        return jax.tree.map(
            lambda p, dt, sh: jax.lax.with_sharding_constraint(p.astype(dt), sh), params, self.dtype, self.use
        )

    def reduced(self, grads, params):
        """A micro-batch's gradient with respect to the gathered copy, summed over the
        devices and sharded as the master ``params``, in their dtype (the cast is asked
        before the reduction; XLA:GPU reduces the compute-dtype partial sums, module doc)."""

        def one(g, p, red, master):
            g = jax.lax.with_sharding_constraint(g.astype(jnp.float32), red)
            return jax.lax.with_sharding_constraint(g, master).astype(p.dtype)

        return jax.tree.map(one, grads, params, self.reduce, self.master)
