"""Every weight shards at every size: the published models on every cluster preset, 1 to 512
nodes, at every EP the job rules allow (``moe_train.planner.memory.job.setup_for``: EP divides the
devices and the experts, FSDP divides the width, EP groups placeable). The trainer's rules
(``sharding.logical_rules``) resolve the model's abstract parameters (``jax.eval_shape`` of
its init: no devices, no compile) on each job's mesh sizes; the planner's state bytes come
from ``moe_train.planner.memory``."""

import collections
import functools
import math

import flax.linen as nn
import jax
import pytest

from moe_train import config
from moe_train.parallel import sharding
from moe_train.planner.memory import PlanError, job
from moe_train.planner.memory.estimate import state_bytes
from moe_train.train import step as train
from topology import presets

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
# powers of two, odd counts (3, 9, 18: FSDP 3 or 9 divides no width, so no job takes them) and
# multiples of 7 (DeepSeek-V3's width 7168 = 7 x 1024 takes FSDP 7, 14, 28, ...)
NODES = (1, 2, 3, 4, 7, 8, 9, 14, 16, 18, 28, 32, 56, 64, 112, 128, 224, 256, 448, 512)
BIG = 64 * 2**20  # bytes: a tensor this large must not be whole on every device
WHOLE_UP_PROJECTIONS = {"q_b", "kv_b"}  # no axis of theirs takes FSDP 1024 or a factor 7


@functools.cache
def leaves(model: str) -> tuple:
    """(path, shape, bytes per element, logical names) of each parameter of ``model``."""
    boxed = train.boxed_params(config.build(model))
    names = nn.get_partition_spec(boxed)
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(boxed))[0]
    return tuple(
        (jax.tree_util.keystr(path), a.shape, a.dtype.itemsize, tuple(n))
        for (path, a), n in zip(flat, jax.tree.leaves(names, is_leaf=_is_spec))
    )


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def sizes_of(s) -> dict[str, int]:
    return {sharding.DATA: s.dp, sharding.EXPERT_X: s.domains, sharding.EXPERT: s.domain_size}


@functools.cache
def grid() -> tuple:
    """(model, cluster, nodes, ep, config, Setup) of every job the rules take."""
    out = []
    for model in MODELS:
        base = config.build(model)
        E = base.moe.num_experts
        for cluster in map(presets.load, presets.list_presets()):
            for nodes in NODES:
                devices = nodes * cluster.gpus_per_node
                for ep in (d for d in range(1, E + 1) if E % d == 0 and devices % d == 0):
                    # one sequence per device: the batch never refuses a job
                    cfg = job.with_setting(base, "parallel.ep", ep)
                    cfg = job.with_setting(cfg, "train.batch_size", devices)
                    try:
                        out.append((model, cluster.name, nodes, ep, cfg, job.setup_for(cfg, cluster, nodes)))
                    except PlanError:
                        continue
    return tuple(out)


@functools.cache
def resolved(model: str, sizes: tuple) -> tuple:
    """(path, shape, bytes, logical names, mesh axes per dimension) of each parameter of
    ``model`` under the trainer's rules on a mesh of these axis sizes."""
    rules = sharding.logical_rules(config.build(model), dict(sizes))
    return tuple(
        (path, shape, math.prod(shape) * item, names, nn.logical_to_mesh_axes(names, rules))
        for path, shape, item, names in leaves(model)
    )


def per_point():
    """Each job of the grid with its mesh sizes and its resolved parameters."""
    for model, cluster, nodes, ep, _, s in grid():
        sizes = sizes_of(s)
        yield (model, cluster, nodes, ep), s, sizes, resolved(model, tuple(sizes.items()))


def test_the_grid_covers_every_preset_model_and_size():
    points = grid()
    assert {p[0] for p in points} == set(MODELS)
    assert {p[1] for p in points} == set(presets.list_presets())
    assert {1, 7, 512} <= {p[2] for p in points} and len(points) > 1000


def test_the_rules_see_every_weight_the_model_has():
    """``sharding.weights`` (what the rules and the planner count) is the model's parameters."""
    for model in MODELS + ("tiny", "deepseek-v3-tiny"):
        cfg = config.build(model)
        want = collections.Counter()
        for _, shape, _, names in leaves(model):
            n, dims = (shape[0], shape[1:]) if names[0] == "layers" else (1, shape)
            want[tuple(zip([a for a in names if a != "layers"], dims))] += n
        got = collections.Counter()
        for n, axes in sharding.weights(cfg.model, cfg.moe):
            got[axes] += n
        assert got == want, model


def test_every_split_divides_its_dimension():
    for job_, _, sizes, params in per_point():
        for path, shape, _, _, spec in params:
            for dim, axes in zip(shape, spec):
                assert dim % sharding.mesh_size(axes, sizes) == 0, (job_, path)


def whole_large_weights():
    """(job, setup, mesh sizes, path, shape, names) of each weight over 64 MiB that a job of
    more than one device holds whole on every device."""
    for job_, s, sizes, params in per_point():
        for path, shape, size, names, spec in params:
            if size > BIG and s.devices > 1 and _ways(spec, sizes) == 1:
                yield job_, s, sizes, path, shape, names


def test_a_large_weight_is_whole_only_where_no_mesh_axis_divides_it():
    for job_, _, sizes, path, shape, names in whole_large_weights():
        dims = [d for d, name in zip(shape, names) if name != "layers"]
        assert not any(d % k == 0 for d in dims for k in sizes.values() if k > 1), (job_, path)


def test_only_deepseeks_up_projections_stay_whole_at_ep_1():
    """Where the data axis alone is 1024 or a multiple of 7 no dimension of MLA's q_b and kv_b
    [latent, heads, head dim] takes it: the mesh would need that axis split in two."""
    whole = {
        (job_[0], job_[3], s.dp, path.split("'")[-2]) for job_, s, _, path, _, _ in whole_large_weights()
    }
    assert {(model, ep, name) for model, ep, _, name in whole} == {
        ("deepseek-v3", 1, name) for name in WHOLE_UP_PROJECTIONS
    }
    assert all(dp == 1024 or dp % 7 == 0 for _, _, dp, _ in whole)


def rises() -> list:
    """((model, cluster, ep), (nodes, dp) before, (nodes, dp) after) of each job whose
    parameters, gradients and optimizer state per GPU exceed those of the next smaller job of
    the same model, cluster and EP."""
    series = collections.defaultdict(list)
    for model, cluster, nodes, ep, cfg, s in grid():
        b = state_bytes(cfg, s)
        series[model, cluster, ep].append((nodes, s.dp, b["params"] + b["grads"] + b["optimizer"]))
    return [
        (key, a[:2], b[:2])
        for key, points in series.items()
        for a, b in zip(sorted(points), sorted(points)[1:])
        if b[2] > a[2]
    ]


def test_state_per_gpu_never_rises_with_nodes_at_the_same_ep():
    """Except onto a data axis of 7 x 2^k devices (DeepSeek-V3's width takes FSDP 7, 14, ...;
    nothing else of the model has a factor 7): q_b and kv_b then split over the EP axes only,
    so at EP 16 or less their bytes outgrow what the extra devices save elsewhere. Among the
    power-of-two FSDP sizes, and among the 7 x 2^k ones, the state never rises."""
    for (model, _, ep), (_, dp_before), (_, dp_after) in rises():
        assert (model, dp_before % 7 > 0, dp_after % 7) == ("deepseek-v3", True, 0)
        assert ep <= 16


@pytest.mark.parametrize(
    "model,cluster,nodes,ep",
    [
        ("deepseek-v3", "h100-dgx", 128, 64),  # the latents take data, the heads EP
        ("deepseek-v3", "h100-dgx", 256, 64),  # the width takes part of the mesh, the rest heads, ...
        ("deepseek-v3", "gb200-nvl72", 7, 1),  # FSDP 28: q_b and kv_b whole
        ("qwen3-30b-a3b", "b200-hgx", 512, 32),  # width 2048 on 4096 GPUs
        ("mixtral-8x7b", "cpu-local", 1, 2),
    ],
)
def test_planner_params_are_the_rules_bytes(model, cluster, nodes, ep):
    ((cfg, s),) = [(p[4], p[5]) for p in grid() if p[:4] == (model, cluster, nodes, ep)]
    sizes = sizes_of(s)
    params = resolved(model, tuple(sizes.items()))
    assert state_bytes(cfg, s)["params"] == sum(size // _ways(spec, sizes) for _, _, size, _, spec in params)


def _ways(spec, sizes) -> int:
    return math.prod(sharding.mesh_size(a, sizes) for a in spec)
