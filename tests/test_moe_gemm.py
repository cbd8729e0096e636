"""Dispatch plans, grouped-GEMM backends and backend selection."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.moe import (
    BACKENDS,
    BackendUnavailable,
    Routing,
    default_tile_rows,
    dropless_moe,
    resolve_backend,
    tiled_padding,
)
from moe_train.moe.gemm import _te_import_error, grouped_swiglu
from moe_train.moe.permute import make_dispatch, permute, unpermute
from moe_train.moe.swiglu import _swiglu_product_fwd, swiglu_product

T, H, E, F, K = 24, 16, 8, 12, 2
on_gpu = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not on_gpu, reason="needs an NVIDIA GPU")


def _normal(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _experts(case, seed=0):
    """[T, K] expert ids: random distinct pairs, all on two experts, or experts 0..2 only."""
    rng = np.random.default_rng(seed)
    if case == "random":
        ids = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    elif case == "one-expert":
        ids = np.tile([3, 6], (T, 1))
    else:  # "empty-experts"
        ids = np.stack([rng.permutation(3)[:K] for _ in range(T)])
    return jnp.asarray(ids, jnp.int32)


@functools.cache
def _plan(case, tile_rows):
    plan = jax.jit(make_dispatch, static_argnums=(1, 2))(_experts(case), E, tile_rows)
    return jax.tree.map(np.asarray, plan)


# ----------------------------------------------------------------------------- padding


@pytest.mark.parametrize(
    "n, e, m, expected",
    [
        (48, 8, 4, (19, 76)),
        (48, 8, 1, (55, 55)),
        (48, 8, 64, (8, 512)),
        (8, 8, 2, (11, 22)),
    ],
)
def test_tiled_padding_formula(n, e, m, expected):
    assert tiled_padding(n, e, m) == expected


@pytest.mark.parametrize("m", [1, 2, 3, 7, 16])
def test_tile_bound_holds_for_any_routing(m):
    rng = np.random.default_rng(m)
    n, e = 50, 6
    tiles, _ = tiled_padding(n, e, m)
    worst = 0
    for _ in range(500):
        sizes = rng.multinomial(n, rng.dirichlet(np.full(e, rng.uniform(0.05, 5))))
        worst = max(worst, int(np.sum(-(-sizes // m))))
    assert worst <= tiles


def test_tile_bound_is_reached():
    # N=20, E=4, m=8, loads [17, 1, 1, 1]: 3 + 1 + 1 + 1 tiles = cdiv(20, 8) + 4 - 1.
    sizes = np.array([17, 1, 1, 1])
    assert np.sum(-(-sizes // 8)) == tiled_padding(20, 4, 8)[0] == 6


# ----------------------------------------------------------------------------- plans


@pytest.mark.parametrize("tile_rows", [None, 1, 3, 64])
@pytest.mark.parametrize("case", ["random", "one-expert", "empty-experts"])
def test_plan_rows_hold_their_tokens(case, tile_rows):
    plan = _plan(case, tile_rows)
    n = np.arange(T * K)
    np.testing.assert_array_equal(plan.token_R[plan.row_M], n // K)
    assert plan.valid_R[plan.row_M].all() and plan.valid_R.sum() == T * K
    assert len(set(plan.row_M.tolist())) == T * K


@pytest.mark.parametrize("tile_rows", [None, 1, 3, 64])
@pytest.mark.parametrize("case", ["random", "one-expert", "empty-experts"])
def test_plan_sorts_by_expert_then_token(case, tile_rows):
    plan = _plan(case, tile_rows)
    experts_M = np.asarray(_experts(case)).ravel()
    order = np.argsort(plan.row_M)  # assignments in row order
    assert np.all(np.diff(experts_M[order]) >= 0)
    for e in range(E):
        rows = np.sort(plan.row_M[experts_M == e])
        assert np.all(np.diff(plan.token_R[rows]) > 0)  # token order within an expert


@pytest.mark.parametrize("case", ["random", "one-expert", "empty-experts"])
def test_plan_group_sizes(case):
    plan = _plan(case, 3)
    counts = np.bincount(np.asarray(_experts(case)).ravel(), minlength=E)
    np.testing.assert_array_equal(plan.group_sizes_E, counts)
    assert plan.group_sizes_E.sum() == T * K


@pytest.mark.parametrize("tile_rows", [1, 3, 64])
@pytest.mark.parametrize("case", ["random", "one-expert", "empty-experts"])
def test_tiles_hold_one_expert_each(case, tile_rows):
    plan = _plan(case, tile_rows)
    experts_M = np.asarray(_experts(case)).ravel()
    assert plan.tile_expert_P.shape == (tiled_padding(T * K, E, tile_rows)[0],)
    np.testing.assert_array_equal(plan.tile_expert_P[plan.row_M // tile_rows], experts_M)
    assert np.all(np.diff(plan.tile_expert_P) >= 0)
    assert plan.tile_expert_P.min() >= 0 and plan.tile_expert_P.max() <= E - 1


@pytest.mark.parametrize("tile_rows", [None, 4])
def test_permute_identity_unpermute_round_trip(tile_rows):
    x = _normal(T, H)
    weights = jnp.abs(_normal(T, K, seed=1))

    @jax.jit
    def round_trip(x, experts, weights):
        plan = make_dispatch(experts, E, tile_rows)
        x_RH = permute(x, plan)
        return unpermute(x_RH, plan, weights), x_RH, plan.valid_R

    y, x_RH, valid = round_trip(x, _experts("random"), weights)
    np.testing.assert_allclose(y, x * weights.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(x_RH)[~np.asarray(valid)], 0.0)


# ----------------------------------------------------------------------------- backends


@functools.cache
def _expert_outputs(case):
    """Tiled (m=3) and ragged_dot outputs next to a per-row einsum, in assignment order."""
    x = _normal(T, H)
    w0, w1, wo = _normal(E, H, F, seed=1), _normal(E, H, F, seed=2), _normal(E, F, H, seed=3)

    @jax.jit
    def run(x, experts):
        out = {}
        for backend, tile_rows in (("tiled", 3), ("ragged_dot", None)):
            plan = make_dispatch(experts, E, tile_rows)
            y_RH = grouped_swiglu(permute(x, plan), plan, w0, w1, wo, backend)
            out[backend] = y_RH[plan.row_M]
        x_MH = jnp.repeat(x, K, axis=0)
        e_M = experts.reshape(-1)
        h = jax.nn.silu(jnp.einsum("nh,nhf->nf", x_MH, w0[e_M])) * jnp.einsum("nh,nhf->nf", x_MH, w1[e_M])
        out["per-row"] = jnp.einsum("nf,nfh->nh", h, wo[e_M])
        return out

    return run(x, _experts(case))


@pytest.mark.parametrize("backend", ["tiled", "ragged_dot"])
@pytest.mark.parametrize("case", ["random", "one-expert", "empty-experts"])
def test_grouped_swiglu_matches_per_row_formula(case, backend):
    out = _expert_outputs(case)
    np.testing.assert_allclose(out[backend], out["per-row"], atol=1e-5, rtol=1e-5)


def _product_inputs(dtype, m=37, f=24):
    a0, a1 = (_normal(m, f, seed=s).astype(dtype) * 3 for s in (4, 5))
    return a0, a1, jnp.abs(_normal(m, seed=6))


def _autodiff_product(a0, a1, scale):
    h = jax.nn.silu(a0.astype(jnp.float32)) * a1.astype(jnp.float32)
    return h if scale is None else h * scale[:, None]


@pytest.mark.parametrize("scaled", [False, True])
def test_swiglu_product_matches_autodiff_of_its_fp32_formula(scaled):
    a0, a1, scale = _product_inputs(jnp.float32)
    scale = scale if scaled else None
    dh = _normal(*a0.shape, seed=7)
    out, vjp = jax.vjp(swiglu_product, a0, a1, scale)
    want, want_vjp = jax.vjp(_autodiff_product, a0, a1, scale)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    got, ref = vjp(dh), want_vjp(dh)
    assert (got[2] is None) == (ref[2] is None)
    for g, r in zip(got, ref, strict=True):
        if r is not None:
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_swiglu_product_returns_and_keeps_the_compute_dtype():
    a0, a1, scale = _product_inputs(jnp.bfloat16)
    out, kept = _swiglu_product_fwd(a0, a1, scale)
    assert out.dtype == jnp.bfloat16
    assert [r.dtype for r in kept if r.shape == a0.shape] == [jnp.bfloat16, jnp.bfloat16]


def test_swiglu_product_gradients_have_their_operands_dtypes():
    a0, a1, scale = _product_inputs(jnp.bfloat16)
    grads = jax.grad(lambda *a: jnp.sum(swiglu_product(*a).astype(jnp.float32)), argnums=(0, 1, 2))(
        a0, a1, scale
    )
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]


@pytest.mark.parametrize("case", ["random", "one-expert", "empty-experts"])
def test_ragged_dot_gradients_match_the_per_row_formula(case):
    x = _normal(T, H)
    w0, w1, wo = _normal(E, H, F, seed=1), _normal(E, H, F, seed=2), _normal(E, F, H, seed=3)
    experts = _experts(case)
    e_M = experts.reshape(-1)
    scale_M = jnp.abs(_normal(T * K, seed=8))

    def grouped(x, w0, w1, wo, scale_M):
        plan = make_dispatch(experts, E, None)
        y_RH = grouped_swiglu(permute(x, plan), plan, w0, w1, wo, "ragged_dot", scale_R=scale_M[plan.slot_R])
        return jnp.sum(jnp.sin(y_RH[plan.row_M]))

    def per_row(x, w0, w1, wo, scale_M):
        x_MH = jnp.repeat(x, K, axis=0)
        h = jax.nn.silu(jnp.einsum("nh,nhf->nf", x_MH, w0[e_M])) * jnp.einsum("nh,nhf->nf", x_MH, w1[e_M])
        return jnp.sum(jnp.sin(jnp.einsum("nf,nfh->nh", h * scale_M[:, None], wo[e_M])))

    args = (x, w0, w1, wo, scale_M)
    got = jax.grad(grouped, argnums=range(5))(*args)
    want = jax.grad(per_row, argnums=range(5))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- selection


def test_unknown_backend_lists_choices():
    with pytest.raises(ValueError, match="choose one of") as err:
        resolve_backend("cutlass")
    assert all(name in str(err.value) for name in BACKENDS)


def test_dropless_moe_rejects_unknown_backend():
    x = _normal(T, H)
    with pytest.raises(ValueError, match="unknown MoE backend"):
        dropless_moe(
            x,
            _normal(H, E),
            _normal(E, H, F),
            _normal(E, H, F),
            _normal(E, F, H),
            Routing(K),
            backend="dense",
        )


@pytest.mark.skipif(on_gpu, reason="CPU behaviour")
def test_auto_is_tiled_on_cpu():
    assert resolve_backend("auto", jnp.float32) == "tiled"
    assert resolve_backend("auto", jnp.bfloat16) == "tiled"


@pytest.mark.skipif(on_gpu, reason="CPU behaviour")
@pytest.mark.parametrize("name", ["mgpu", "te"])
def test_gpu_backends_unavailable_on_cpu(name):
    assert issubclass(BackendUnavailable, RuntimeError)
    with pytest.raises(BackendUnavailable, match="GPU") as err:
        resolve_backend(name, jnp.bfloat16)
    assert name in str(err.value)
    assert "'tiled'" in str(err.value) and "'ragged_dot'" in str(err.value)


def test_te_import_failure_gives_install_hint():
    reason = _te_import_error()
    if reason is None:
        pytest.skip("transformer_engine.jax is installed")
    assert "pip install" in reason and "transformer_engine" in reason


@pytest.mark.parametrize(
    "n, e, platform, expected",
    [
        (1024, 8, "cpu", 8),
        (16384, 32, "cpu", 32),
        (4096, 32, "cpu", 8),
        (65536, 8, "cpu", 32),
        (48, 8, "cpu", 1),
        (4, 8, "cpu", 1),
        (65536, 8, "gpu", 128),
        (1024, 8, "gpu", 8),
    ],
)
def test_default_tile_rows(n, e, platform, expected):
    assert default_tile_rows(n, e, platform) == expected


@pytest.mark.parametrize("n, e", [(1024, 8), (16384, 32), (4096, 128), (100, 3), (7, 7)])
def test_default_tile_rows_bounds_padding_waste(n, e):
    m = default_tile_rows(n, e, "cpu")
    assert m == 1 or e * (m - 1) <= 0.1 * n  # executed rows <= N + E*(m-1) <= 1.1 N
    assert m & (m - 1) == 0


def test_mgpu_vjp_traces_on_cpu(monkeypatch):
    """The Mosaic-GPU kernels' Python-level checks and our VJP shapes, without a GPU."""
    from moe_train.moe.gemm import sorted_swiglu
    from moe_train.moe.tiled import expert_operands

    # transposed_ragged_dot reads the SM count from the device; fake a Hopper one.
    monkeypatch.setattr(jax, "devices", lambda *a: [type("Gpu", (), {"core_count": 132})()])
    n, h, f = 200, 128, 192
    x = jnp.ones((n, h), jnp.bfloat16)
    w_ehf, w_efh = jnp.ones((E, h, f), jnp.bfloat16), jnp.ones((E, f, h), jnp.bfloat16)
    group_sizes = jnp.full((E,), n // E, jnp.int32)

    def loss(x, w0, w1, wo):
        y = sorted_swiglu(expert_operands(x, w0, w1, wo, group_sizes, with_scale=False), "mgpu")
        return jnp.sum(y.astype(jnp.float32))

    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, w_ehf, w_ehf, w_efh)
    assert [(o.shape, o.dtype) for o in traced.out_info] == [
        (a.shape, a.dtype) for a in (x, w_ehf, w_ehf, w_efh)
    ]
    assert "wgmma" in str(traced.jaxpr)  # the Hopper kernels, not an XLA fallback


# ----------------------------------------------------------------------------- GPU


def _gpu_case():
    """bf16 layer inputs sized for the Mosaic-GPU kernels (H, F multiples of 64)."""
    t, h, e, f = 512, 128, 8, 256
    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal(s, dtype=np.float32) for s in [(t, h), (h, e), (e, h, f), (e, h, f), (e, f, h)]
    ]
    arrays[2:] = [a * a.shape[1] ** -0.5 for a in arrays[2:]]
    x, *weights = (jnp.asarray(a) for a in arrays)
    return (x.astype(jnp.bfloat16), *weights)


def _layer_and_grads(backend, params):
    def loss(*args):
        y, _ = dropless_moe(*args, routing=Routing(2), backend=backend)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    grads, y = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*params)
    return y, grads


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("backend", ["mgpu", "te", "ragged_dot"])
def test_gpu_backend_matches_tiled_bf16(backend):
    try:
        resolve_backend(backend, jnp.bfloat16, hidden=128, ffn=256)
    except BackendUnavailable as err:
        pytest.skip(str(err))
    params = _gpu_case()
    y, grads = _layer_and_grads(backend, params)
    y_ref, grads_ref = _layer_and_grads("tiled", params)
    np.testing.assert_allclose(y.astype(jnp.float32), y_ref.astype(jnp.float32), atol=3e-2, rtol=3e-2)
    for g, g_ref in zip(grads, grads_ref):
        scale = float(jnp.abs(g_ref.astype(jnp.float32)).max())
        np.testing.assert_allclose(
            g.astype(jnp.float32) / scale, g_ref.astype(jnp.float32) / scale, atol=3e-2
        )


@pytest.mark.gpu
@gpu_only
def test_auto_on_gpu_never_picks_the_dense_ragged_dot():
    # XLA:GPU runs ragged_dot as a dense dot over every expert (jax 0.11.2, H200)
    assert resolve_backend("auto", jnp.bfloat16, hidden=128, ffn=256) in ("te", "mgpu", "tiled")
    assert resolve_backend("auto", jnp.float32, hidden=128, ffn=256) == "tiled"
