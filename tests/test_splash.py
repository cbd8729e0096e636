"""Splash attention (``model.attention=splash``: JAX's Pallas TPU flash attention; on CPU in
Pallas interpret mode) against the full-scores reference, forward and gradients, and where
``auto`` and the self-test offer it."""

import jax
import pytest
from test_attention import out_and_grads, packed_segments, rel_err

from moe_train import config
from moe_train.base.platform import Platform
from moe_train.config import ConfigError
from moe_train.model import attention
from moe_train.model.attention import splash
from moe_train.selftest import candidates

TOL = 1e-5  # fp32 in interpret mode, as the other kernels against the reference
TPU = Platform("tpu", "TPU v5 lite")
CPU = Platform("cpu")
D = 128  # splash takes head dims of a multiple of 128 (the TPU's lane width)


def _operands(S, N, Y, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = ((2, S, N, D), (2, S, Y, D), (2, S, Y, D), (2, S, N, D))
    return [jax.random.normal(key, shp) for key, shp in zip(ks, shapes)]


# name -> (S, N, Y, block): GQA and MHA, a length padded to the block, two blocks
CASES = {
    "gqa 4/2, S 128": (128, 4, 2, 0),
    "mha 2/2, S 256 in blocks of 128": (256, 2, 2, 128),
    "gqa 8/2, S 200 padded to 256": (200, 8, 2, 128),
}


@pytest.mark.parametrize("case", list(CASES))
def test_splash_forward_and_gradients_match_the_reference(case):
    S, N, Y, block = CASES[case]
    q, k, v, do = _operands(S, N, Y)
    got = out_and_grads("splash", q, k, v, do, block=block)
    want = out_and_grads("xla", q, k, v, do)
    assert max(rel_err(g, w) for g, w in zip(got, want)) < TOL


def test_splash_keeps_packed_documents_apart():
    q, k, v, do = _operands(200, 4, 2)
    seg = packed_segments(200, [[0, 70, 129], [0, 3]])  # documents start mid-block
    got = out_and_grads("splash", q, k, v, do, segment_ids_BS=seg, block=128)
    want = out_and_grads("xla", q, k, v, do, segment_ids_BS=seg)
    assert max(rel_err(g, w) for g, w in zip(got, want)) < TOL


def test_auto_picks_splash_on_a_tpu():
    impl, why = attention.resolve(
        "auto", platform=TPU, dtype="bfloat16", head_dim=D, v_head_dim=D, seq_len=2048
    )
    assert impl == "splash" and "TPU" in why


def test_auto_does_not_pick_splash_off_a_tpu():
    impl, _ = attention.resolve(
        "auto", platform=CPU, dtype="bfloat16", head_dim=D, v_head_dim=D, seq_len=2048
    )
    assert impl == "chunked"


def test_an_explicit_splash_off_a_tpu_names_the_tpu():
    with pytest.raises(ConfigError, match="needs a TPU"):
        attention.resolve("splash", platform=CPU, dtype="bfloat16", head_dim=D, v_head_dim=D, seq_len=2048)


def test_splash_refuses_a_head_dim_off_the_lane_width():
    assert "multiple of 128" in (splash.splash_unavailable(TPU, 64, 64) or "")


def test_the_block_is_the_largest_that_the_length_fills():
    assert [splash.block_rows(s) for s in (100, 300, 2048)] == [128, 256, 512]


def test_the_self_test_tries_splash_first_on_a_tpu():
    cfg = config.build("tiny", ["model.head_dim=128", "precision.compute=bf16"])
    names, _ = candidates.attention_candidates(cfg, TPU, 2048)
    assert names[0] == "splash" and "chunked" in names


def test_splash_in_a_scanned_flax_module_traces_twice():
    """Under flax's scan a kernel's mask arrays are tracers of the trace that builds it; a
    kernel kept across traces (a cache) leaked them into the next one: the TPU train step
    failed at init with an UnexpectedTracerError."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            q = nn.Dense(2 * D)(x).reshape(1, 128, 2, D)
            kv = x[:, None, None, :].reshape(1, 128, 1, D)
            o = splash.splash_attention(q, kv, kv, None, scale=0.1, interpret=True)
            return x + o.sum(axis=2).reshape(128, D), None

    Stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
    x = jax.numpy.ones((128, D))
    params = jax.jit(lambda x: Stack().init(jax.random.key(0), x, None))(x)
    out, _ = jax.jit(lambda p, x: Stack().apply(p, x, None))(params, x)
    assert out.shape == (128, D)
