"""Chunked LM loss (moe_train.model.loss): equal to the full-logits optax loss and its gradients,
memory bounded by the chunk, sharding-neutral, and the default chunk rule.

Letter key: T tokens, H hidden, V vocab, C tokens per chunk.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moe_train.model.loss import CHUNK_LOGITS_BYTES, MIN_CHUNK_TOKENS, default_chunk, lm_loss

T, H, V = 37, 16, 50
F32_TOL = 1e-6  # relative to the largest entry
MiB = 2 ** 20


def _inputs(t=T, h=H, v=V, seed=0):
    kx, kh, kl = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kx, (t, h)), jax.random.normal(kh, (h, v)) / 2,
            jax.random.randint(kl, (t,), 0, v))


def _reference(x_TH, head_HV, labels_T, logit_scale=1.0, z_loss_coef=0.0, weights_T=None):
    """Today's loss: fp32 logits of every token at once, optax cross-entropy, plus z term."""
    logits_TV = jnp.dot(x_TH, head_HV, preferred_element_type=jnp.float32) * logit_scale
    ce_T = optax.softmax_cross_entropy_with_integer_labels(logits_TV, labels_T)
    lse_T = jax.nn.logsumexp(logits_TV, axis=-1)
    w_T = jnp.ones_like(ce_T) if weights_T is None else weights_T
    denom = jnp.maximum(w_T.sum(), 1.0)
    return (w_T * ce_T).sum() / denom + z_loss_coef * (w_T * lse_T ** 2).sum() / denom


def _value_and_grads(fn, x_TH, head_HV):
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(x_TH, head_HV)


def _assert_close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.abs(got - want).max() <= tol * max(np.abs(want).max(), 1e-30)


def _assert_same(got, want, tol=F32_TOL):
    (loss, grads), (ref_loss, ref_grads) = got, want
    _assert_close(loss, ref_loss, tol)
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape and g.dtype == r.dtype
        _assert_close(g, r, tol)


@pytest.mark.parametrize("t,chunk", [(T, 5), (T, 1), (T, T), (T, 64), (T, 0), (1, 0), (1, 1)],
                         ids=["not-dividing", "one", "equal", "over-T", "default", "T1", "T1-c1"])
def test_loss_and_grads_equal_full_logits(t, chunk):
    x, head, labels = _inputs(t)
    got = _value_and_grads(lambda x, h: lm_loss(x, h, labels, chunk=chunk)[0], x, head)
    _assert_same(got, _value_and_grads(lambda x, h: _reference(x, h, labels), x, head))


def test_weights_give_the_weighted_mean():
    x, head, labels = _inputs()
    w = jnp.where(jnp.arange(T) % 3 == 0, 0.0, 1.0).at[1].set(2.5)
    got = _value_and_grads(lambda x, h: lm_loss(x, h, labels, chunk=8, weights_T=w)[0],
                           x, head)
    _assert_same(got, _value_and_grads(lambda x, h: _reference(x, h, labels, weights_T=w),
                                       x, head))


def test_all_zero_weights_give_zero_loss_and_gradients():
    x, head, labels = _inputs()
    loss, grads = _value_and_grads(
        lambda x, h: lm_loss(x, h, labels, chunk=8, weights_T=jnp.zeros(T))[0], x, head)
    assert float(loss) == 0.0 and all(not np.any(np.asarray(g)) for g in grads)


def test_out_of_range_labels_are_ignored_like_weight_zero():
    x, head, labels = _inputs()
    bad = jnp.arange(T) % 4 == 1
    odd_labels = jnp.where(bad, jnp.where(jnp.arange(T) % 8 == 1, -1, V + 3), labels)
    got = _value_and_grads(lambda x, h: lm_loss(x, h, odd_labels, chunk=8)[0], x, head)
    want = _value_and_grads(
        lambda x, h: _reference(x, h, labels, weights_T=jnp.where(bad, 0.0, 1.0)), x, head)
    _assert_same(got, want)


def test_tied_head_with_logit_scale():
    x, head, labels = _inputs()
    embed_VH, scale = head.T, H ** -0.5
    got = _value_and_grads(
        lambda x, e: lm_loss(x, e.T, labels, chunk=6, logit_scale=scale)[0], x, embed_VH)
    want = _value_and_grads(lambda x, e: _reference(x, e.T, labels, logit_scale=scale),
                            x, embed_VH)
    _assert_same(got, want)


def test_z_loss_term_value_and_gradient():
    x, head, labels = _inputs()
    coef = 0.1
    got = _value_and_grads(lambda x, h: lm_loss(x, h, labels, chunk=7, z_loss_coef=coef)[0],
                           x, head)
    _assert_same(got, _value_and_grads(
        lambda x, h: _reference(x, h, labels, z_loss_coef=coef), x, head))


def test_aux_holds_ce_and_logit_z():
    x, head, labels = _inputs()
    loss, aux = jax.jit(lambda x, h: lm_loss(x, h, labels, chunk=7, z_loss_coef=0.1))(x, head)
    logits = x @ head
    _assert_close(aux["ce"], _reference(x, head, labels), F32_TOL)
    _assert_close(aux["logit_z"], jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2), F32_TOL)
    _assert_close(loss, aux["ce"] + 0.1 * aux["logit_z"], F32_TOL)


def test_bf16_inputs_within_bf16_rounding():
    """bf16 x and head: the loss equals the fp32 loss of the same (bf16-rounded) values to
    1e-5 (products are exact in fp32, sums accumulate in fp32); the bf16 gradients are within
    bf16 rounding of the fp32 ones (1e-2 of the largest entry; the backward matmuls take the
    logits' cotangent in bf16, as autodiff of a bf16 matmul does)."""
    x, head, labels = (a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a
                       for a in _inputs(t=64, h=32, v=200))
    loss, grads = _value_and_grads(
        lambda x, h: lm_loss(x, h, labels, chunk=16, z_loss_coef=1e-2)[0], x, head)
    x32, head32 = x.astype(jnp.float32), head.astype(jnp.float32)
    ref_loss, ref_grads = _value_and_grads(
        lambda x, h: _reference(x, h, labels, z_loss_coef=1e-2), x32, head32)
    _assert_close(loss, ref_loss, 1e-5)
    assert all(g.dtype == jnp.bfloat16 for g in grads)
    for g, r in zip(grads, ref_grads):
        _assert_close(g, r, 1e-2)


# --- memory: XLA's compiled temp buffers of forward + backward ---------------------------

MEM_T, MEM_H, MEM_V, MEM_C = 4096, 64, 32768, 256


def _grad_temp_bytes(loss_fn, t):
    args = (jax.ShapeDtypeStruct((t, MEM_H), jnp.float32),
            jax.ShapeDtypeStruct((MEM_H, MEM_V), jnp.float32),
            jax.ShapeDtypeStruct((t,), jnp.int32))
    grad = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))
    return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _chunked(chunk):
    return lambda x, h, labels: lm_loss(x, h, labels, chunk=chunk)[0]


def test_chunked_temp_memory_far_below_full_logits():
    """Measured on CPU (jax 0.10): full 1024 MiB, chunk of 256 tokens 42 MiB."""
    full = _grad_temp_bytes(_reference, MEM_T)
    chunked = _grad_temp_bytes(_chunked(MEM_C), MEM_T)
    assert full >= MEM_T * MEM_V * 4  # the reference really holds the [T, V] logits
    assert chunked < full / 8 and chunked < 96 * MiB


def test_chunked_temp_memory_grows_only_by_token_rows():
    """Doubling T at a fixed chunk adds O(T*H) (the chunked copies of x and dx: measured
    2 MiB = 8 bytes per hidden unit per added token), not O(T*V) (512 MiB here)."""
    small = _grad_temp_bytes(_chunked(MEM_C), MEM_T)
    large = _grad_temp_bytes(_chunked(MEM_C), 2 * MEM_T)
    assert large - small <= MEM_T * (16 * MEM_H + 64)


def test_default_chunk_temp_memory_near_its_budget():
    """At 4x the tokens the logits alone take 2 GiB; the default chunk (2048 tokens at
    V = 32768) keeps temp near one chunk's logits: measured 272 MiB (full: 4 GiB)."""
    t = 4 * MEM_T
    assert _grad_temp_bytes(_chunked(0), t) < 2 * CHUNK_LOGITS_BYTES + t * 32 * MEM_H


# --- sharding ---------------------------------------------------------------------------

def _mesh():
    return Mesh(np.array(jax.devices()[:8]), ("data",))


def _sharded_inputs(mesh, t=256):
    x, head, labels = _inputs(t=t)
    tokens = NamedSharding(mesh, P("data"))
    return (jax.device_put(x, NamedSharding(mesh, P("data", None))),
            jax.device_put(head, NamedSharding(mesh, P())), jax.device_put(labels, tokens))


def test_sharded_over_eight_devices_equals_unsharded():
    mesh = _mesh()
    xs, hs, ls = _sharded_inputs(mesh)
    x, head, labels = (np.asarray(a) for a in (xs, hs, ls))
    fn = jax.jit(jax.value_and_grad(
        lambda x, h, l: lm_loss(x, h, l, chunk=64, z_loss_coef=1e-3)[0], argnums=(0, 1)))
    _assert_same(fn(xs, hs, ls), fn(x, head, labels))


def test_sharded_chunks_keep_tokens_on_their_device():
    """With the batch sharding the strided chunks need no all-gather, all-to-all or
    collective-permute: only reductions (the loss sums and the head gradient)."""
    mesh = _mesh()
    fn = jax.jit(jax.grad(lambda x, h, l: lm_loss(x, h, l, chunk=64)[0], argnums=(0, 1)))
    hlo = fn.lower(*_sharded_inputs(mesh)).compile().as_text()
    assert "all-reduce" in hlo  # the head gradient sums over the token shards
    assert not re.search(r"all-gather|all-to-all|collective-permute", hlo)


def test_inside_shard_map_equals_global():
    mesh = _mesh()
    x, head, labels = _inputs(t=256)

    def per_device(x, h, l):
        return jax.lax.pmean(lm_loss(x, h, l, chunk=8)[0], "data")

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                            out_specs=P())
    got = _value_and_grads(lambda x, h: sharded(x, h, labels), x, head)
    _assert_same(got, _value_and_grads(lambda x, h: _reference(x, h, labels), x, head))


# --- default chunk rule -----------------------------------------------------------------

def test_default_chunk_is_all_tokens_within_budget():
    assert default_chunk(300, 256) == 300
    assert default_chunk(MIN_CHUNK_TOKENS, 10 ** 7) == MIN_CHUNK_TOKENS


@pytest.mark.parametrize("t,v,want", [(2 ** 16, 32768, 2048), (2 ** 16, 151936, 512),
                                      (3 * 2 ** 14, 131072, 512)])
def test_default_chunk_is_a_power_of_two_divisor_within_budget(t, v, want):
    assert default_chunk(t, v) == want


def test_default_chunk_balances_when_no_large_divisor():
    c = default_chunk(6001, 32768)  # budget 2048 tokens; 6001 is odd
    chunks = -(-6001 // c)
    assert c <= 2048 and c % 8 == 0 and chunks == 3 and chunks * c - 6001 < 8 * chunks


def test_bad_arguments_raise():
    x, head, labels = _inputs()
    with pytest.raises(ValueError, match="chunk"):
        lm_loss(x, head, labels, chunk=-1)
    with pytest.raises(ValueError, match="shapes"):
        lm_loss(x, head.T, labels)
