"""Expert parallelism: every dispatcher equals the single-device layer, buckets never drop."""

import contextlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.moe import Routing, dropless_moe
from moe_train.parallel import sharding
from moe_train.parallel.jobplan import EPPlan, bucket_slots

T, H, F, E, K = 128, 16, 8, 8, 2


def operands(seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, H))
    gate = jax.random.normal(ks[1], (H, E)) * 0.5
    w0 = jax.random.normal(ks[2], (E, H, F)) * 0.3
    w1 = jax.random.normal(ks[3], (E, H, F)) * 0.3
    wo = jax.random.normal(ks[4], (E, F, H)) * 0.3
    return x, gate, w0, w1, wo


def mesh_for(devices, ep, inner=None):
    inner = inner or ep
    return sharding.make_mesh(jax.devices()[:devices], (devices // ep, ep // inner, inner))


def run_ep(mesh, plan, ops, bias=None, backend="auto", **kw):
    def loss(ops):
        y, stats = dropless_moe(
            *ops, routing=Routing(K, **kw), plan=plan, expert_bias=bias, seq_len=16, backend=backend
        )
        return jnp.sum(y * jnp.cos(y)) + stats.aux_loss, (y, stats)

    with jax.set_mesh(mesh):
        (_, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(ops)
    return y, stats, grads


def run_single(ops, bias=None, **kw):
    def loss(ops):
        y, stats = dropless_moe(*ops, routing=Routing(K, **kw), expert_bias=bias, seq_len=16)
        return jnp.sum(y * jnp.cos(y)) + stats.aux_loss, (y, stats)

    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(ops)
    return y, stats, grads


SKEW = jnp.where(jnp.arange(E) < 2, 10.0, 0.0)  # every token to experts 0 and 1 (one rank)

CASES = [  # devices, ep, inner (domain), dispatcher, capacity factor
    (2, 1, 1, "local", None),
    (8, 1, 1, "local", None),
    (2, 2, 2, "allgather", None),
    (4, 4, 4, "allgather", None),
    (8, 8, 8, "allgather", None),
    (2, 2, 2, "a2a", None),
    (4, 4, 4, "a2a", None),
    (8, 8, 8, "a2a", None),
    (8, 4, 2, "a2a", None),
    (8, 8, 2, "allgather", None),
    (4, 2, 2, "a2a", 1.5),
    (4, 4, 2, "hierarchical", None),
    (8, 8, 2, "hierarchical", None),
    (8, 8, 4, "hierarchical", None),
    (8, 4, 1, "hierarchical", None),
    (8, 8, 2, "hierarchical", 2.0),
]


@pytest.mark.parametrize("bias", [None, SKEW], ids=["random", "one-rank"])
@pytest.mark.parametrize("devices,ep,inner,dispatcher,factor", CASES)
def test_matches_single_device(devices, ep, inner, dispatcher, factor, bias):
    ops = operands()
    plan = EPPlan(dispatcher, ep, factor)
    y, stats, grads = run_ep(mesh_for(devices, ep, inner), plan, ops, bias)
    y_ref, stats_ref, grads_ref = run_single(ops, bias)
    if factor is not None and bool(stats.overflow):
        pytest.skip("bucket overflowed: covered by test_overflow_is_flagged")
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        assert_close_to_scale(g, g_ref, 1e-5)
    np.testing.assert_array_equal(stats.tokens_per_expert, stats_ref.tokens_per_expert)
    np.testing.assert_allclose(stats.aux_loss, stats_ref.aux_loss, rtol=1e-6)
    np.testing.assert_allclose(stats.seq_aux_loss, stats_ref.seq_aux_loss, rtol=1e-6)
    np.testing.assert_allclose(stats.z_loss, stats_ref.z_loss, rtol=1e-6)


@pytest.mark.parametrize(
    "devices,ep,inner,dispatcher", [(4, 4, 4, "allgather"), (8, 4, 2, "a2a"), (8, 8, 2, "hierarchical")]
)
def test_the_sorted_row_backend_matches_single_device(devices, ep, inner, dispatcher):
    """ragged_dot (the sorted-row path mgpu and te share, with ``swiglu_product``'s custom VJP)
    inside shard_map: its gradients typed as their operands, equal to one device's."""
    ops = operands()
    y, _, grads = run_ep(
        mesh_for(devices, ep, inner), EPPlan(dispatcher, ep, None), ops, backend="ragged_dot"
    )
    y_ref, _, grads_ref = run_single(ops)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert_close_to_scale(g, g_ref, 1e-5)


def test_overflow_is_flagged_when_a_bucket_is_too_small():
    _, stats, _ = run_ep(mesh_for(4, 4), EPPlan("a2a", 4, 1.0), operands(), SKEW)
    assert bool(stats.overflow)


@pytest.mark.parametrize("bias", [None, SKEW], ids=["random", "one-rank"])
@pytest.mark.parametrize("dispatcher,inner", [("a2a", 4), ("hierarchical", 2)])
def test_bucket_equals_worst_case_bitwise(bias, dispatcher, inner):
    mesh, ops = mesh_for(4, 4, inner), operands(1)
    worst = run_ep(mesh, EPPlan(dispatcher, 4, None), ops, bias)
    for factor in (1.0, 1.5, 2.0, 4.0):
        y, stats, grads = run_ep(mesh, EPPlan(dispatcher, 4, factor), ops, bias)
        if not bool(stats.overflow):
            np.testing.assert_array_equal(y, worst[0])
            for g, g_ref in zip(grads, worst[2]):
                np.testing.assert_array_equal(g, g_ref)
            return
    pytest.fail("no bucket held")


def test_receive_fill_reports_buffer_use():
    _, stats, _ = run_ep(mesh_for(4, 4), EPPlan("a2a", 4, None), operands())
    assert float(stats.recv_rows) == T * K  # every assignment arrives somewhere
    assert float(stats.recv_slots) == 4 * 4 * bucket_slots(None, 0, T // 4 * min(K, E // 4))


def assert_close_to_scale(actual, desired, rel: float) -> None:
    """Equal to ``rel`` of the tensor's largest magnitude: fp32 sums taken in another order
    (another split over devices or chunks, another CPU's vector width) differ by rounding
    on the scale of the largest terms, not of each element."""
    desired = np.asarray(desired)
    np.testing.assert_allclose(actual, desired, rtol=rel, atol=rel * np.abs(desired).max())


CHUNK_CASES = [  # ep (= devices), inner (domain), dispatcher: every dispatcher at EP 2, 4, 8
    (ep, inner, d)
    for d, inners in (("allgather", (2, 4, 8)), ("a2a", (2, 4, 8)), ("hierarchical", (1, 2, 2)))
    for ep, inner in zip((2, 4, 8), inners)
]


@pytest.mark.parametrize(
    "ep,inner,dispatcher", CHUNK_CASES, ids=[f"{d}-ep{ep}-domain{i}" for ep, i, d in CHUNK_CASES]
)
def test_chunked_dispatch_equals_unchunked(ep, inner, dispatcher):
    """moe.overlap_chunks=4: the layer's output and every gradient equal chunks=1 (chunks 2:
    tests/test_overlap.py, and the bench's overlap section for every dispatcher)."""
    mesh, ops = mesh_for(ep, ep, inner), operands(2)
    y1, _, g1 = run_ep(mesh, EPPlan(dispatcher, ep, None, 1), ops)
    y, _, g = run_ep(mesh, EPPlan(dispatcher, ep, None, 4), ops)
    np.testing.assert_allclose(y, y1, rtol=1e-6, atol=1e-6)
    for a, b in zip(g, g1):  # chunks sum the gradients in another order: fp32 rounding
        assert_close_to_scale(a, b, 1e-6)


def test_sigmoid_group_routing_with_bias_matches_single_device():
    ops = operands(3)
    kw: dict[str, Any] = dict(score_function="sigmoid", num_groups=4, group_top_k=2, routed_scaling=2.5)
    bias = jnp.linspace(-0.5, 0.5, E)
    y, _, grads = run_ep(mesh_for(8, 4, 4), EPPlan("a2a", 4, None), ops, bias, **kw)
    y_ref, _, grads_ref = run_single(ops, bias, **kw)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        assert_close_to_scale(g, g_ref, 1e-5)


@pytest.mark.parametrize("inner", [2, 4], ids=["4-domains", "2-domains"])
def test_hierarchical_sends_fewer_rows_over_slow_links_than_flat(inner):
    mesh, ops = mesh_for(8, 8, inner), operands(4)
    _, flat, _ = run_ep(mesh, EPPlan("a2a", 8, None), ops)
    _, hier, _ = run_ep(mesh, EPPlan("hierarchical", 8, None), ops)
    G = 8 // inner
    expected = T * (G - 1) * (1 - (1 - 1 / G) ** K)  # cost model: T tokens in all, uniform routing
    print(f"G={G}: flat {float(flat.slow_rows)}, hierarchical {float(hier.slow_rows)}, model {expected:.1f}")
    assert float(hier.slow_rows) < float(flat.slow_rows)
    assert float(flat.slow_rows) == pytest.approx(T * K * (8 - inner) / 8, rel=0.35)
    assert float(hier.slow_rows) == pytest.approx(expected, rel=0.35)


LOCAL_STEPS = {"route", "permute", "grouped_gemm", "unpermute"}
STEPS = LOCAL_STEPS | {"dispatch", "combine"}  # an exchange adds its two steps


def _scopes(fn, mesh=None) -> set[str]:
    """The named scopes in the lowered program of ``fn`` on operands()."""
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        text = jax.jit(fn).lower(*operands()).as_text(debug_info=True)
    names = re.findall(r'loc\("([^"/][^"]*/[^"]*)"', text)  # op names, not source files
    return {part for name in names for part in name.split("/")}


@pytest.mark.parametrize(
    "dispatcher, devices, ep, inner",
    [("local", 4, 1, 1), ("allgather", 4, 4, 4), ("a2a", 4, 4, 4), ("hierarchical", 8, 8, 4)],
)
def test_every_dispatcher_runs_the_same_named_steps(dispatcher, devices, ep, inner):
    plan = EPPlan(dispatcher, ep, None)
    fn = lambda *ops: dropless_moe(*ops, routing=Routing(K), plan=plan)  # noqa: E731
    assert (LOCAL_STEPS if ep == 1 else STEPS) <= _scopes(fn, mesh_for(devices, ep, inner))


def test_the_single_device_layer_runs_the_same_named_steps():
    assert LOCAL_STEPS <= _scopes(lambda *ops: dropless_moe(*ops, routing=Routing(K)))
