"""Chunked LM loss (moe_train.model.loss): equal to the full-logits optax loss and its gradients,
memory bounded by the chunk and flat in the vocab, sharding-neutral, and the default chunk
and vocab tile rules.

Letter key: T tokens, H hidden, V vocab, C tokens per chunk, W vocab columns per tile.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_train.model.loss import (
    CHUNK_LOGITS_BYTES,
    MIN_CHUNK_TOKENS,
    VOCAB_TILE,
    default_chunk,
    device_token_losses,
    lm_loss,
    vocab_tile,
)
from moe_train.planner.compile import hlo as overlap_hlo
from moe_train.planner.compile import overlap

T, H, V = 37, 16, 50
F32_TOL = 1e-6  # relative to the largest entry
MiB = 2**20


def _inputs(t=T, h=H, v=V, seed=0):
    kx, kh, kl = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kx, (t, h)),
        jax.random.normal(kh, (h, v)) / 2,
        jax.random.randint(kl, (t,), 0, v),
    )


def _reference(x_TH, head_HV, labels_T, logit_scale=1.0, z_loss_coef=0.0, weights_T=None):
    """Today's loss: fp32 logits of every token at once, optax cross-entropy, plus z term."""
    logits_TV = jnp.dot(x_TH, head_HV, preferred_element_type=jnp.float32) * logit_scale
    ce_T = optax.softmax_cross_entropy_with_integer_labels(logits_TV, labels_T)
    lse_T = jax.nn.logsumexp(logits_TV, axis=-1)
    w_T = jnp.ones_like(ce_T) if weights_T is None else weights_T
    denom = jnp.maximum(w_T.sum(), 1.0)
    return (w_T * ce_T).sum() / denom + z_loss_coef * (w_T * lse_T**2).sum() / denom


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


@pytest.mark.parametrize(
    "t,chunk",
    [(T, 5), (T, 1), (T, T), (T, 64), (T, 0), (1, 0), (1, 1)],
    ids=["not-dividing", "one", "equal", "over-T", "default", "T1", "T1-c1"],
)
def test_loss_and_grads_equal_full_logits(t, chunk):
    x, head, labels = _inputs(t)
    got = _value_and_grads(lambda x, h: lm_loss(x, h, labels, chunk=chunk)[0], x, head)
    _assert_same(got, _value_and_grads(lambda x, h: _reference(x, h, labels), x, head))


def test_weights_give_the_weighted_mean():
    x, head, labels = _inputs()
    w = jnp.where(jnp.arange(T) % 3 == 0, 0.0, 1.0).at[1].set(2.5)
    got = _value_and_grads(lambda x, h: lm_loss(x, h, labels, chunk=8, weights_T=w)[0], x, head)
    _assert_same(got, _value_and_grads(lambda x, h: _reference(x, h, labels, weights_T=w), x, head))


def test_all_zero_weights_give_zero_loss_and_gradients():
    x, head, labels = _inputs()
    loss, grads = _value_and_grads(
        lambda x, h: lm_loss(x, h, labels, chunk=8, weights_T=jnp.zeros(T))[0], x, head
    )
    assert float(loss) == 0.0 and all(not np.any(np.asarray(g)) for g in grads)


def test_out_of_range_labels_are_ignored_like_weight_zero():
    x, head, labels = _inputs()
    bad = jnp.arange(T) % 4 == 1
    odd_labels = jnp.where(bad, jnp.where(jnp.arange(T) % 8 == 1, -1, V + 3), labels)
    got = _value_and_grads(lambda x, h: lm_loss(x, h, odd_labels, chunk=8)[0], x, head)
    want = _value_and_grads(
        lambda x, h: _reference(x, h, labels, weights_T=jnp.where(bad, 0.0, 1.0)), x, head
    )
    _assert_same(got, want)


def test_tied_head_with_logit_scale():
    x, head, labels = _inputs()
    embed_VH, scale = head.T, H**-0.5
    got = _value_and_grads(lambda x, e: lm_loss(x, e.T, labels, chunk=6, logit_scale=scale)[0], x, embed_VH)
    want = _value_and_grads(lambda x, e: _reference(x, e.T, labels, logit_scale=scale), x, embed_VH)
    _assert_same(got, want)


def test_z_loss_term_value_and_gradient():
    x, head, labels = _inputs()
    coef = 0.1
    got = _value_and_grads(lambda x, h: lm_loss(x, h, labels, chunk=7, z_loss_coef=coef)[0], x, head)
    _assert_same(got, _value_and_grads(lambda x, h: _reference(x, h, labels, z_loss_coef=coef), x, head))


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
    x, head, labels = (
        a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in _inputs(t=64, h=32, v=200)
    )
    loss, grads = _value_and_grads(lambda x, h: lm_loss(x, h, labels, chunk=16, z_loss_coef=1e-2)[0], x, head)
    x32, head32 = x.astype(jnp.float32), head.astype(jnp.float32)
    ref_loss, ref_grads = _value_and_grads(
        lambda x, h: _reference(x, h, labels, z_loss_coef=1e-2), x32, head32
    )
    _assert_close(loss, ref_loss, 1e-5)
    assert all(g.dtype == jnp.bfloat16 for g in grads)
    for g, r in zip(grads, ref_grads):
        _assert_close(g, r, 1e-2)


# vocab tiles: 7 (8 tiles, the last overlapping by 6 columns), 16 (4, overlap 14), 25 (2,
# dividing V), 49 (2, overlap 48), 64 (over V: one tile)
@pytest.mark.parametrize("vocab_chunk", [7, 16, 25, 49, 64])
def test_vocab_tiles_equal_full_logits(vocab_chunk):
    """Every term through the tiles: weights, ignored labels (incl. labels in the overlap of
    the last tile), z-loss, a logit scale, a tied (transposed) head, chunks not dividing T."""
    x, head, labels = _inputs()
    labels = labels.at[:4].set(jnp.array([V - 1, V - 7, 0, -1]))
    w = jnp.where(jnp.arange(T) % 5 == 0, 0.0, 1.0).at[2].set(1.5)
    embed_VH, scale = head.T, 0.7
    got = _value_and_grads(
        lambda x, e: lm_loss(
            x, e.T, labels, chunk=8, vocab_chunk=vocab_chunk, logit_scale=scale, z_loss_coef=0.1, weights_T=w
        )[0],
        x,
        embed_VH,
    )
    w_ref = jnp.where(labels < 0, 0.0, w)
    want = _value_and_grads(
        lambda x, e: _reference(x, e.T, jnp.maximum(labels, 0), scale, 0.1, w_ref), x, embed_VH
    )
    _assert_same(got, want)


def test_vocab_tiles_bf16_within_bf16_rounding():
    x, head, labels = (
        a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in _inputs(t=64, h=32, v=200)
    )
    loss, grads = _value_and_grads(lambda x, h: lm_loss(x, h, labels, chunk=16, vocab_chunk=48)[0], x, head)
    ref_loss, ref_grads = _value_and_grads(
        lambda x, h: _reference(x, h, labels), x.astype(jnp.float32), head.astype(jnp.float32)
    )
    _assert_close(loss, ref_loss, 1e-5)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == jnp.bfloat16
        _assert_close(g, r, 1e-2)


@pytest.mark.parametrize(
    "v,limit,want",
    [
        (50, 0, 50),
        (VOCAB_TILE, 0, VOCAB_TILE),
        (32000, 0, 2048),
        (2100, 0, 1152),
        (151936, 0, 2048),
        (50, 16, 16),
        (50, 7, 7),
        (50, 25, 25),
    ],
)
def test_vocab_tile_rule(v, limit, want):
    """All of V up to the limit; else balanced tiles rounded to 128 (2100: 2 x 1152, not
    2048 + an almost empty second tile)."""
    w = vocab_tile(v, limit)
    assert w == want and -(-v // w) == -(-v // (limit or VOCAB_TILE))


# --- memory: XLA's compiled temp buffers of forward + backward ---------------------------

MEM_T, MEM_H, MEM_V, MEM_C = 4096, 64, 32768, 256


def _temp_size(compiled) -> int:
    stats = compiled.memory_analysis()
    assert stats is not None
    return stats.temp_size_in_bytes


def _grad_temp_bytes(loss_fn, t):
    args = (
        jax.ShapeDtypeStruct((t, MEM_H), jnp.float32),
        jax.ShapeDtypeStruct((MEM_H, MEM_V), jnp.float32),
        jax.ShapeDtypeStruct((t,), jnp.int32),
    )
    grad = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))
    return _temp_size(grad.lower(*args).compile())


def _chunked(chunk):
    return lambda x, h, labels: lm_loss(x, h, labels, chunk=chunk)[0]


def test_chunked_temp_memory_far_below_full_logits():
    """Measured on CPU (jax 0.10): full 1024 MiB, chunk of 256 tokens (tiles of [256, 2048])
    3.2 MiB."""
    full = _grad_temp_bytes(_reference, MEM_T)
    chunked = _grad_temp_bytes(_chunked(MEM_C), MEM_T)
    assert full >= MEM_T * MEM_V * 4  # the reference really holds the [T, V] logits
    assert chunked < full / 8 and chunked < 96 * MiB


def test_chunked_temp_memory_grows_only_by_token_rows():
    """Doubling T at a fixed chunk adds O(T) (measured 0.05 MiB: per-token floats; the
    chunks are reshapes of x and dx, not copies), not O(T*V) (512 MiB here)."""
    small = _grad_temp_bytes(_chunked(MEM_C), MEM_T)
    large = _grad_temp_bytes(_chunked(MEM_C), 2 * MEM_T)
    assert large - small <= MEM_T * (16 * MEM_H + 64)


def test_default_chunk_temp_memory_near_its_budget():
    """At 4x the tokens the logits alone take 2 GiB; the default chunk and tile ([2048, 2048]
    at V = 32768) keep temp near one tile's logits: measured 18.7 MiB (full: 4 GiB)."""
    t = 4 * MEM_T
    assert _grad_temp_bytes(_chunked(0), t) < 2 * CHUNK_LOGITS_BYTES + t * 32 * MEM_H


def _temp_bytes(t, h, v, dtype=jnp.float32):
    args = (
        jax.ShapeDtypeStruct((t, h), dtype),
        jax.ShapeDtypeStruct((h, v), dtype),
        jax.ShapeDtypeStruct((t,), jnp.int32),
    )
    grad = jax.jit(jax.grad(lambda x, w, l: lm_loss(x, w, l)[0], argnums=(0, 1)))
    return _temp_size(grad.lower(*args).compile())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_default_temp_memory_is_flat_in_vocab(dtype):
    """At 16,384 tokens (one [T, 256] tile is the 16 MiB budget) the default chunks and tiles
    keep temp memory beyond the parameter-sized [H, V] buffers flat from V = 256 to 131,072.
    Measured on CPU (jax 0.10, H = 16): fp32 16.0 MiB at 256, 18.7 MiB from 4,096 on (the
    head gradient is the scan carry, written in place into the output: no temp); bf16 26.0 ->
    28.7 / 40.7 MiB at 32,768 / 131,072, i.e. two fp32 [H, V] buffers (the head gradient
    and XLA:CPU's fp32 copy of the bf16 head) on top of the same flat 26-27 MiB."""
    t, h = 16384, 16
    params = 0 if dtype == jnp.float32 else 2 * 4 * h
    base = _temp_bytes(t, h, 256, dtype)
    for v in (32768, 131072):
        assert _temp_bytes(t, h, v, dtype) - params * v <= 1.3 * base, v


def test_temp_memory_past_two_tiles_does_not_depend_on_vocab():
    """At a wider H the chunk's rows of x and dx and the tile's columns of the head and its
    gradient ([C, H], [H, W]: 5 such buffers, 12 MiB at H = 512) come on top of the logits
    once there are several tiles; they, too, stay the same for any vocab: measured 36.1 MiB
    at V = 4,096, 32,768 and 131,072 (one tile at V = 256: 8.0 MiB)."""
    t, h = 8192, 512
    assert abs(_temp_bytes(t, h, 131072) - _temp_bytes(t, h, 4096)) <= 4096  # loop scalars


# --- sharding ---------------------------------------------------------------------------


def _mesh():
    return Mesh(np.array(jax.devices()[:8]), ("data",))


def _sharded_inputs(mesh, t=256):
    x, head, labels = _inputs(t=t)
    tokens = NamedSharding(mesh, P("data"))
    return (
        jax.device_put(x, NamedSharding(mesh, P("data", None))),
        jax.device_put(head, NamedSharding(mesh, P())),
        jax.device_put(labels, tokens),
    )


@pytest.mark.parametrize("vocab_chunk", [0, 16], ids=["one-tile", "vocab-tiles"])
def test_sharded_over_eight_devices_equals_unsharded(vocab_chunk):
    mesh = _mesh()
    xs, hs, ls = _sharded_inputs(mesh)
    x, head, labels = (np.asarray(a) for a in (xs, hs, ls))
    fn = jax.jit(
        jax.value_and_grad(
            lambda x, h, l: lm_loss(x, h, l, chunk=64, z_loss_coef=1e-3, vocab_chunk=vocab_chunk)[0],
            argnums=(0, 1),
        )
    )
    _assert_same(fn(xs, hs, ls), fn(x, head, labels))


@pytest.mark.parametrize("vocab_chunk", [0, 16], ids=["one-tile", "vocab-tiles"])
def test_sharded_chunks_keep_tokens_on_their_device(vocab_chunk):
    """With the batch sharding the strided chunks need no all-gather, all-to-all or
    collective-permute: only reductions (the loss sums and the head gradient)."""
    mesh = _mesh()
    fn = jax.jit(
        jax.grad(lambda x, h, l: lm_loss(x, h, l, chunk=64, vocab_chunk=vocab_chunk)[0], argnums=(0, 1))
    )
    hlo = fn.lower(*_sharded_inputs(mesh)).compile().as_text()
    assert hlo is not None and "all-reduce" in hlo  # the head gradient sums over the token shards
    assert not re.search(r"all-gather|all-to-all|collective-permute", hlo)


def test_inside_shard_map_equals_global():
    mesh = _mesh()
    x, head, labels = _inputs(t=256)

    def per_device(x, h, l):
        return jax.lax.pmean(lm_loss(x, h, l, chunk=8, vocab_chunk=16)[0], "data")

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P())
    got = _value_and_grads(lambda x, h: sharded(x, h, labels), x, head)
    _assert_same(got, _value_and_grads(lambda x, h: _reference(x, h, labels), x, head))


# --- default chunk rule -----------------------------------------------------------------


def test_default_chunk_is_all_tokens_within_budget():
    assert default_chunk(300, 256) == 300
    assert default_chunk(MIN_CHUNK_TOKENS, 10**7) == MIN_CHUNK_TOKENS


@pytest.mark.parametrize(
    "t,v,want",
    [
        (2**16, 32768, 2048),
        (2**16, 151936, 2048),
        (3 * 2**14, 131072, 2048),
        (2**16, 1024, 4096),
        (2**16, 1000, 4096),
    ],
)
def test_default_chunk_is_a_power_of_two_divisor_within_budget(t, v, want):
    """The budget is per tile of at most VOCAB_TILE columns: past that the chunk does not
    shrink with V (151,936 and 131,072 included)."""
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


def test_one_call_over_stacked_token_sets_equals_one_call_per_set():
    """token_losses over the main head's and an MTP depth's tokens side by side (one loop
    over the head, as the train step calls it) gives each set's mean and gradients as
    separate lm_loss calls do; labels past the vocab count for nothing."""
    from moe_train.model.loss import token_losses

    x0, head, l0 = _inputs(seed=1)
    x1, _, l1 = _inputs(seed=2)
    l1 = l1.at[-3:].set(-1)  # ignored, as MTP's labels past the batch

    def separate(x0, x1, head):
        return lm_loss(x0, head, l0, chunk=8)[0] + 0.3 * lm_loss(x1, head, l1, chunk=8)[0]

    def joint(x0, x1, head):
        labels = jnp.concatenate([l0, l1])
        nll = token_losses(jnp.concatenate([x0, x1]), head, labels, chunk=8)[0].reshape(2, T)
        w = (labels.reshape(2, T) >= 0).astype(jnp.float32)
        ce = (w * nll).sum(1) / w.sum(1)
        return ce[0] + 0.3 * ce[1]

    want, got = (jax.value_and_grad(f, argnums=(0, 1, 2))(x0, x1, head) for f in (separate, joint))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, atol=F32_TOL * float(jnp.abs(w).max()))


# --- per device inside shard_map (the trainer's loss) -------------------------------------


def _device_loss(x, h, l):
    return jnp.mean(device_token_losses(x, h, l, ("data",), chunk=8))


def test_per_device_losses_equal_the_global_ones():
    mesh = _mesh()
    xs, hs, ls = _sharded_inputs(mesh)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(_device_loss, argnums=(0, 1)))(xs, hs, ls)
    x, head, labels = (np.asarray(a) for a in (xs, hs, ls))
    _assert_same(got, _value_and_grads(lambda x, h: _reference(x, h, labels), x, head))


def test_per_device_losses_reduce_the_head_gradient_outside_the_loops():
    """Under jax.jit the head gradient is all-reduced tile by tile inside the loss's loops;
    per device it is summed once, after them."""
    mesh = _mesh()
    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(_device_loss, argnums=1)).lower(*_sharded_inputs(mesh)).compile().as_text()
    assert hlo is not None
    comps, entry = overlap_hlo.parse(hlo)
    in_loops = {n for n, runs in overlap.runs_per_step(comps, entry).items() if runs > 1}
    reduces = lambda names: sum(i.op.startswith("all-reduce") for n in names for i in comps[n])  # noqa: E731
    assert reduces(in_loops) == 0 and reduces([entry]) >= 1
