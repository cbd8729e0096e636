"""``moe.dispatch_dtype=fp8``: the dispatched rows cross devices as e4m3 with a per-row scale.
Rows exactly representable after scaling arrive bitwise, so the layer and its gradients equal
the unquantized dispatch on them, for every dispatcher at EP 2/4/8; on random rows the error
stays within the stated bounds; the gradients are straight-through."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ep import assert_close_to_scale, mesh_for, operands, run_ep

from moe_train import config
from moe_train.moe.dispatch.fp8 import dequantize_rows, quantize_rows, send_rows
from moe_train.parallel.jobplan import EPPlan
from moe_train.parallel.sharding import ep_plans

FWD_REL, GRAD_REL = 4e-2, 0.15  # measured 2.4e-2 and 9.4e-2 on these operands


def integer_operands():
    """Rows of small integers with max |x| = 2: x / scale = x * 224 is exact in e4m3."""
    x, *rest = operands()
    x = jnp.round(jnp.clip(2 * x, -2, 2)).at[:, 0].set(2.0)
    return (x, *rest)


def test_round_trip_error_bound():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)).astype(np.float32) * np.logspace(-6, 6, 64)[:, None]
    x[3] = 0.0
    back = dequantize_rows(*quantize_rows(jnp.asarray(x)), jnp.float32)
    amax = np.abs(x).max(axis=1, keepdims=True)
    assert np.all(np.abs(np.asarray(back) - x) <= 2**-4 * np.abs(x) + 2**-10 * amax)
    assert np.all(np.asarray(back)[3] == 0)


def test_the_rows_cross_as_one_byte_per_element():
    q, scale = quantize_rows(jnp.ones((4, 8), jnp.bfloat16))
    assert (q.dtype, q.shape, scale.shape) == (jnp.uint8, (4, 8), (4, 1))


def test_an_unknown_dispatch_dtype_is_refused():
    with pytest.raises(ValueError, match="valid: activation, fp8"):
        send_rows(lambda r: r, jnp.ones((2, 2)), "bf16")


EXACT = [  # devices, ep, inner (domain), dispatcher
    (2, 2, 2, "a2a"),
    (4, 4, 4, "a2a"),
    (8, 8, 8, "a2a"),
    (2, 2, 2, "allgather"),
    (8, 8, 8, "allgather"),
    (4, 4, 2, "hierarchical"),
    (8, 8, 2, "hierarchical"),
]


@pytest.mark.parametrize("devices,ep,inner,dispatcher", EXACT)
def test_representable_rows_give_the_unquantized_layer_and_gradients(devices, ep, inner, dispatcher):
    ops, mesh = integer_operands(), mesh_for(devices, ep, inner)
    y, _, grads = run_ep(mesh, EPPlan(dispatcher, ep, dispatch_dtype="fp8"), ops)
    y_ref, _, grads_ref = run_ep(mesh, EPPlan(dispatcher, ep), ops)
    np.testing.assert_array_equal(y, y_ref)
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_array_equal(g, g_ref)


@pytest.mark.parametrize(
    "devices,ep,inner,dispatcher", [(8, 8, 8, "a2a"), (4, 4, 4, "allgather"), (8, 8, 2, "hierarchical")]
)
def test_random_rows_stay_within_the_bound(devices, ep, inner, dispatcher):
    ops, mesh = operands(), mesh_for(devices, ep, inner)
    y, _, grads = run_ep(mesh, EPPlan(dispatcher, ep, dispatch_dtype="fp8"), ops)
    y_ref, _, grads_ref = run_ep(mesh, EPPlan(dispatcher, ep), ops)
    assert 0 < float(jnp.max(jnp.abs(y - y_ref))) <= FWD_REL * float(jnp.max(jnp.abs(y_ref)))
    for g, g_ref in zip(grads, grads_ref):
        assert_close_to_scale(g, g_ref, GRAD_REL)


def test_the_config_key_reaches_every_plan_of_a_run():
    cfg = config.build("tiny", ["moe.dispatch_dtype=fp8", "parallel.ep=4", "parallel.devices=4"])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(1, 1, 4), ("data", "expert_x", "expert"))
    plans = ep_plans(cfg, mesh)
    assert None not in plans  # EP 4: a plan per bucket
    assert {p.dispatch_dtype for p in plans if p is not None} == {"fp8"}


def test_a_bad_config_value_names_the_choices():
    with pytest.raises(config.ConfigError, match="activation, fp8"):
        config.build("tiny", ["moe.dispatch_dtype=e5m2"])
