"""The permutation benchmark (``python -m moe_train.bench --only permute``, and a section of
``--accel``): its rows at toy sizes, and the row movements it times computing the same rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.bench import permute

T, H, E, K = 64, 16, 8, 2


def _inputs():
    x = jax.random.normal(jax.random.key(0), (T, H))
    ids = jax.lax.top_k(jax.random.normal(jax.random.key(1), (T, E)), K)[1].astype(jnp.int32)
    return x, ids


@pytest.fixture(scope="module")
def quick_rows():
    return permute.run(permute.QUICK, with_goal=True)["rows"]


def test_each_shape_times_plans_permutations_and_row_moves(quick_rows):
    first = {r["what"] for r in quick_rows if r["experts"] == permute.QUICK.shapes[0].experts}
    assert {"dense", "plan counting", "plan argsort", "permutation argsort"} <= first
    assert {"rows: gather from x [T, H]", "rows: sum over K of y [T*K, H], XLA gather"} <= first
    assert "route (router, top-k) fwd+bwd" in first


def test_every_row_has_a_ratio_to_dense(quick_rows):
    assert all(r["ratio"] > 0 for r in quick_rows)


def test_the_unpermute_sum_gives_each_token_its_rows():
    """The rows are the tokens' copies in dispatch order, so each token's sum is K times it."""
    x, ids = _inputs()
    fn, args = permute.row_moves(x, ids, E)["rows: sum over K of y [T*K, H], XLA gather"]
    np.testing.assert_allclose(np.asarray(fn(*args)), K * np.asarray(x), rtol=1e-6)
