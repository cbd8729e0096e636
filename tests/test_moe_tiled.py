"""The tiled grouped-GEMM kernel: block split, hand-written VJP, buffer-size independence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.moe.gemm import grouped_swiglu
from moe_train.moe.permute import make_dispatch, permute, row_values
from moe_train.moe.tiled import (
    block_sizes,
    default_block_rows,
    executed_rows,
    expert_operands,
    expert_spans,
    for_blocks,
    for_experts,
    tiled_swiglu,
)

T, H, E, F, K = 24, 16, 8, 12, 2


def _normal(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def test_block_sizes_and_default_block_rows():
    assert block_sizes(8, 256) == (256, 64, 16, 8)
    assert block_sizes(3, 20) == (12, 3)
    assert block_sizes(8, 5) == (8,)  # never below one tile
    assert default_block_rows(32, "cpu") == 256 and default_block_rows(2, "cpu") == 32
    assert default_block_rows(128, "gpu") == 512
    for m in (1, 2, 3, 8, 32, 128):
        sizes = block_sizes(m, default_block_rows(m, "cpu"))
        assert sizes[-1] == m and len(sizes) <= 3
        assert all(a % b == 0 for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("tile_rows, block_rows", [(1, 1), (1, 16), (3, 12), (4, 64)])
def test_for_blocks_covers_each_span_row_once(tile_rows, block_rows):
    """Every row of every expert's padded span is in exactly one block; nothing else is."""
    sizes_E = np.array([0, 5, 17, 0, 64, 1, 33, 2])
    sizes = block_sizes(tile_rows, block_rows)
    start, padded = (np.asarray(a) for a in expert_spans(jnp.asarray(sizes_E), tile_rows))
    R = int(padded.sum()) + 2 * tile_rows  # trailing rows

    @jax.jit
    def cover(sizes_E):
        def expert(e, first, rows, hits):
            def block(offset, size, hits):
                return jax.lax.dynamic_update_slice_in_dim(
                    hits, jax.lax.dynamic_slice_in_dim(hits, offset, size) + 1, offset, 0
                )

            return for_blocks(first, rows, sizes, block, hits)

        return for_experts(sizes_E, tile_rows, expert, jnp.zeros((R,), jnp.int32))

    hits = np.asarray(cover(jnp.asarray(sizes_E)))
    expected = np.zeros(R, np.int32)
    for s, p in zip(start, padded):
        expected[s : s + p] = 1
    np.testing.assert_array_equal(hits, expected)
    assert int(executed_rows(sizes_E, tile_rows)) == padded.sum() <= sizes_E.sum() + 8 * (tile_rows - 1)


def _tiled_case(experts_TK, tile_rows, block_rows, num_experts=E, seed=0, scaled=False):
    """Tiled output and grads of <y_N, dy> next to autodiff of the per-row formula; ``scaled``:
    each assignment's activation scaled by its own factor (the combine weights; some 0), whose
    gradient is compared too."""
    x = _normal(T, H, seed=seed)
    w0, w1, wo = _normal(E, H, F, seed=1), _normal(E, H, F, seed=2), _normal(E, F, H, seed=3)
    dy = _normal(T * K, H, seed=4)
    s_M = jnp.where(jnp.arange(T * K) % 5 == 0, 0.0, jnp.abs(_normal(T * K, seed=5)))

    def tiled(x, w0, w1, wo, s_M):
        plan = make_dispatch(experts_TK, num_experts, tile_rows)
        x_RH = permute(x, plan)
        s_R = row_values(s_M, plan) if scaled else None
        y_RH = grouped_swiglu(x_RH, plan, w0, w1, wo, "tiled", block_rows=block_rows, scale_R=s_R)
        return jnp.vdot(y_RH[plan.row_M], dy), y_RH[plan.row_M]

    def per_row(x, w0, w1, wo, s_M):
        x_MH, e_M = jnp.repeat(x, K, axis=0), experts_TK.reshape(-1)
        h = jax.nn.silu(jnp.einsum("nh,nhf->nf", x_MH, w0[e_M])) * jnp.einsum("nh,nhf->nf", x_MH, w1[e_M])
        y = jnp.einsum("nf,nfh->nh", h * (s_M[:, None] if scaled else 1.0), wo[e_M])
        return jnp.vdot(y, dy), y

    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))
    return grad(tiled)(x, w0, w1, wo, s_M), grad(per_row)(x, w0, w1, wo, s_M)


ADVERSARIAL_IDS = {
    "all-to-one": lambda rng: np.tile([5, 2], (T, 1)),
    "empty-experts": lambda rng: np.stack([rng.permutation(3)[:K] for _ in range(T)]),
    "every-token-tied": lambda rng: np.tile([0, 1], (T, 1)),
    "random": lambda rng: np.stack([rng.permutation(E)[:K] for _ in range(T)]),
}


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("tile_rows, block_rows", [(1, 2), (2, 8), (3, 6), (4, 256)])
@pytest.mark.parametrize("case", ADVERSARIAL_IDS)
def test_tiled_vjp_matches_autodiff_of_per_row_formula(case, tile_rows, block_rows, scaled):
    ids = jnp.asarray(ADVERSARIAL_IDS[case](np.random.default_rng(0)), jnp.int32)
    (grads, y), (grads_ref, y_ref) = _tiled_case(ids, tile_rows, block_rows, scaled=scaled)
    np.testing.assert_allclose(y, y_ref, atol=1e-4, rtol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        scale = float(jnp.abs(g_ref).max()) or 1.0
        np.testing.assert_allclose(g / scale, g_ref / scale, atol=1e-5)


@pytest.mark.parametrize("tile_rows, block_rows", [(1, 2), (4, 256)])
@pytest.mark.parametrize("case", ADVERSARIAL_IDS)
def test_two_walks_give_one_walks_gradients_bitwise(case, tile_rows, block_rows):
    """The backward's row walk then weight walk (the GPU default) against one walk."""
    ids = jnp.asarray(ADVERSARIAL_IDS[case](np.random.default_rng(0)), jnp.int32)
    plan = make_dispatch(ids, E, tile_rows)
    x_RH = permute(_normal(T, H), plan)
    s_R = row_values(jnp.abs(_normal(T * K, seed=5)), plan)
    w = (_normal(E, H, F, seed=1), _normal(E, H, F, seed=2), _normal(E, F, H, seed=3))
    dy_RH = _normal(*x_RH.shape, seed=4)

    def grads(two_walks):
        def loss(x_RH, w0, w1, wo, s_R):
            ops = expert_operands(x_RH, w0, w1, wo, plan.group_sizes_E, s_R)
            y = tiled_swiglu(ops, tile_rows=tile_rows, block_rows=block_rows, two_walks=two_walks)
            return jnp.vdot(y, dy_RH)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x_RH, *w, s_R)

    for one, two in zip(grads(False), grads(True), strict=True):
        np.testing.assert_array_equal(one, two)


def test_tiled_skips_groups_beyond_its_experts_and_trailing_rows():
    """EP passes E'+1 groups and E' experts' weights: the last group's rows and trailing
    rows give y = 0 and dx = 0 (the expert steps give them zero combine weight)."""
    ids = jnp.asarray(np.random.default_rng(1).integers(0, E + 1, (T, K)), jnp.int32)
    plan = make_dispatch(ids, E + 1, 4)
    plan = plan._replace(group_sizes_E=plan.group_sizes_E[:E])
    x_RH = permute(_normal(T, H), plan)
    w = _normal(E, H, F, seed=1), _normal(E, H, F, seed=2), _normal(E, F, H, seed=3)
    loss = lambda x: jnp.sum(grouped_swiglu(x, plan, *w, "tiled") ** 2)
    y, dx = jax.jit(lambda x: (grouped_swiglu(x, plan, *w, "tiled"), jax.grad(loss)(x)))(x_RH)
    owned = np.zeros(x_RH.shape[0], bool)
    start, padded = expert_spans(plan.group_sizes_E, 4)
    for s, p in zip(np.asarray(start), np.asarray(padded)):
        owned[s : s + p] = True
    assert (~owned).sum() > 0 and np.asarray(ids == E).any()
    np.testing.assert_array_equal(np.asarray(y)[~owned], 0.0)
    np.testing.assert_array_equal(np.asarray(dx)[~owned], 0.0)


def test_tiled_rows_do_not_depend_on_buffer_size():
    """The same routed rows in a longer buffer (an EP capacity bucket) give bitwise the same
    outputs and gradients: the blocks depend on the tile rows only."""
    ids = jnp.asarray(ADVERSARIAL_IDS["random"](np.random.default_rng(2)), jnp.int32)
    plan = make_dispatch(ids, E, 4)
    w = _normal(E, H, F, seed=1), _normal(E, H, F, seed=2), _normal(E, F, H, seed=3)

    def run(extra_tiles):
        pad = lambda a, n, v: jnp.concatenate([a, jnp.full((n, *a.shape[1:]), v, a.dtype)])
        p = plan._replace(tile_expert_P=pad(plan.tile_expert_P, extra_tiles, E - 1))
        x_RH = pad(permute(_normal(T, H), plan), extra_tiles * 4, 0)
        f = lambda x, *w: jnp.sum(jnp.sin(grouped_swiglu(x, p, *w, backend="tiled")[plan.row_M]))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x_RH, *w)

    (v1, g1), (v2, g2) = run(0), run(40)
    assert float(v1) == float(v2)
    np.testing.assert_array_equal(g1[0], g2[0][: g1[0].shape[0]])
    for a, b in zip(g1[1:], g2[1:]):
        np.testing.assert_array_equal(a, b)


def test_tiled_compiles_once_across_routings():
    traces = []

    @jax.jit
    def run(ids, x, w0, w1, wo):
        traces.append(1)
        plan = make_dispatch(ids, E, 2)
        return grouped_swiglu(permute(x, plan), plan, w0, w1, wo, "tiled")

    args = (_normal(T, H), _normal(E, H, F, seed=1), _normal(E, H, F, seed=2), _normal(E, F, H, seed=3))
    for case in ADVERSARIAL_IDS:
        run(jnp.asarray(ADVERSARIAL_IDS[case](np.random.default_rng(0)), jnp.int32), *args)
    assert len(traces) == 1
