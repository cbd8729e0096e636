"""Row sums by per-row DMAs (``moe_train.moe.dma_rows``, a Pallas TPU kernel; on CPU in
interpret mode) against XLA's gather, alone and where the MoE layer uses them (the unpermute and
the permute's backward), forward and gradients, under adversarial routings."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.base.platform import Platform
from moe_train.moe import dma_rows, layer
from moe_train.moe.dispatch import Arrived
from moe_train.moe.permute import make_dispatch, permute, sum_gathered, sum_rows, unpermute, unpermute_sum

DMA = dma_rows.DmaRows(interpret=jax.default_backend() != "tpu")
TPU = Platform("tpu", "TPU v5 lite")
H, E = 256, 8


def _rows(R, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((R, H)), dtype)


def _ids(case: str, T: int, K: int) -> jnp.ndarray:
    """[T, K] expert ids: random distinct; every token to experts 0..K-1 (the rest empty); only
    the last K experts (the first empty); ties (the same K experts, reversed for odd tokens)."""
    rng = np.random.default_rng(1)
    if case == "random":
        ids = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    elif case == "one-expert":
        ids = np.tile(np.arange(K), (T, 1))
    elif case == "empty-first":
        ids = np.tile(np.arange(E - K, E), (T, 1))
    else:
        ids = np.array([np.arange(K)[:: -1 if t % 2 else 1] + 2 for t in range(T)])
    return jnp.asarray(ids, jnp.int32)


KERNELS = {"one buffer": DMA, "prefetch": dataclasses.replace(DMA, prefetch=True)}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("T, K", [(37, 2), (64, 8), (5, 1), (300, 4)])
def test_the_kernel_sums_the_gathered_rows(T, K, kernel):
    """T not a multiple of the block (padded tokens), repeated indices (a row read twice),
    several blocks (300 tokens: three of 128; the prefetching kernel's hand-over)."""
    src = _rows(3 * T)
    idx = jnp.asarray(np.random.default_rng(2).integers(0, 3 * T, (T, K)), jnp.int32)
    want = sum_gathered(src, idx, jnp.float32)
    got = dma_rows.gather_sum(src, idx, jnp.float32, KERNELS[kernel])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernel_sums_bf16_rows_in_fp32(kernel):
    src, idx = (
        _rows(96, jnp.bfloat16),
        jnp.asarray(np.random.default_rng(3).integers(0, 96, (40, 8)), jnp.int32),
    )
    got = dma_rows.gather_sum(src, idx, jnp.bfloat16, KERNELS[kernel])
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(got, np.float32), np.asarray(sum_gathered(src, idx, jnp.bfloat16), np.float32)
    )


def test_a_hidden_size_off_the_lane_width_is_refused():
    with pytest.raises(ValueError, match="multiple of 128"):
        dma_rows.gather_sum(jnp.zeros((8, 96)), jnp.zeros((4, 2), jnp.int32), jnp.float32, DMA)


def test_the_block_fits_its_vmem_share():
    b = dma_rows.block_tokens(16384, 8, 7168, 2)
    assert b & (b - 1) == 0 and 8 * b * 7168 * 2 <= dma_rows.BLOCK_BYTES


def test_the_block_is_no_larger_than_the_tokens_need():
    assert dma_rows.block_tokens(5, 1, 256, 4) == 8


def test_a_tpu_target_takes_the_kernel():
    assert dma_rows.for_target(TPU, jnp.zeros((4, 2048))) == DMA


@pytest.mark.parametrize("platform, hidden", [(Platform("cpu"), 2048), (TPU, 96)])
def test_elsewhere_xla_gathers(platform, hidden):
    assert dma_rows.for_target(platform, jnp.zeros((4, hidden))) is None


def _unpermute_vjp(plan, K, dma):
    def fn(y):
        return unpermute_sum(y, plan, K, jnp.float32, dma)

    return lambda y, g: jax.vjp(fn, y)[1](g)[0]


@pytest.mark.parametrize("case", ["random", "one-expert", "empty-first", "ties"])
@pytest.mark.parametrize("tiles", [None, 16])
def test_the_unpermute_sum_and_its_gradient_match_xla(case, tiles):
    """Sorted rows padded to a multiple of 16, and the tiled layout (experts' rows start on tile
    boundaries): against the unpermute followed by the per-token sum."""
    T, K = 37, 2
    plan = make_dispatch(_ids(case, T, K), E, tiles, 16)
    y, g = _rows(plan.token_R.shape[0]), _rows(T, seed=4)
    want = sum_rows(unpermute(y, plan), K, jnp.float32)
    np.testing.assert_allclose(unpermute_sum(y, plan, K, jnp.float32, DMA), want, rtol=1e-6, atol=1e-6)
    want_dy = jax.vjp(lambda y: sum_rows(unpermute(y, plan), K, jnp.float32), y)[1](g)[0]
    np.testing.assert_array_equal(_unpermute_vjp(plan, K, DMA)(y, g), want_dy)


@pytest.mark.parametrize("case", ["random", "one-expert", "ties"])
def test_the_permutes_gradient_by_dma_matches_xla(case):
    T, K = 40, 2
    plan = make_dispatch(_ids(case, T, K), E, None, 16)
    x, g = _rows(T), _rows(plan.token_R.shape[0], seed=5)
    dx = jax.vjp(lambda x: permute(x, plan, DMA), x)[1](g)[0]
    want = jax.vjp(lambda x: permute(x, plan), x)[1](g)[0]
    np.testing.assert_allclose(dx, want, rtol=1e-6, atol=1e-6)


@functools.cache
def _expert_steps(platform_name: str):
    """jit of the expert steps (ragged_dot experts; rows by DMA where the target is a TPU)."""
    platform = TPU if platform_name == "tpu" else Platform("cpu")

    def run(x, w0, w1, wo, ids, weights, dy):
        def fn(x, w0, w1, wo):
            arrived = Arrived(x, ids, weights, x.dtype)
            return layer.expert_steps(arrived, layer.Experts(w0, w1, wo, "ragged_dot", None, 1, platform))

        y, vjp = jax.vjp(fn, x, w0, w1, wo)
        return y, vjp(dy)

    return jax.jit(run)


@pytest.mark.parametrize("case", ["random", "one-expert"])
def test_the_layer_on_a_tpu_target_matches_xla_rows(case):
    """The expert steps with the TPU's row DMAs (interpret mode here) against XLA's gathers."""
    T, K, F = 40, 2, 128
    rng = np.random.default_rng(6)
    x, dy = _rows(T), _rows(T, seed=7)
    w0, w1 = (jnp.asarray(rng.standard_normal((E, H, F)) * H**-0.5, jnp.float32) for _ in range(2))
    wo = jnp.asarray(rng.standard_normal((E, F, H)) * F**-0.5, jnp.float32)
    weights = jnp.asarray(rng.random((T, K)), jnp.float32)
    args = (x, w0, w1, wo, _ids(case, T, K), weights, dy)
    with jax.default_matmul_precision("highest"):
        got, want = _expert_steps("tpu")(*args), _expert_steps("cpu")(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _ep_grads(ops, platform: Platform):
    from moe_train.moe import Routing
    from moe_train.parallel import sharding
    from moe_train.parallel.jobplan import EPPlan

    mesh = sharding.make_mesh(jax.devices()[:8], (2, 4, 1))

    def loss(ops):
        y, _ = layer.dropless_moe(
            *ops,
            routing=Routing(2),
            plan=EPPlan("a2a", 4),
            seq_len=16,
            backend="ragged_dot",
            platform=platform,
        )
        return jnp.sum(y * jnp.cos(y)), y

    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(ops)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (a TPU v5e chip is 1)")
def test_expert_parallel_on_a_tpu_target_matches_xla_rows():
    """Under shard_map the rows stay XLA's gathers (the kernel is not verified there): the same
    results as the CPU target's."""
    keys = jax.random.split(jax.random.key(0), 5)
    F = 128
    ops = (
        jax.random.normal(keys[0], (128, H)),
        jax.random.normal(keys[1], (H, E)) * 0.5,
        *(jax.random.normal(k, s) * 0.1 for k, s in zip(keys[2:], [(E, H, F), (E, H, F), (E, F, H)])),
    )
    (_, y), grads = _ep_grads(ops, TPU)
    (_, y_ref), grads_ref = _ep_grads(ops, Platform("cpu"))
    for a, b in zip(jax.tree.leaves((y, grads)), jax.tree.leaves((y_ref, grads_ref))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
