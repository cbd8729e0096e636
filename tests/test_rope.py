"""Rotary embeddings: both pair layouts, relative positions, and YaRN's frequencies and scales."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train import config
from moe_train.config import ConfigError, RopeConfig
from moe_train.model import rope

PLAIN = RopeConfig()
# DeepSeek-V3's released rope_scaling, on its 64 rotated dims
V3 = RopeConfig(
    layout="interleaved",
    scaling="yarn",
    factor=40.0,
    original_max_positions=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def x(shape=(2, 9, 3, 8), seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def rotate_half_reference(x_BSND, theta):
    """The textbook rotate-half RoPE, written out with numpy in float64."""
    x = np.asarray(x_BSND, np.float64)
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d)
    ang = np.arange(x.shape[1])[:, None] * freq[None, :]
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def test_half_layout_is_rotate_half():
    np.testing.assert_allclose(
        rope.apply(x(), 10000.0, PLAIN), rotate_half_reference(x(), 1e4), rtol=1e-5, atol=1e-5
    )


def test_interleaved_layout_rotates_adjacent_pairs():
    """Dims (2i, 2i+1) rotate as dims (i, i + D/2) of the half layout do."""
    half_order = np.r_[0:8:2, 1:8:2]  # de-interleave: evens then odds
    got = rope.apply(x(), 10000.0, RopeConfig(layout="interleaved"))
    want = rope.apply(x()[..., half_order], 10000.0, PLAIN)
    np.testing.assert_allclose(np.asarray(got)[..., half_order], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("r", [PLAIN, RopeConfig(layout="interleaved")], ids=["half", "interleaved"])
def test_scores_depend_only_on_the_offset(r):
    q, k = x((1, 1, 1, 8), 1), x((1, 1, 1, 8), 2)
    at = lambda v, p: rope.apply(jnp.tile(v, (1, 12, 1, 1)), 10000.0, r)[0, p, 0]  # noqa: E731
    np.testing.assert_allclose(jnp.dot(at(q, 7), at(k, 3)), jnp.dot(at(q, 10), at(k, 6)), rtol=1e-5)


def test_yarn_keeps_fast_frequencies_and_interpolates_slow_ones():
    """V3's correction dims by hand: floor(64 ln(4096 / (32 * 2 pi)) / (2 ln 1e4)) = 10 and
    ceil(64 ln(4096 / (2 pi)) / (2 ln 1e4)) = 23; a linear ramp between them."""
    base = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    keep = 1.0 - np.clip((np.arange(32) - 10) / 13, 0.0, 1.0)
    want = base / 40.0 * (1 - keep) + base * keep
    np.testing.assert_allclose(rope.inv_frequencies(64, 10000.0, V3), want, rtol=1e-6)


def test_yarn_with_factor_one_changes_nothing():
    r = RopeConfig(scaling="yarn", factor=1.0, mscale_all_dim=1.0)
    np.testing.assert_array_equal(rope.inv_frequencies(64, 1e4, r), rope.inv_frequencies(64, 1e4, PLAIN))
    assert rope.value_scale(r) == 1.0 and rope.softmax_scale_factor(r) == 1.0


def test_yarn_scales_the_softmax_by_mscale_squared():
    assert rope.value_scale(V3) == 1.0  # mscale / mscale_all_dim cancel at 1 / 1
    assert rope.softmax_scale_factor(V3) == pytest.approx((0.1 * math.log(40.0) + 1.0) ** 2)


def test_yarn_without_mscale_all_dim_scales_the_rotated_values():
    r = RopeConfig(scaling="yarn", factor=4.0)
    assert rope.value_scale(r) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert rope.softmax_scale_factor(r) == 1.0


def test_yarn_beta_fast_must_exceed_beta_slow():
    with pytest.raises(ConfigError, match="rope.beta_fast"):
        config.build("tiny", ["rope.scaling=yarn", "rope.beta_fast=1", "rope.beta_slow=2"])


def test_rope_layout_choices_are_listed():
    choices = "rope.layout='spiral' is not valid; choose one of: half, interleaved"
    with pytest.raises(ConfigError, match=choices):
        config.build("tiny", ["rope.layout=spiral"])


def test_the_model_uses_the_rope_section():
    from moe_train.model.settings import model_settings
    from moe_train.model.transformer import Transformer

    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    cfgs = {
        name: config.build("tiny", sets)
        for name, sets in {
            "plain": [],
            "interleaved": ["rope.layout=interleaved"],
            "yarn": ["rope.scaling=yarn", "rope.factor=4", "rope.mscale_all_dim=1"],
        }.items()
    }
    variables = jax.jit(Transformer(model_settings(cfgs["plain"])).init)(jax.random.key(0), tokens)
    logits = {n: jax.jit(Transformer(model_settings(c)).apply)(variables, tokens)[0] for n, c in cfgs.items()}
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in logits.values())
    assert not np.allclose(logits["interleaved"], logits["plain"])
    assert not np.allclose(logits["yarn"], logits["plain"])
