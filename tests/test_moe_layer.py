"""dropless_moe: every CPU backend against the dense per-expert reference, plus layer properties."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.moe import Routing, capacity_moe, dense_reference_moe, dropless_moe, swiglu_mlp
from moe_train.moe.router import route, route_tokens, router_logits, router_stats

T, H, E, F, K = 24, 16, 8, 12, 2


def _moe_params(T=T, H=H, E=E, F=F, *, seed=0, dtype=jnp.float32):
    """Random (x_TH, gate_HE, wi_0_EHF, wi_1_EHF, wo_EFH); numpy RNG, so nothing compiles."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    x = jnp.asarray(normal(T, H)).astype(dtype)
    return (
        x,
        jnp.asarray(normal(H, E)),
        jnp.asarray(normal(E, H, F) * H**-0.5),
        jnp.asarray(normal(E, H, F) * H**-0.5),
        jnp.asarray(normal(E, F, H) * F**-0.5),
    )


# name -> (backend, tile_rows): tile sizes 1, 4 and one larger than N = T*K.
BACKEND_CASES = {
    "tiled-1": ("tiled", 1),
    "tiled-4": ("tiled", 4),
    "tiled-64": ("tiled", 64),
    "ragged_dot": ("ragged_dot", None),
}
_BIAS_E = np.array([0.0, 0.3, -0.2, 0.0, 0.5, 0.0, -0.4, 0.1], np.float32)
ROUTER_CASES = {
    "softmax": dict(score_function="softmax"),
    "softmax-unnormalised": dict(score_function="softmax", normalize_top_k=False),
    "softmax-groups": dict(score_function="softmax", num_groups=4, group_top_k=2),
    "sigmoid": dict(score_function="sigmoid"),
    "sigmoid-groups": dict(score_function="sigmoid", num_groups=4, group_top_k=2, routed_scaling=2.5),
    "softmax-bias-scaled": dict(score_function="softmax", routed_scaling=1.7, expert_bias=_BIAS_E),
    "sigmoid-bias": dict(score_function="sigmoid", expert_bias=_BIAS_E),
}
ADVERSARIAL = ("one-expert-gate", "one-expert-bias", "empty-experts", "all-tied")
ARG_NAMES = ("x", "gate", "wi_0", "wi_1", "wo")
GRAD_TOL = {"x": 5e-5, "gate": 5e-4, "wi_0": 5e-5, "wi_1": 5e-5, "wo": 5e-5}


def _adversarial_params(case):
    """Parameters and router kwargs for skewed or tied routing."""
    x, gate, wi_0, wi_1, wo = (np.array(a) for a in _moe_params(seed=3))
    kwargs = {}
    if case == "one-expert-gate":  # a huge gate column: every token's first choice is 5
        x[:, 0] = np.abs(x[:, 0]) + 1.0
        gate[:, 5] = 0.0
        gate[0, 5] = 1e3
    elif case == "one-expert-bias":  # the bias makes experts 2 and 6 win everywhere
        kwargs["expert_bias"] = np.zeros(E, np.float32)
        kwargs["expert_bias"][[2, 6]] = [100.0, 50.0]
    elif case == "empty-experts":  # only experts 0..2 are ever chosen
        kwargs["expert_bias"] = np.array([5.0] * 3 + [-5.0] * (E - 3), np.float32)
    elif case == "all-tied":  # zero gate: every logit equal, lowest indices win
        gate[:] = 0.0
    return tuple(jnp.asarray(a) for a in (x, gate, wi_0, wi_1, wo)), kwargs


ROUTING_FIELDS = {f.name for f in dataclasses.fields(Routing)}


def _routed(top_k, kwargs):
    """(Routing, the other keywords) from one dict of layer keywords."""
    routing = Routing(top_k, **{k: v for k, v in kwargs.items() if k in ROUTING_FIELDS})
    return routing, {k: v for k, v in kwargs.items() if k not in ROUTING_FIELDS}


def _jit(fn, top_k=K, **kwargs):
    """jax.jit of fn routed with top_k and the router case ``kwargs``, other keywords fixed."""
    routing, rest = _routed(top_k, kwargs)
    return jax.jit(lambda *args: fn(*args, routing, **rest))


def _cotangent(shape):
    return jnp.asarray(np.random.default_rng(42).standard_normal(shape, dtype=np.float32))


def _case_inputs(case):
    """(params, router kwargs) for a router case name or an adversarial case name."""
    if case in ROUTER_CASES:
        return _moe_params(), dict(ROUTER_CASES[case])
    return _adversarial_params(case)


@functools.cache
def _results(backend_case):
    """{case: (y, stats, grads)} for every router and adversarial case, one jit per backend.

    backend_case None is the dense reference. Grouping all cases into one program keeps the
    number of compilations (the dominant test cost on CPU) at one per backend.
    """
    if backend_case is None:
        fn = dense_reference_moe
    else:
        backend, tile_rows = BACKEND_CASES[backend_case]
        fn = functools.partial(dropless_moe, backend=backend, tile_rows=tile_rows)
    cases = (*ROUTER_CASES, *ADVERSARIAL)
    inputs = {case: _case_inputs(case) for case in cases}
    dy = _cotangent((T, H))

    def run_all(all_params):
        out = {}
        for case in cases:
            kwargs = inputs[case][1]

            def loss(*args, kwargs=kwargs):
                routing, rest = _routed(K, kwargs)
                y, stats = fn(*args, routing=routing, **rest)
                return jnp.sum(y * dy), (y, stats)

            grads, (y, stats) = jax.grad(loss, argnums=tuple(range(5)), has_aux=True)(*all_params[case])
            out[case] = (y, stats, dict(zip(ARG_NAMES, grads)))
        return out

    return jax.jit(run_all)({case: inputs[case][0] for case in cases})


def _run(backend_case, case):
    return _results(backend_case)[case]


def _and_reference(backend_case, case):
    """``_run`` of ``case`` on the backend, and on the dense reference."""
    return _run(backend_case, case), _run(None, case)


@pytest.mark.parametrize("router_case", ROUTER_CASES)
@pytest.mark.parametrize("backend_case", BACKEND_CASES)
def test_forward_matches_reference(backend_case, router_case):
    (y, _, _), (y_ref, _, _) = _and_reference(backend_case, router_case)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arg", ARG_NAMES)
@pytest.mark.parametrize("router_case", ROUTER_CASES)
@pytest.mark.parametrize("backend_case", BACKEND_CASES)
def test_grads_match_reference(backend_case, router_case, arg):
    (_, _, grads), (_, _, grads_ref) = _and_reference(backend_case, router_case)
    assert float(jnp.abs(grads_ref[arg]).max()) > 0
    np.testing.assert_allclose(grads[arg], grads_ref[arg], atol=GRAD_TOL[arg], rtol=1e-4)


@pytest.mark.parametrize("params_case", ADVERSARIAL)
@pytest.mark.parametrize("backend_case", BACKEND_CASES)
def test_adversarial_routing_forward_and_grads(backend_case, params_case):
    (y, stats, grads), (y_ref, _, grads_ref) = _and_reference(backend_case, params_case)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    for arg in ARG_NAMES:
        np.testing.assert_allclose(grads[arg], grads_ref[arg], atol=GRAD_TOL[arg], rtol=1e-4)


@pytest.mark.parametrize(
    "params_case, expected_counts",
    [
        ("one-expert-bias", {2: T, 6: T}),
        ("empty-experts", None),
        ("all-tied", {0: T, 1: T}),
    ],
)
def test_adversarial_loads(params_case, expected_counts):
    _, stats, _ = _run("tiled-4", params_case)
    counts = np.asarray(stats.tokens_per_expert)
    if expected_counts is None:
        assert counts[3:].sum() == 0 and counts.sum() == T * K
    else:
        assert dict((e, c) for e, c in enumerate(counts) if c) == expected_counts


def test_one_expert_gate_sends_every_token_to_expert_5():
    _, stats, _ = _run("tiled-1", "one-expert-gate")
    assert int(stats.tokens_per_expert[5]) == T


@pytest.mark.parametrize("backend_case", BACKEND_CASES)
def test_stats_counts_and_no_drops(backend_case):
    _, stats, _ = _run(backend_case, "sigmoid-groups")
    x, gate, *_ = _moe_params()
    _, experts, _ = _jit(route_tokens, **ROUTER_CASES["sigmoid-groups"])(x, gate)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=E)
    assert stats.tokens_per_expert.dtype == jnp.int32
    np.testing.assert_array_equal(stats.tokens_per_expert, counts)
    assert int(stats.tokens_per_expert.sum()) == T * K
    assert int(stats.dropped_tokens) == 0


def test_default_tile_rows_forward():
    y, _ = _jit(dropless_moe, backend="tiled")(*_moe_params())
    y_ref, _, _ = _run(None, "softmax")
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)


def test_stats_are_fp32_scalars():
    _, stats, _ = _run("tiled-4", "softmax")
    for key in ("aux_loss", "seq_aux_loss", "z_loss", "router_entropy"):
        assert getattr(stats, key).shape == () and getattr(stats, key).dtype == jnp.float32, key


def test_one_expert_top1_equals_dense_swiglu():
    @jax.jit
    def both(x, gate, wi_0, wi_1, wo):
        y, _ = dropless_moe(x, gate, wi_0, wi_1, wo, Routing(1), backend="tiled")
        return y, swiglu_mlp(x, wi_0[0], wi_1[0], wo[0])

    y, y_dense = both(*_moe_params(E=1))
    np.testing.assert_allclose(y, y_dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("router_case", ["softmax", "sigmoid-groups"])
def test_dropless_equals_capacity_at_max_load(router_case):
    y, stats, _ = _run("tiled-4", router_case)
    max_load = int(stats.tokens_per_expert.max())
    capacity = _jit(capacity_moe, capacity=max_load, **ROUTER_CASES[router_case])
    y_cap, cap_stats = capacity(*_moe_params())
    np.testing.assert_allclose(y_cap, y, atol=1e-5, rtol=1e-5)
    assert int(cap_stats.dropped_tokens) == 0


def test_capacity_moe_drops_and_counts():
    _, stats, _ = _run("tiled-4", "softmax")
    counts = np.asarray(stats.tokens_per_expert)
    capacity = int(counts.max()) - 2
    _, cap_stats = _jit(capacity_moe, capacity=capacity)(*_moe_params())
    assert int(cap_stats.dropped_tokens) == np.maximum(counts - capacity, 0).sum() > 0


def test_capacity_priority_is_first_choice_then_token_order():
    """E=2, K=2, C=2: first choices fill the queues first, then earlier tokens."""

    @jax.jit
    def run(x, wi_0, wi_1, wo):
        # A zero gate ties all logits; the bias makes every token choose (0, 1) in order.
        y, stats = capacity_moe(
            x,
            jnp.zeros((H, 2)),
            wi_0,
            wi_1,
            wo,
            Routing(2, normalize_top_k=False),
            capacity=2,
            expert_bias=jnp.array([1.0, 0.0]),
        )
        both = 0.5 * (swiglu_mlp(x, wi_0[0], wi_1[0], wo[0]) + swiglu_mlp(x, wi_0[1], wi_1[1], wo[1]))
        return y, stats.dropped_tokens, both

    x, _, wi_0, wi_1, wo = _moe_params(T=4, E=2)
    y, dropped, both = run(x, wi_0, wi_1, wo)
    # Tokens 0 and 1 keep both choices (weight 0.5 each); tokens 2 and 3 lose both.
    np.testing.assert_allclose(y[:2], both[:2], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(y[2:], 0.0)
    assert int(dropped) == 4


def test_jit_compiles_once_for_different_routings():
    traces = []

    @jax.jit
    def layer(x, gate, wi_0, wi_1, wo):
        traces.append(1)
        return dropless_moe(x, gate, wi_0, wi_1, wo, Routing(K), backend="tiled", tile_rows=4)

    params = _moe_params()
    _, stats_a = layer(*params)
    _, stats_b = layer(params[0], -params[1], *params[2:])  # a different routing
    assert not np.array_equal(stats_a.tokens_per_expert, stats_b.tokens_per_expert)
    assert len(traces) == 1


@functools.cache
def _bf16_results():
    """bf16 outputs of both CPU backends and the reference, and the fp32 reference."""

    @jax.jit
    def run(x, gate, wi_0, wi_1, wo):
        out = {
            b: dropless_moe(x, gate, wi_0, wi_1, wo, Routing(K), backend=b)[0]
            for b in ("tiled", "ragged_dot")
        }
        out["reference"] = dense_reference_moe(x, gate, wi_0, wi_1, wo, Routing(K))[0]
        out["fp32"] = dense_reference_moe(x.astype(jnp.float32), gate, wi_0, wi_1, wo, Routing(K))[0]
        return out

    return run(*_moe_params(dtype=jnp.bfloat16))


@pytest.mark.parametrize("backend", ["tiled", "ragged_dot"])
def test_bf16_matches_reference(backend):
    y = _bf16_results()[backend]
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        y.astype(jnp.float32), _bf16_results()["reference"].astype(jnp.float32), atol=2e-2, rtol=2e-2
    )


def test_bf16_close_to_fp32():
    np.testing.assert_allclose(
        _bf16_results()["tiled"].astype(jnp.float32), _bf16_results()["fp32"], atol=5e-2, rtol=5e-2
    )


def test_leading_dims_are_flattened_and_seq_len_used():
    @jax.jit
    def run(x, gate, wi_0, wi_1, wo):
        y3, stats3 = dropless_moe(
            x.reshape(4, 6, H), gate, wi_0, wi_1, wo, Routing(K), backend="tiled", tile_rows=4, seq_len=6
        )
        logits = router_logits(x, gate)
        _, experts, scores = route(logits, Routing(K))
        expected = router_stats(logits, scores, experts, seq_len=6).seq_aux_loss
        return y3, stats3.seq_aux_loss, expected

    y3, seq_aux, expected = run(*_moe_params())
    y, stats, _ = _run("tiled-4", "softmax")
    np.testing.assert_allclose(y3.reshape(T, H), y, atol=1e-6)
    np.testing.assert_allclose(seq_aux, expected, rtol=1e-6)
    assert abs(float(expected) - float(stats.seq_aux_loss)) > 1e-4


def test_no_gradient_to_expert_bias():
    params = _moe_params()

    def loss(bias):
        y, _ = dropless_moe(*params, Routing(K), backend="tiled", expert_bias=bias)
        return jnp.sum(y)

    np.testing.assert_array_equal(jax.jit(jax.grad(loss))(jnp.asarray(_BIAS_E)), 0.0)


def test_bad_shapes_raise():
    x, gate, wi_0, wi_1, wo = _moe_params()
    with pytest.raises(ValueError, match="wo"):
        dropless_moe(x, gate, wi_0, wi_1, wo[:, :, :-1], Routing(K))
