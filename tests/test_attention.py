"""Attention kernels (moe_train.model.attention): chunked and the GPU paths against the xla reference,
memory growth in S, and the choice of implementation (resolve / available)."""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.base.platform import Platform
from moe_train.config import ConfigError
from moe_train.model import attention
from moe_train.model.attention import fused

CPU = Platform("cpu", "cpu")  # a CPU, named: resolving for it reads nothing of this machine

TOL = 1e-5  # fp32 on CPU, forward and gradients (see rel_err)
BF16_TOL = 2e-2  # bf16 inputs vs the fp32 reference (bf16 epsilon 7.8e-3; measured ~5e-3)


def operands(B=2, S=40, N=4, K=2, D=16, J=None, dtype=jnp.float32, seed=0):
    """(q [B,S,N,D], k [B,S,K,D], v [B,S,K,J], cotangent do [B,S,N,J])."""
    J = J or D
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = ((B, S, N, D), (B, S, K, D), (B, S, K, J), (B, S, N, J))
    q, k, v, do = (jax.random.normal(key, shp) for key, shp in zip(ks, shapes))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), do


@functools.partial(jax.jit, static_argnames=("impl", "block", "scale"))
def out_and_grads(impl, q, k, v, do, segment_ids_BS=None, block=0, scale=None):
    """(output, dq, dk, dv) of <attend(q, k, v), do>, all in fp32 (jitted: eager op-by-op
    dispatch would dominate the test time)."""

    def attend(q, k, v):
        return attention.attend(
            q, k, v, implementation=impl, segment_ids_BS=segment_ids_BS, block=block, scale=scale
        )

    def loss(q, k, v):
        return jnp.vdot(attend(q, k, v).astype(jnp.float32), do)

    out = attend(q, k, v)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return [x.astype(jnp.float32) for x in (out, *grads)]


def forward(impl, q, k, v, **kw):
    return out_and_grads(impl, q, k, v, jnp.zeros(q.shape[:3] + v.shape[3:]), **kw)[0]


def rel_err(got, want) -> float:
    """Largest difference over the largest reference magnitude (at least 1: gradients that
    are exactly zero, such as dq at S=1, are compared absolutely)."""
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1.0))


def packed_segments(S: int, starts_per_row) -> jnp.ndarray:
    """int [B, S] document ids from each row's document start positions."""
    rows = [np.searchsorted(np.asarray(starts), np.arange(S), side="right") - 1 for starts in starts_per_row]
    return jnp.asarray(np.stack(rows), jnp.int32)


# name -> (operand shapes, attend kwargs); blocks of 16 make S=40 end mid-block
CASES = {
    "mha N/K=1": (dict(N=4, K=4), dict(block=16)),
    "gqa N/K=2": (dict(N=4, K=2), dict(block=16)),
    "gqa N/K=4": (dict(N=8, K=2), dict(block=16)),
    "odd length 37, block 8": (dict(S=37), dict(block=8)),
    "S=1": (dict(S=1), dict(block=0)),
    "block > S": (dict(S=20), dict(block=64)),
    "Dv != Dqk (24 / 16)": (dict(D=24, J=16), dict(block=16)),
    "custom scale": (dict(), dict(block=16, scale=0.3)),
    "default block, 3 blocks": (dict(B=1, S=130, N=2, K=1, D=8), dict(block=0)),
}
SEGMENTS = packed_segments(40, [[0, 5, 21, 30], [0, 16, 17]])  # documents start mid-block


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_forward_matches_xla(case):
    shape, kw = CASES[case]
    q, k, v, _ = operands(**shape)
    got = forward("chunked", q, k, v, **kw)
    want = forward("xla", q, k, v, scale=kw.get("scale"))
    assert got.shape == want.shape and rel_err(got, want) < TOL


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_gradients_match_xla(case):
    shape, kw = CASES[case]
    ops = operands(**shape)
    got = out_and_grads("chunked", *ops, **kw)[1:]
    want = out_and_grads("xla", *ops, scale=kw.get("scale"))[1:]
    assert [rel_err(g, w) < TOL for g, w in zip(got, want)] == [True] * 3


@pytest.mark.parametrize("block", [8, 16, 64])
def test_chunked_with_segments_matches_xla(block):
    ops = operands(S=40)
    got = out_and_grads("chunked", *ops, segment_ids_BS=SEGMENTS, block=block)
    want = out_and_grads("xla", *ops, segment_ids_BS=SEGMENTS)
    assert [rel_err(g, w) < TOL for g, w in zip(got, want)] == [True] * 4


def test_xla_segments_equal_attention_per_document():
    q, k, v, _ = operands(B=1, S=40)
    seg = SEGMENTS[:1]
    got = forward("xla", q, k, v, segment_ids_BS=seg)
    bounds = [0, 5, 21, 30, 40]
    want = jnp.concatenate(
        [forward("xla", q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in zip(bounds, bounds[1:])], axis=1
    )
    assert rel_err(got, want) < TOL


def test_segments_change_the_result():
    q, k, v, _ = operands(S=40)
    plain = forward("chunked", q, k, v, block=8)
    packed = forward("chunked", q, k, v, block=8, segment_ids_BS=SEGMENTS)
    assert rel_err(packed, plain) > 0.1


def test_xla_reference_equals_jax_nn_dot_product_attention():
    q, k, v, _ = operands(S=33)
    want = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla"))(
        q, k, v
    )
    assert rel_err(forward("xla", q, k, v), want) < TOL


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_bf16_within_tolerance_of_fp32_reference(impl):
    q, k, v, do = operands(S=72, D=32, dtype=jnp.bfloat16)
    got = out_and_grads(impl, q, k, v, do, block=16 if impl == "chunked" else 0)
    want = out_and_grads("xla", q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), do)
    assert max(rel_err(g, w) for g, w in zip(got, want)) < BF16_TOL


def test_bf16_output_keeps_the_input_dtype():
    q, k, v, _ = operands(S=24, dtype=jnp.bfloat16)
    out = jax.eval_shape(lambda *a: attention.attend(*a, implementation="chunked"), q, k, v)
    assert out.dtype == jnp.bfloat16


def _scans(jaxpr):
    """Every scan equation in ``jaxpr`` and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _scans(sub)


def test_chunked_blocks_write_into_carried_buffers_not_stacked_scan_outputs():
    """A scan's stacked outputs start as operand-free zero buffers, which XLA:GPU made early
    and held side by side (eight of the MTP block's dk stacks, docs/compile.md): every
    per-block result of the forward and the backward is a loop carry instead."""
    q, k, v, do = operands(S=40)

    def loss(q, k, v):
        return jnp.vdot(attention.attend(q, k, v, implementation="chunked", block=16), do)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    scans = list(_scans(jaxpr))
    stacked = [len(e.outvars) - e.params["num_carry"] for e in scans]
    assert len(scans) >= 2 and stacked == [0] * len(scans)


def temp_bytes(impl: str, S: int, block: int) -> int:
    """Compiled temp bytes of fwd+bwd at length S (compiled only, nothing runs)."""

    def loss(q, k, v, do):
        return jnp.vdot(attention.attend(q, k, v, implementation=impl, block=block), do)

    q = jax.ShapeDtypeStruct((1, S, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, S, 2, 16), jnp.float32)
    stats = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, q).compile().memory_analysis()
    assert stats is not None
    return stats.temp_size_in_bytes


# temp at 4S over temp at S, measured (S = 128, 256, 512; chunked with blocks of 64):
# chunked 1.8, 2.6, 3.2 (linear would be 4); xla 15.4, 9.5, 9.6 (quadratic would be 16)
def test_chunked_temp_memory_grows_linearly_in_s():
    assert temp_bytes("chunked", 512, 64) / temp_bytes("chunked", 128, 64) < 6


def test_xla_temp_memory_grows_quadratically_in_s():
    assert temp_bytes("xla", 512, 0) / temp_bytes("xla", 128, 0) > 10


def test_resolve_cudnn_on_cpu_names_the_choices_that_work():
    with pytest.raises(
        ConfigError,
        match=r"model.attention=cudnn needs an NVIDIA GPU.*"
        r"choose one of: xla, chunked$",
    ):
        attention.resolve("cudnn", platform=CPU, dtype="bfloat16", head_dim=64, v_head_dim=64, seq_len=128)


def test_resolve_te_without_transformer_engine_reports_the_import_error(monkeypatch):
    monkeypatch.setattr(fused, "te_import_error", lambda: "cannot import transformer_engine.jax (X)")
    with pytest.raises(ConfigError, match=r"model.attention=te cannot import transformer_engine"):
        attention.resolve("te", platform=CPU, dtype="bfloat16", head_dim=64, v_head_dim=64, seq_len=128)


def test_resolve_rejects_an_unknown_name():
    with pytest.raises(ConfigError, match=r"unknown model.attention='flash'.*auto, xla"):
        attention.resolve("flash", platform=CPU, dtype="float32", head_dim=64, v_head_dim=64, seq_len=128)


@pytest.mark.parametrize(
    "seq_len,want",
    [
        (attention.CHUNKED_MIN_SEQ - 1, "xla"),
        (attention.CHUNKED_MIN_SEQ, "chunked"),
        (8192, "chunked"),
        (1, "xla"),
    ],
)
def test_resolve_auto_on_cpu_picks_by_seq_len(seq_len, want):
    impl, why = attention.resolve(
        "auto", platform=CPU, dtype="float32", head_dim=64, v_head_dim=64, seq_len=seq_len
    )
    assert (impl, str(seq_len) in why) == (want, True)


def test_resolve_explicit_choice_that_runs_is_kept():
    assert (
        attention.resolve("chunked", platform=CPU, dtype="float32", head_dim=64, v_head_dim=64, seq_len=8)[0]
        == "chunked"
    )


H100 = Platform.nvidia("NVIDIA H100 80GB HBM3", (9, 0), 91000)
A100 = dataclasses.replace(H100, compute_capability=(8, 0))


@pytest.mark.parametrize(
    "facts,dtype,dims,reason",
    [
        (H100, "float32", (128, 128), "bfloat16 or float16"),
        (H100, "bfloat16", (192, 128), "value head dim equal"),
        (H100, "bfloat16", (264, 264), "<= 256"),
        (A100, "bfloat16", (192, 192), "<= 128"),
        (H100, "bfloat16", (12, 12), "multiple of 8"),
        (
            dataclasses.replace(H100, compute_capability=(7, 5)),
            "bfloat16",
            (64, 64),
            "compute capability >= 8.0",
        ),
        (Platform("gpu", "AMD Instinct MI300X"), "bfloat16", (64, 64), "NVIDIA (CUDA) GPU"),
        (dataclasses.replace(H100, cudnn_version=None), "bfloat16", (64, 64), "cuDNN"),
    ],
)
def test_cudnn_reports_what_it_refuses_on_a_gpu(facts, dtype, dims, reason):
    why = attention.available(platform=facts, dtype=dtype, head_dim=dims[0], v_head_dim=dims[1])
    assert reason in (why["cudnn"] or "")


def test_resolve_auto_on_a_gpu_with_bf16_picks_cudnn():
    """On this machine too: the platform is the target's, not the machine's."""
    assert (
        attention.resolve("auto", platform=H100, dtype="bfloat16", head_dim=128, v_head_dim=128, seq_len=64)[
            0
        ]
        == "cudnn"
    )


def test_resolve_cudnn_with_fp32_on_a_gpu_raises():
    with pytest.raises(ConfigError, match=r"cudnn needs bfloat16 or float16.*choose one of: xla, chunked$"):
        attention.resolve("cudnn", platform=H100, dtype="float32", head_dim=128, v_head_dim=128, seq_len=64)


def test_available_on_cpu():
    why = attention.available(platform=CPU, dtype="float32", head_dim=32, v_head_dim=32)
    runs = {name: reason is None for name, reason in why.items()}
    assert runs == {"xla": True, "cudnn": False, "chunked": True, "te": False, "splash": False}


@pytest.mark.parametrize("seq_len", [1, 7, 64, 65, 300, 1024, 4096, 10**6])
def test_default_block_is_bounded_and_covers_short_sequences(seq_len):
    b = attention.default_block(seq_len)
    assert b % 8 == 0 and b <= attention.MAX_BLOCK and (b >= seq_len or b >= attention.MIN_BLOCK)


def test_attend_rejects_kv_heads_that_do_not_divide_query_heads():
    q, k, v, _ = operands(N=4, K=3)
    with pytest.raises(ValueError, match="do not divide"):
        attention.attend(q, k, v, implementation="xla")


def test_attend_rejects_auto():
    q, k, v, _ = operands()
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        attention.attend(q, k, v, implementation="auto")


@pytest.mark.slow
def test_quick_bench_section_times_and_sizes_both_kernels():
    from moe_train.bench import attention as bench

    sec = bench.run(bench.QUICK)
    timed = {(r["seq_len"], r["implementation"]) for r in sec["timing"]}
    sized = {(r["seq_len"], r["implementation"]) for r in sec["memory"] if r["temp_bytes"] > 0}
    both = lambda lengths: {(S, i) for S in lengths for i in ("xla", "chunked")}  # noqa: E731
    assert (timed, sized) == (both(bench.QUICK.seq_lens), both(bench.QUICK.memory_seq_lens))


# ----------------------------------------------------------------------------- GPU


def _needs(impl: str, head_dim: int = 64):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    why = attention.available(
        platform=Platform.here(), dtype="bfloat16", head_dim=head_dim, v_head_dim=head_dim
    )[impl]
    if why:
        pytest.skip(f"{impl} {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "te"])
def test_gpu_kernel_matches_xla_in_bf16(impl):
    _needs(impl)
    ops = operands(S=256, D=64, dtype=jnp.bfloat16)
    got = out_and_grads(impl, *ops)
    want = out_and_grads("xla", *(x.astype(jnp.float32) for x in ops[:3]), ops[3])
    assert max(rel_err(g, w) for g, w in zip(got, want)) < BF16_TOL


@pytest.mark.gpu
def test_cudnn_with_segments_at_an_odd_length_matches_xla():
    _needs("cudnn")
    ops = operands(S=41, D=64, dtype=jnp.bfloat16)
    seg = packed_segments(41, [[0, 5, 21, 30], [0, 16, 17]])
    got = out_and_grads("cudnn", *ops, segment_ids_BS=seg)
    want = out_and_grads("xla", *(x.astype(jnp.float32) for x in ops[:3]), ops[3], segment_ids_BS=seg)
    assert max(rel_err(g, w) for g, w in zip(got, want)) < BF16_TOL
