"""Router: expert choice, combine weights, group limiting, bias, and the balance losses."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.moe.router import Routing, picked_scores, route, route_tokens, router_logits, router_stats


def _route(logits, top_k, expert_bias=None, **kwargs):
    """Jitted route() on a numpy/float list of logits."""
    fn = jax.jit(functools.partial(route, routing=Routing(top_k, **kwargs), expert_bias=expert_bias))
    return fn(jnp.asarray(logits, jnp.float32))


def _logit(p):
    """Inverse sigmoid."""
    p = np.asarray(p, np.float64)
    return np.log(p / (1 - p)).astype(np.float32)


def _random_logits(T=16, E=8, seed=0):
    return np.random.default_rng(seed).standard_normal((T, E)).astype(np.float32) * 2


def test_softmax_picks_top_probs_and_weights_are_probs():
    logits = _random_logits()
    weights, experts, probs = _route(logits, 3, normalize_top_k=False)
    expected_probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, expected_probs, rtol=1e-5)
    np.testing.assert_array_equal(experts, np.argsort(-logits, axis=-1, kind="stable")[:, :3])
    np.testing.assert_allclose(
        weights, np.take_along_axis(expected_probs, np.asarray(experts), -1), rtol=1e-5
    )
    assert experts.dtype == jnp.int32 and weights.dtype == jnp.float32


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_normalize_top_k_sums_to_one(score_function):
    weights, _, _ = _route(_random_logits(), 3, score_function=score_function)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_unnormalised_weights_do_not_sum_to_one(score_function):
    weights, experts, scores = _route(
        _random_logits(), 2, score_function=score_function, normalize_top_k=False
    )
    np.testing.assert_allclose(weights, np.take_along_axis(np.asarray(scores), np.asarray(experts), -1))
    assert np.abs(np.asarray(weights.sum(-1)) - 1.0).max() > 0.05


def test_routed_scaling_multiplies_final_weights():
    logits = _random_logits()
    w1, e1, _ = _route(logits, 2, score_function="sigmoid")
    w2, e2, _ = _route(logits, 2, score_function="sigmoid", routed_scaling=2.5)
    np.testing.assert_array_equal(e1, e2)
    np.testing.assert_allclose(w2, 2.5 * np.asarray(w1), rtol=1e-6)


# Hand-made scores for 4 groups of 2 experts. Group score = sum of its top-2 scores:
# g0 = 0.9, g1 = 1.2, g2 = 1.35, g3 = 0.2, so the best two groups are g2 and g1.
_GROUP_SCORES = np.array([[0.9, 0.0001, 0.6, 0.6, 0.7, 0.65, 0.1, 0.1]], np.float32)


def test_sigmoid_group_limited_routing_stays_in_best_groups():
    logits = _logit(_GROUP_SCORES)
    _, experts, _ = _route(logits, 2, score_function="sigmoid", num_groups=4, group_top_k=2)
    _, plain, _ = _route(logits, 2, score_function="sigmoid")
    assert list(np.asarray(experts[0])) == [4, 5]  # best two within groups 2 and 1
    assert list(np.asarray(plain[0])) == [0, 4]  # without groups expert 0 would win


def test_sigmoid_group_limited_one_group():
    _, experts, _ = _route(_logit(_GROUP_SCORES), 2, score_function="sigmoid", num_groups=4, group_top_k=1)
    assert list(np.asarray(experts[0])) == [4, 5]  # group 2 alone


def test_softmax_group_limited_routing_uses_same_rule():
    probs = _GROUP_SCORES / _GROUP_SCORES.sum()
    _, experts, _ = _route(np.log(probs), 2, num_groups=4, group_top_k=2)
    _, plain, _ = _route(np.log(probs), 2)
    assert list(np.asarray(experts[0])) == [4, 5]
    assert list(np.asarray(plain[0])) == [0, 4]


def test_group_limited_weights_are_renormalised_scores_of_choice():
    weights, _, _ = _route(
        _logit(_GROUP_SCORES), 2, score_function="sigmoid", num_groups=4, group_top_k=2, routed_scaling=2.0
    )
    np.testing.assert_allclose(weights[0], 2.0 * np.array([0.7, 0.65]) / 1.35, rtol=1e-5)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_expert_bias_changes_choice_not_weights(score_function):
    logits = _random_logits()
    weakest = np.argmin(logits, axis=-1)
    bias = np.zeros(8, np.float32)
    bias[weakest[0]] = 10.0
    weights, experts, scores = _route(
        logits, 2, score_function=score_function, normalize_top_k=False, expert_bias=bias
    )
    assert int(experts[0, 0]) == weakest[0]  # the bias forces the weakest expert in
    np.testing.assert_allclose(weights, np.take_along_axis(np.asarray(scores), np.asarray(experts), -1))
    assert float(weights[0, 0]) < 0.5  # its weight is its own (small) score, not biased


def test_ties_go_to_lowest_index():
    weights, experts, _ = _route(np.zeros((5, 8)), 3)
    np.testing.assert_array_equal(experts, np.tile([0, 1, 2], (5, 1)))
    np.testing.assert_allclose(weights, 1 / 3, rtol=1e-6)


# Hand-computed example: T=4, E=2, K=1, softmax probabilities [.75, .25] or [.25, .75].
_L3 = math.log(3.0)
_HAND_LOGITS = np.array([[_L3, 0], [0, _L3], [_L3, 0], [_L3, 0]], np.float32)


def _hand_stats(seq_len=None, score_function="softmax", logits=_HAND_LOGITS, top_k=1):
    @jax.jit
    def stats(logits):
        _, experts, scores = route(logits, Routing(top_k, score_function=score_function))
        return router_stats(logits, scores, experts, score_function=score_function, seq_len=seq_len)

    return stats(jnp.asarray(logits))


def test_aux_loss_hand_example():
    # counts [3, 1] -> f = [3/4, 1/4]; P = [0.625, 0.375]; aux = 2 * (0.46875 + 0.09375)
    stats = _hand_stats()
    np.testing.assert_array_equal(stats.tokens_per_expert, [3, 1])
    np.testing.assert_allclose(stats.aux_loss, 1.125, rtol=1e-6)


def test_seq_aux_loss_hand_example():
    # seq (0,1): f = [1, 1], P = [.5, .5] -> 1.0; seq (2,3): f = [2, 0], P = [.75, .25] -> 1.5
    np.testing.assert_allclose(_hand_stats(seq_len=2).seq_aux_loss, 1.25, rtol=1e-6)


def test_seq_aux_loss_one_sequence_by_default():
    # one sequence of 4: f = 2/4 * [3, 1] = [1.5, .5]; P = [.625, .375] -> 1.125
    np.testing.assert_allclose(_hand_stats().seq_aux_loss, 1.125, rtol=1e-6)


def test_z_loss_and_entropy_hand_example():
    stats = _hand_stats()
    np.testing.assert_allclose(stats.z_loss, math.log(4.0) ** 2, rtol=1e-6)
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    np.testing.assert_allclose(stats.router_entropy, entropy, rtol=1e-5)


def test_sigmoid_aux_loss_uses_per_token_normalised_scores():
    # scores [.6, .2] -> p [.75, .25]; [.45, .05] -> p [.9, .1]; both choose expert 0.
    # f = [1, 0]; P = [.825, .175] -> aux = 2 * .825 (raw scores would give 1.05).
    logits = _logit([[0.6, 0.2], [0.45, 0.05]])
    stats = _hand_stats(score_function="sigmoid", logits=logits)
    np.testing.assert_allclose(stats.aux_loss, 1.65, rtol=1e-5)


def test_seq_len_must_divide_tokens():
    with pytest.raises(ValueError, match="seq_len"):
        _hand_stats(seq_len=3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_groups=3, group_top_k=1), "divide"),
        (dict(num_groups=4), "group_top_k"),
        (dict(num_groups=4, group_top_k=1, top_k=3), "exceeds"),
        (dict(score_function="relu"), "score_function"),
        (dict(top_k=9), "top_k"),
    ],
)
def test_invalid_router_config_raises(kwargs, match):
    kwargs = {"top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        route(jnp.zeros((2, 8)), Routing(**kwargs))


def test_bf16_activations_route_like_fp32():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 32), dtype=np.float32))
    gate = jnp.asarray(rng.standard_normal((32, 8), dtype=np.float32))
    run = jax.jit(lambda x: route_tokens(x, gate, Routing(2)))
    w_bf16, e_bf16, _ = run(x.astype(jnp.bfloat16))
    w_rounded, e_rounded, _ = run(x.astype(jnp.bfloat16).astype(jnp.float32))
    # The router casts to fp32 first, so equal inputs route bit-identically.
    np.testing.assert_array_equal(e_bf16, e_rounded)
    np.testing.assert_array_equal(w_bf16, w_rounded)
    # Against unrounded fp32 x, choices agree wherever the k-th/(k+1)-th margin is clear.
    _, e_f32, _ = run(x)
    sorted_logits = -np.sort(-np.asarray(x @ gate), axis=-1)
    clear = (sorted_logits[:, 1] - sorted_logits[:, 2]) > 0.1
    assert clear.sum() > 32
    np.testing.assert_array_equal(np.asarray(e_bf16)[clear], np.asarray(e_f32)[clear])


def test_router_logits_are_fp32():
    x = jnp.ones((4, 8), jnp.bfloat16)
    logits = jax.jit(router_logits)(x, jnp.ones((8, 2), jnp.bfloat16))
    assert logits.dtype == jnp.float32


# ---------------------------------------------------------------- forced balance (benchmarks)


def test_balanced_routing_gives_every_expert_the_same_load_and_distinct_experts():
    from moe_train.moe.router import balanced_experts

    e_TK = np.asarray(balanced_experts(48, 3, 8))
    assert all(len(set(row)) == 3 for row in e_TK)
    np.testing.assert_array_equal(np.bincount(e_TK.reshape(-1), minlength=8), [18] * 8)


def test_balanced_routing_is_the_study_key_not_a_moe_key():
    from moe_train import config

    cfg = config.build("tiny", ["study.router=balanced"])
    assert Routing.of(cfg.moe, cfg.study).balanced
    assert not Routing.of(cfg.moe, config.StudyConfig()).balanced
    with pytest.raises(config.ConfigError, match=r"unknown key moe\.router; valid keys in \[moe\]"):
        config.build("tiny", ["moe.router=balanced"])


def test_balanced_routing_weights_are_the_routers_scores_and_carry_its_gradient():
    logits = jax.random.normal(jax.random.key(0), (16, 8))
    r = Routing(2, balanced=True)
    w, e, scores = route(logits, r)
    want = np.take_along_axis(np.asarray(scores), np.asarray(e), axis=1)
    np.testing.assert_allclose(w, want / want.sum(1, keepdims=True), rtol=1e-6)
    g = jax.grad(lambda lg: jnp.sum(route(lg, r)[0] * jnp.arange(2.0)))(logits)
    assert float(jnp.abs(g).sum()) > 0


def test_balanced_routing_never_overflows_the_balanced_bucket():
    from test_ep import mesh_for, operands, run_ep

    from moe_train.parallel.jobplan import EPPlan

    _, stats, _ = run_ep(mesh_for(8, 8), EPPlan("a2a", 8, 1.0), operands(), balanced=True)
    assert not bool(stats.overflow)
    np.testing.assert_array_equal(stats.tokens_per_expert, stats.tokens_per_expert[0])


def test_picked_scores_and_their_gradient_equal_a_gather():
    rng = np.random.default_rng(11)
    scores = jnp.asarray(rng.random((16, 8)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.permutation(8)[:3] for _ in range(16)]), jnp.int32)
    gather = lambda s: jnp.take_along_axis(s, experts, axis=-1)  # noqa: E731
    np.testing.assert_array_equal(picked_scores(scores, experts), gather(scores))
    g = jnp.asarray(rng.standard_normal((16, 3)), jnp.float32)
    got = jax.vjp(lambda s: picked_scores(s, experts), scores)[1](g)[0]
    np.testing.assert_array_equal(got, jax.vjp(gather, scores)[1](g)[0])


def test_routing_gradients_never_scatter():
    x = jnp.ones((16, 8))
    gate = jnp.asarray(np.random.default_rng(12).standard_normal((8, 8)), jnp.float32)

    def loss(gate):
        weights, _, stats = route_tokens(x, gate, Routing(2))
        return jnp.sum(weights) + stats.aux_loss

    assert "scatter" not in str(jax.make_jaxpr(jax.grad(loss))(gate))
