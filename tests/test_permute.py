"""moe_train.moe.permute's row gathers: forward and gradient against plain indexing, and a
backward pass that gathers (no scatter into a zero-filled buffer), for adversarial routings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.moe.dispatch import gather_rows, unpack
from moe_train.moe.permute import (
    COUNTING_MAX_EXPERTS,
    count_ids,
    make_dispatch,
    permute,
    readers_of,
    row_values,
    sorted_positions,
    stable_order,
    take_rows,
    unpermute,
)

T, H, E, K = 12, 8, 4, 2
ROUTINGS = {
    "uniform": np.random.default_rng(0).integers(0, E, (T, K)),
    "one-expert": np.zeros((T, K), int) + np.arange(K) % 1,  # every assignment to expert 0
    "empty-experts": np.tile([1, 2], (T, 1)),  # experts 0 and 3 get nothing
}


def _x(rows=T, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, H), np.float32))


def _plain_permute(x, plan):
    return jnp.where(plan.valid_R[:, None], x[plan.token_R], 0)


def _grad(f, x):
    w = _x(f(x).shape[0], seed=2)
    return jax.grad(lambda x: jnp.sum(f(x) * w))(x)


# (tile_rows, row_multiple): sorted rows (R = M: no zero row either way), sorted rows padded
# to 16 (R > M), the tiled layout
LAYOUTS = [(None, 1), (None, 16), (4, 1)]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_permute_and_its_gradient_equal_plain_indexing(routing, layout):
    plan = make_dispatch(jnp.asarray(ROUTINGS[routing], jnp.int32), E, *layout)
    x = _x()
    np.testing.assert_array_equal(permute(x, plan), _plain_permute(x, plan))
    np.testing.assert_allclose(
        _grad(lambda x: permute(x, plan), x),
        _grad(lambda x: _plain_permute(x, plan), x),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unpermute_gradient_equals_plain_indexing(routing, layout):
    plan = make_dispatch(jnp.asarray(ROUTINGS[routing], jnp.int32), E, *layout)
    y = _x(plan.token_R.shape[0])
    np.testing.assert_allclose(
        _grad(lambda y: unpermute(y, plan), y), _grad(lambda y: y[plan.row_M], y), rtol=1e-6, atol=1e-6
    )


def test_send_buffer_and_unpack_gradients_equal_plain_indexing():
    per_row, R = 2, 10  # 12 assignments, 10 slots: two are not sent
    slot_M = jnp.asarray(np.random.default_rng(3).permutation(12), jnp.int32)
    x = _x(6)
    send = lambda x: gather_rows(x, slot_M, per_row, R)  # noqa: E731
    src_R = readers_of(slot_M, R)[:, 0]
    plain = lambda x: jnp.where((src_R < 12)[:, None], x[jnp.minimum(src_R, 11) // per_row], 0)  # noqa: E731
    np.testing.assert_array_equal(send(x), plain(x))
    np.testing.assert_allclose(_grad(send, x), _grad(plain, x), rtol=1e-6, atol=1e-6)
    y = _x(R)
    back = lambda y: jnp.where((slot_M < R)[:, None], y[jnp.minimum(slot_M, R - 1)], 0)  # noqa: E731
    np.testing.assert_array_equal(unpack(y, slot_M), back(y))
    np.testing.assert_allclose(_grad(lambda y: unpack(y, slot_M), y), _grad(back, y), rtol=1e-6, atol=1e-6)


def test_the_backward_pass_gathers_and_never_scatters():
    plan = make_dispatch(jnp.asarray(ROUTINGS["uniform"], jnp.int32), E, 4)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(permute(x, plan))))(_x()))
    assert "gather" in jaxpr and "scatter-add" not in jaxpr


def test_a_row_nobody_reads_gets_no_gradient():
    x = _x(3)
    got = jax.grad(
        lambda x: jnp.sum(
            take_rows(
                x, jnp.asarray([0, 0]), jnp.asarray([True, True]), jnp.asarray([[0, 1], [2, 2], [2, 2]])
            )
        )
    )(x)
    np.testing.assert_array_equal(got[1:], 0)
    np.testing.assert_array_equal(got[0], 2 * jnp.ones(H))


def test_unpadded_sorted_rows_gather_without_appending_a_zero_row():
    plan = make_dispatch(jnp.asarray(ROUTINGS["uniform"], jnp.int32), E)
    loss = lambda x: jnp.sum(unpermute(permute(x, plan), plan))  # noqa: E731
    assert "concatenate" not in str(jax.make_jaxpr(jax.grad(loss))(_x()))


@pytest.mark.parametrize("shape", [(3, 4), (5,), (2, 3, 4)])
def test_zeros_after_are_zeros_of_the_shape_even_from_non_finite_values(shape):
    from moe_train.moe.permute import zeros_after

    after = jnp.array([[jnp.inf, jnp.nan, -2.0, 1.0]] * 3, jnp.bfloat16)
    z = zeros_after(shape, jnp.float32, after)
    assert z.shape == shape and z.dtype == jnp.float32
    assert not jnp.signbit(z).any() and (z == 0).all()


# ----------------------------------------------------------------------------- sorting


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tile_rows", [None, 4])
def test_counting_sort_and_argsort_make_the_same_plan(routing, tile_rows):
    ids = jnp.asarray(ROUTINGS[routing], jnp.int32)
    plans = [make_dispatch(ids, E, tile_rows, method=m) for m in ("counting", "argsort")]
    for a, b in zip(*plans):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", ["counting", "argsort"])
def test_sorted_positions_are_stable_within_an_expert(method):
    ids = np.random.default_rng(3).integers(0, E, (T, K))
    pos_M = sorted_positions(jnp.asarray(ids, jnp.int32), E, method).pos_M
    expected = np.empty(T * K, int)
    expected[np.argsort(ids.ravel(), kind="stable")] = np.arange(T * K)
    np.testing.assert_array_equal(pos_M, expected)


@pytest.mark.parametrize("method", ["counting", "argsort"])
def test_sorted_order_inverts_the_positions(method):
    ids = np.random.default_rng(4).integers(0, E, (T, K))
    pos_M, order_M, _ = sorted_positions(jnp.asarray(ids, jnp.int32), E, method)
    np.testing.assert_array_equal(np.asarray(order_M)[np.asarray(pos_M)], np.arange(T * K))


@pytest.mark.parametrize("tile_rows", [None, 4])
def test_each_rows_slot_is_the_assignment_it_holds(tile_rows):
    plan = make_dispatch(jnp.asarray(ROUTINGS["uniform"], jnp.int32), E, tile_rows, row_multiple=16)
    slot_R, M = np.asarray(plan.slot_R), T * K
    np.testing.assert_array_equal(slot_R[np.asarray(plan.row_M)], np.arange(M))
    assert (slot_R[~np.asarray(plan.valid_R)] == M).all()


def _primitives(num_experts: int) -> str:
    ids = jnp.zeros((4, 1), jnp.int32)
    return str(jax.make_jaxpr(lambda i: sorted_positions(i, num_experts))(ids))


def test_auto_sorts_for_many_experts():
    assert " sort[" in _primitives(COUNTING_MAX_EXPERTS + 1)


def test_auto_counts_for_few_experts_without_a_sort():
    assert " sort[" not in _primitives(COUNTING_MAX_EXPERTS) and "cumsum" in _primitives(E)


def test_an_unknown_sort_method_is_refused():
    with pytest.raises(ValueError, match="unknown sort method"):
        sorted_positions(jnp.zeros((4, K), jnp.int32), E, "bucket")


def test_padded_sorted_rows_hold_no_token():
    plan = make_dispatch(jnp.asarray(ROUTINGS["uniform"], jnp.int32), E, None, row_multiple=16)
    assert plan.token_R.shape == (32,) and not np.asarray(plan.valid_R)[T * K :].any()


@pytest.mark.parametrize("routing", ROUTINGS)
def test_counts_equal_bincount(routing):
    ids = jnp.asarray(ROUTINGS[routing], jnp.int32)
    np.testing.assert_array_equal(count_ids(ids, E), np.bincount(np.ravel(ROUTINGS[routing]), minlength=E))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_row_values_and_their_gradient_equal_plain_indexing(routing, layout):
    """Each row's value by its slot (0 for padding rows); the gradient gathers by each
    assignment's row instead of autodiff's scatter-add by the slots."""
    plan = make_dispatch(jnp.asarray(ROUTINGS[routing], jnp.int32), E, *layout)
    v = jnp.asarray(np.random.default_rng(3).standard_normal(T * K), jnp.float32)
    plain = lambda v: jnp.concatenate([v, jnp.zeros((1,))])[plan.slot_R]  # noqa: E731
    np.testing.assert_array_equal(row_values(v, plan), plain(v))
    g = jnp.asarray(np.random.default_rng(4).standard_normal(plan.slot_R.shape[0]), jnp.float32)
    got = jax.vjp(lambda v: row_values(v, plan), v)[1](g)[0]
    np.testing.assert_array_equal(got, jax.vjp(plain, v)[1](g)[0])


def test_the_row_values_gradient_never_scatters():
    plan = make_dispatch(jnp.asarray(ROUTINGS["uniform"], jnp.int32), E)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(row_values(v, plan))))(jnp.ones(T * K)))
    assert "gather" in jaxpr and "scatter" not in jaxpr


@pytest.mark.parametrize("E, M", [(4, 24), (128, 4096), (2**20, 2**12)])
def test_the_stable_order_is_argsorts(E, M):
    """Packed keys (an id and its position in one int32), and argsort where they do not fit."""
    ids = jnp.asarray(np.random.default_rng(5).integers(0, min(E, 7), M), jnp.int32)
    np.testing.assert_array_equal(stable_order(ids, E), np.argsort(np.asarray(ids), kind="stable"))
