"""Multi-head Latent Attention against a direct, unfused implementation of the report's
equations (arXiv:2412.19437, eqs. 1-11) written here, for outputs and gradients; causality,
length 1, the attention kernels, YaRN's scale, precisions and the GQA layout beside it."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import call

from moe_train import config
from moe_train.model.mla import MLA
from moe_train.model.settings import model_settings

B, S = 2, 12
MLA_SETS = [
    "model.attention_kind=mla",
    "model.hidden=32",
    "model.num_heads=4",
    "model.q_lora_rank=24",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=6",
    "model.v_head_dim=10",
    "rope.layout=interleaved",
]


def cfg_of(*extra):
    return config.build("tiny", [*MLA_SETS, *extra])


def init(cfg, x):
    return nn.unbox(MLA(model_settings(cfg)).init(jax.random.key(1), x)["params"])


def x_of(seed=0, seq=S, hidden=32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, seq, hidden)), jnp.float32)


# ---------------------------------------------------------------- the reference, by hand


def rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rotate(x, positions, theta, interleaved):
    """RoPE as complex rotation of pairs: (2i, 2i+1) interleaved, else (i, i + d/2)."""
    d = x.shape[-1]
    freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    turn = np.exp(1j * positions[:, None] * freq[None, :])[None, :, None, :]  # [1, S, 1, d/2]
    if interleaved:
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * turn
        return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)
    z = (x[..., : d // 2] + 1j * x[..., d // 2 :]) * turn
    return np.concatenate([z.real, z.imag], axis=-1)


def reference(p, x, cfg, scale_factor=1.0):
    """Eqs. 1-11: latents, up-projections, decoupled RoPE key shared by the heads, softmax."""
    m = cfg.model
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    x = np.asarray(x, np.float64)
    U, I, Z = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    seq = x.shape[1]
    pos = np.arange(seq, dtype=np.float64)
    inter = cfg.rope.layout == "interleaved"
    if m.q_lora_rank:
        c_q = rms(x @ p["q_a"], p["q_a_norm"]["scale"], m.norm_eps)  # c^Q
        q = np.einsum("bsw,wnd->bsnd", c_q, p["q_b"])
    else:
        q = np.einsum("bsh,hnd->bsnd", x, p["q"])
    q_c, q_r = q[..., :U], rotate(q[..., U:], pos, m.rope_theta, inter)  # q^C, q^R
    kv = x @ p["kv_a"]
    c_kv = rms(kv[..., :Z], p["kv_a_norm"]["scale"], m.norm_eps)  # c^KV
    k_r = rotate(kv[..., Z:][:, :, None, :], pos, m.rope_theta, inter)  # k^R, one for all heads
    up = np.einsum("bsz,znd->bsnd", c_kv, p["kv_b"])
    k_c, v = up[..., :U], up[..., U:]  # k^C, v^C
    logits = np.einsum("bsnu,btnu->bnst", q_c, k_c) + np.einsum("bsni,btxi->bnst", q_r, k_r)
    logits = logits * scale_factor / math.sqrt(U + I)
    logits = np.where(np.tril(np.ones((seq, seq), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    o = np.einsum("bnst,btnj->bsnj", w, v)
    return np.einsum("bsnj,njh->bsh", o, p["o"])


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "extra", [[], ["model.q_lora_rank=0"], ["rope.layout=half"]], ids=["q-latent", "direct-q", "rotate-half"]
)
def test_forward_matches_the_reference(extra):
    cfg, x = cfg_of(*extra), x_of()
    p = init(cfg, x)
    np.testing.assert_allclose(
        call(MLA(model_settings(cfg)), {"params": p}, x), reference(p, x, cfg), rtol=2e-5, atol=2e-5
    )


def test_gradients_match_the_reference():
    cfg, x = cfg_of(), x_of()
    p = init(cfg, x)
    cot = x_of(seed=3)

    def ours(p, x):
        return jnp.sum(call(MLA(model_settings(cfg)), {"params": p}, x) * cot)

    def ref(p, x):  # the same equations in jnp, so autodiff can differentiate them
        return jnp.sum(_jnp_reference(p, x, cfg) * cot)

    g_ours, g_ref = jax.grad(ours, (0, 1))(p, x), jax.grad(ref, (0, 1))(p, x)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # and the jnp twin is the numpy reference
    np.testing.assert_allclose(_jnp_reference(p, x, cfg), reference(p, x, cfg), rtol=2e-5, atol=2e-5)


def _jnp_reference(p, x, cfg):
    m = cfg.model
    U, Z = m.qk_nope_head_dim, m.kv_lora_rank

    def norm(v, s):
        return v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + m.norm_eps) * s

    def rot(v):
        d = v.shape[-1]
        ang = jnp.arange(v.shape[1])[:, None] * (1.0 / m.rope_theta ** (jnp.arange(0, d, 2) / d))
        c, s = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
        a, b = v[..., 0::2], v[..., 1::2]
        return jnp.stack([a * c - b * s, a * s + b * c], -1).reshape(v.shape)

    q = jnp.einsum("bsw,wnd->bsnd", norm(x @ p["q_a"], p["q_a_norm"]["scale"]), p["q_b"])
    kv = x @ p["kv_a"]
    up = jnp.einsum("bsz,znd->bsnd", norm(kv[..., :Z], p["kv_a_norm"]["scale"]), p["kv_b"])
    k_r = rot(kv[..., Z:][:, :, None, :])
    logits = (
        jnp.einsum("bsnu,btnu->bnst", q[..., :U], up[..., :U])
        + jnp.einsum("bsni,btxi->bnst", rot(q[..., U:]), k_r)
    ) / math.sqrt(q.shape[-1])
    logits = jnp.where(jnp.tril(jnp.ones((x.shape[1],) * 2, bool)), logits, -jnp.inf)
    o = jnp.einsum("bnst,btnj->bsnj", jax.nn.softmax(logits, -1), up[..., U:])
    return jnp.einsum("bsnj,njh->bsh", o, p["o"])


def test_outputs_never_see_later_tokens():
    cfg, x = cfg_of(), x_of()
    p = init(cfg, x)
    later = x.at[:, 7:].set(x_of(seed=9)[:, 7:])
    a, b = (
        call(MLA(model_settings(cfg)), {"params": p}, x),
        call(MLA(model_settings(cfg)), {"params": p}, later),
    )
    np.testing.assert_array_equal(a[:, :7], b[:, :7])
    assert not np.allclose(a[:, 7:], b[:, 7:])


def test_a_single_position_matches_the_reference():
    cfg, x = cfg_of(), x_of(seq=1)
    p = init(cfg, x)
    np.testing.assert_allclose(
        call(MLA(model_settings(cfg)), {"params": p}, x), reference(p, x, cfg), rtol=2e-5, atol=2e-5
    )


def test_chunked_kernel_equals_full_scores():
    x = x_of(seq=40)
    xla, chunked = cfg_of("model.attention=xla"), cfg_of("model.attention=chunked", "model.attention_block=8")
    p = init(xla, x)
    np.testing.assert_allclose(
        call(MLA(model_settings(chunked)), {"params": p}, x),
        call(MLA(model_settings(xla)), {"params": p}, x),
        rtol=1e-5,
        atol=1e-5,
    )


def test_yarn_multiplies_the_softmax_scale_by_mscale_squared():
    cfg = cfg_of(
        "rope.scaling=yarn",
        "rope.factor=40",
        "rope.mscale=1",
        "rope.mscale_all_dim=1",
        "rope.original_max_positions=4",
    )
    x = x_of()
    p = init(cfg, x)
    mscale = 0.1 * math.log(40) + 1
    # value scale m(40, 1)/m(40, 1) = 1; frequencies: compare against the scores' scale only
    # by zeroing the RoPE dims' contribution (k^R and q^R weights set to 0)
    Z, U = cfg.model.kv_lora_rank, cfg.model.qk_nope_head_dim
    p = dict(p, kv_a=p["kv_a"].at[:, Z:].set(0), q_b=p["q_b"].at[..., U:].set(0))
    np.testing.assert_allclose(
        call(MLA(model_settings(cfg)), {"params": p}, x),
        reference(p, x, cfg, scale_factor=mscale**2),
        rtol=2e-5,
        atol=2e-5,
    )


def test_parameters_keep_the_released_fused_layouts():
    cfg, x = cfg_of(), x_of()
    shapes = jax.tree.map(lambda a: a.shape, init(cfg, x))
    assert shapes["q_a"] == (32, 24) and shapes["q_b"] == (24, 4, 8 + 6)
    assert shapes["kv_a"] == (32, 16 + 6) and shapes["kv_b"] == (16, 4, 8 + 10)
    assert shapes["o"] == (4, 10, 32)
    assert shapes["q_a_norm"]["scale"] == (24,) and shapes["kv_a_norm"]["scale"] == (16,)


def test_gqa_and_mla_have_their_own_weights():
    from moe_train.model.transformer import Transformer

    tokens = jnp.zeros((1, 8), jnp.int32)
    gqa = nn.unbox(
        Transformer(model_settings(config.build("tiny"))).init(jax.random.key(0), tokens)["params"]
    )
    mla = nn.unbox(Transformer(model_settings(cfg_of())).init(jax.random.key(0), tokens)["params"])
    assert set(gqa["moe_layers"]["attn"]) == {"q", "k", "v", "o"}
    assert set(mla["moe_layers"]["attn"]) == {"q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b", "o"}


@pytest.mark.parametrize("compute,rtol", [("bf16", 0.05), ("fp8", 0.15)])
def test_low_precision_stays_near_fp32(compute, rtol):
    cfg, x = cfg_of(f"precision.compute={compute}"), x_of()
    variables = nn.unbox(MLA(model_settings(cfg)).init(jax.random.key(1), x))
    got = np.asarray(call(MLA(model_settings(cfg)), variables, x), np.float32)
    want = reference(variables["params"], x, cfg)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < rtol
    if compute == "fp8":  # every projection quantized like the other dense ones
        assert {f"{n}_fp8" for n in ("q_a", "q_b", "kv_a", "kv_b", "o")} <= set(
            variables["_overwrite_with_gradient"]
        )


def test_odd_rope_dims_are_a_config_error():
    with pytest.raises(config.ConfigError, match="qk_rope_head_dim=7 must be even"):
        cfg_of("model.qk_rope_head_dim=7")
