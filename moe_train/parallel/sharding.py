"""Device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes, outermost first: ``data`` (data parallel; every weight and its optimizer state is
FSDP-sharded), ``expert_x`` (expert parallel across fast-link domains) and
``expert`` (expert parallel inside one domain). An EP group is ``expert_x * expert``
consecutive devices of the device order the caller passes: ``topology.device_mesh`` orders
them with the topology module, so EP groups stay inside NVLink domains.

Model code names axes logically (``embed``, ``expert``, ``activation_batch``, ...);
``logical_rules`` is the only place that says which mesh axes each one is split over, for a
model and the sizes of its mesh: every weight axis takes the largest group of mesh axes whose
size divides every width it has (``weights`` lists them), in the order of ``SPLIT_ORDER``, each
mesh axis serving one dimension of a tensor. Where the device count divides the model width
that is ``LOGICAL_RULES``: expert weights [expert, embed, mlp] over (EP axes, data), every
other weight along ``embed`` (or an MLA latent) over every device. Where it does not, the
other dimensions take the mesh axes ``embed`` leaves, so a weight stays whole on every device
only where no mesh axis divides the widths of its axes (``head_dim`` and ``norm`` aside: never
split).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_train.config import Config, ModelConfig, MoEConfig, ParallelConfig, head_dim
from moe_train.parallel import jobplan

DATA = "data"  # data parallel (FSDP for the weights)
EXPERT_X = "expert_x"  # expert parallel across fast-link domains (the slow links)
EXPERT = "expert"  # expert parallel inside one fast-link domain
MESH_AXES = (DATA, EXPERT_X, EXPERT)
TOKEN_AXES = MESH_AXES  # a batch is split over every device
EP_AXES = (EXPERT_X, EXPERT)

# The same on every mesh: activations and weights in use (``moe_train.model.layers.IN_USE``:
# a weight gathered for its matmul) split along the batch only; routed experts over EP.
FIXED_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("activation_batch", TOKEN_AXES),
    ("activation_seq", None),
    ("activation_embed", None),
    ("activation_latent", None),
    ("activation_heads", None),
    ("activation_kv_heads", None),
    ("activation_mlp", None),
    ("activation_vocab", None),
    ("activation_mtp_concat", None),
    # The leading axis of scanned layer groups' variables [layers, ...] (model.transformer):
    # each device holds every layer's shard; the other dims follow the rules as unstacked.
    ("layers", None),
    ("expert", EP_AXES),  # routed experts [expert, embed, mlp]: E over the EP group, first
)
# Weight axes split by their widths, in this order: MLA's latents (``kv_lora_rope``: kv_a's
# output, the latent and the RoPE key), the model width, then the rest.
SPLIT_ORDER = (
    "q_lora",
    "kv_lora",
    "kv_lora_rope",
    "embed",
    "heads",
    "kv_heads",
    "mlp",
    "vocab",
    "mtp_concat",
    "expert_gate",
)
WHOLE = ("head_dim", "norm")  # never split (head_dim also names the qk-norm scales)
# The table where the device count divides every width: expert weights take the EP axes for
# `expert`, so their width falls back to `data`; every other weight's width over every device.
LOGICAL_RULES = (
    *FIXED_RULES,
    ("embed", TOKEN_AXES),
    ("embed", DATA),
    *((name, None) for name in SPLIT_ORDER + WHOLE if name != "embed"),
)


Axes = tuple[tuple[str, int], ...]  # a weight's (logical axis, width) per dimension


def weights(m: ModelConfig, e: MoEConfig | None = None) -> list[tuple[int, Axes]]:
    """Every weight of model ``m`` (with MoE section ``e``; None: without the MoE layers'),
    MTP modules included, as (how many, ((logical axis, width), ...)): a scanned group's
    stacked [layers, ...] weight counts once per layer, its ``layers`` axis left out."""
    H = m.hidden
    dense, moe = m.first_dense_layers, m.num_layers - m.first_dense_layers
    dense, moe = (dense, moe + m.mtp_depth) if moe else (dense + m.mtp_depth, 0)
    blocks, norm = dense + moe, (("norm", H),)
    out = [
        (1, (("vocab", m.vocab_size), ("embed", H))),
        (1 + 2 * blocks + 3 * m.mtp_depth, norm),
        (0 if m.tie_embeddings else 1, (("embed", H), ("vocab", m.vocab_size))),
        (m.mtp_depth, (("mtp_concat", 2 * H), ("embed", H))),
    ]
    out += [(blocks * n, w) for n, w in _attention(m)]
    mlp = (("embed", H), ("mlp", m.dense_ffn))
    out += [(2 * dense, mlp), (dense, mlp[::-1])]
    if e is not None and moe:
        expert = (("expert", e.num_experts), ("embed", H), ("mlp", e.expert_ffn))
        shared = (("embed", H), ("mlp", e.num_shared_experts * (e.shared_ffn or e.expert_ffn)))
        out += [
            (moe, (("embed", H), ("expert_gate", e.num_experts))),
            (2 * moe, expert),
            (moe, (expert[0], expert[2], expert[1])),
        ]
        out += [(2 * moe, shared), (moe, shared[::-1])] if e.num_shared_experts else []
    return [(n, w) for n, w in out if n]


def _attention(m: ModelConfig) -> list[tuple[int, Axes]]:
    """One block's attention weights, as ``weights`` lists them."""
    H, N = m.hidden, m.num_heads
    if m.attention_kind != "mla":
        D, K = head_dim(m), m.num_kv_heads
        kv = (("embed", H), ("kv_heads", K), ("head_dim", D))
        return [
            (1, (("embed", H), ("heads", N), ("head_dim", D))),
            (2, kv),
            (1, (("heads", N), ("head_dim", D), ("embed", H))),
            (2 if m.qk_norm else 0, (("head_dim", D),)),
        ]
    W, Z, U, I, J = (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
    q = (
        [
            (1, (("embed", H), ("q_lora", W))),
            (1, (("norm", W),)),
            (1, (("q_lora", W), ("heads", N), ("head_dim", U + I))),
        ]
        if W
        else [(1, (("embed", H), ("heads", N), ("head_dim", U + I)))]
    )
    return q + [
        (1, (("embed", H), ("kv_lora_rope", Z + I))),
        (1, (("norm", Z),)),
        (1, (("kv_lora", Z), ("heads", N), ("head_dim", U + J))),
        (1, (("heads", N), ("head_dim", J), ("embed", H))),
    ]


def _groups(sizes: Mapping[str, int]) -> list[str | tuple[str, ...]]:
    """Every group of mesh axes (in mesh order), the largest first (more axes first among
    equals, so every device reads as TOKEN_AXES): one axis as its name."""
    subsets = [c for k in range(len(MESH_AXES), 0, -1) for c in itertools.combinations(MESH_AXES, k)]
    subsets.sort(key=lambda c: -math.prod(sizes[a] for a in c))  # stable: more axes first
    return [c if len(c) != 1 else c[0] for c in subsets]  # no subset is empty


def logical_rules(cfg: Config | ModelConfig, sizes: Mapping[str, int]):
    """The rules for model ``cfg`` (a ``Config``; its ``model`` alone leaves the MoE layers'
    widths out) on a mesh of these axis ``sizes`` (``mesh.shape``): each weight axis of
    ``SPLIT_ORDER`` over every group of mesh axes whose size divides all its widths, largest
    first; flax takes, for each dimension of a tensor, the first group none of whose axes
    another dimension already holds."""
    m, e = (cfg.model, cfg.moe) if isinstance(cfg, Config) else (cfg, None)
    widths: dict[str, set[int]] = {}
    for _, axes in weights(m, e):
        for name, width in axes:
            widths.setdefault(name, set()).add(width)
    split = tuple(
        (name, g)
        for name in SPLIT_ORDER
        if name in widths
        for g in _groups(sizes)
        if all(w % mesh_size(g, sizes) == 0 for w in widths[name])
    )
    return FIXED_RULES + split + tuple((name, None) for name in SPLIT_ORDER + WHOLE)


def mesh_size(axes: str | tuple[str, ...] | None, sizes: Mapping[str, int]) -> int:
    """Devices one entry of a PartitionSpec splits a dimension over."""
    if axes is None:
        return 1
    return math.prod(sizes[a] for a in ((axes,) if isinstance(axes, str) else axes))


def split_ways(names: Sequence[str | None], rules, sizes: Mapping[str, int]) -> int:
    """Shards a tensor with these logical axis ``names`` has under ``rules`` on a mesh of these
    axis ``sizes``: its bytes per device are its bytes over this."""
    axes = nn.logical_to_mesh_axes(names, rules)
    assert axes is not None, "names given"
    return math.prod(mesh_size(a, sizes) for a in axes)


def mesh_shape(p: ParallelConfig, num_devices: int, num_experts: int, hidden: int) -> tuple[int, int]:
    """(dp, ep) for ``num_devices``; ConfigError names sizes that would work.

    How an EP group splits into ``expert_x`` x ``expert`` follows from the NVLink domains it
    is placed on (``topology.device_mesh``), not from these sizes.
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


BLUECONNECT = "xla_gpu_all_reduce_blueconnect_num_devices_per_host"


def all_reduce_options(mesh: Mesh) -> dict[str, int]:
    """XLA:GPU options for ``parallel.split_all_reduce``: run each all-reduce over devices in
    several NVLink domains as a reduce-scatter inside the domain, an all-reduce across domains
    on the shard and an all-gather inside the domain (XLA's BlueConnect decomposition), its
    "host" a run of ``expert`` devices (the mesh axis inside one domain). The gradients of
    the weights the model reads whole (the embedding, the dense layers', the loss head's once per
    micro-batch) were otherwise reduced over every device at once: in DeepSeek-V3's 64-rack
    job 4.99 s of each 4-layer step's network transfer went to them (``make compile``),
    0.01 s with this. {} on one domain, off GPUs, or where the ``expert`` axis is no aligned
    run of device ids (XLA groups devices by id: id // run)."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1, mesh.shape[EXPERT])
    run = blueconnect_run(ids, mesh.devices.flat[0].platform)
    return {BLUECONNECT: run} if run else {}


def blueconnect_run(ids, platform: str) -> int:
    """The run length n where ``ids`` (device ids, 2-D: one run a row) holds two or more
    aligned runs (ids k n .. k n + n - 1) of n >= 2 GPUs; else 0."""
    runs, n = ids.shape
    if runs < 2 or n < 2 or platform not in ("gpu", "cuda"):
        return 0
    low, high = ids.min(axis=1), ids.max(axis=1)
    return n if bool(((low % n == 0) & (high - low == n - 1)).all()) else 0


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches [B, S+1] split over every device along B."""
    return NamedSharding(mesh, P(TOKEN_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def micro_batches(batch_BS, n: int, mesh: Mesh):
    """[B, S+1] -> [n, B/n, S+1] (each leaf of a packed batch alike), as the train step and the
    evaluation run a batch. Micro-batch m holds rows m, m+n, m+2n, ...: every device keeps the
    rows it was given (B/devices is a multiple of n), so nothing moves."""
    spec = NamedSharding(mesh, P(None, *batch_sharding(mesh).spec))

    def split(a_BS):
        mb = a_BS.reshape(a_BS.shape[0] // n, n, -1).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(mb, spec)

    return jax.tree.map(split, batch_BS)


def ep_plans(cfg: Config, mesh: Mesh) -> list[jobplan.EPPlan | None]:
    """The expert-parallel plans a run on ``mesh`` may use (the dispatcher ``jobplan.dispatcher``
    picks, one plan per capacity bucket), smallest buffers first; [None] on a single device.
    The stepper runs them, the evaluation and the compile report read them."""
    if mesh.devices.size == 1:
        return [None]
    ep, domains = ep_size(mesh), mesh.shape[EXPERT_X]
    name = jobplan.dispatcher(cfg.moe.dispatcher, mesh.devices.size, ep, domains)
    factors = jobplan.bucket_factors(name, cfg.moe.capacity_buckets)
    return [jobplan.EPPlan(name, ep, f, cfg.moe.overlap_chunks, cfg.moe.dispatch_dtype) for f in factors]


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
    axes = nn.logical_to_mesh_axes(names, rules)
    assert axes is not None, "names given"
    return P(*axes)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A run's mesh and the logical-axis rules chosen for it, built once (``of``)."""

    mesh: Mesh  # axes MESH_AXES; EP groups are consecutive devices (topology.device_mesh)
    rules: tuple  # logical_rules for the model on this mesh's axis sizes

    @classmethod
    def of(cls, mesh: Mesh, cfg: Config | ModelConfig) -> Sharding:
        """For the run's config ``cfg`` on ``mesh`` (``cfg.model`` alone: ``logical_rules``)."""
        return cls(mesh, logical_rules(cfg, dict(mesh.shape)))

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

    def wrap(self, jitted) -> InContext:
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
