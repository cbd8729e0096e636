"""The trainer's compiled-memory line: XLA's own peak where it reports one, beside the sum of
the parts, which counts every buffer as if all were live at once."""

import jax
import jax.numpy as jnp

from moe_train.train.step import CompiledMemory

GIB = 2**30


def _mem(xla_peak):
    return CompiledMemory(
        argument=6 * GIB, output=6 * GIB, alias=5 * GIB, temp=10 * GIB, code=0, xla_peak=xla_peak
    )


def test_the_line_leads_with_xlas_peak_where_reported():
    assert "XLA's peak 12.00 GiB" in _mem(12 * GIB).line()


def test_the_line_says_the_sum_counts_every_buffer_live_at_once():
    assert "= 17.00 GiB if all were live together" in _mem(12 * GIB).line()


def test_without_xlas_peak_the_line_gives_the_sum():
    assert _mem(0).line().startswith("compiled step memory per device: peak 17.00 GiB")


def test_the_metrics_keep_xlas_peak():
    assert _mem(12 * GIB).metrics()["compiled_xla_peak_bytes"] == 12 * GIB


def test_xlas_peak_is_read_from_the_compiled_step():
    step = jax.jit(lambda a: jnp.sin(a @ a), donate_argnums=0)
    mem = CompiledMemory.of(step.lower(jnp.ones((256, 256))).compile())
    assert mem is not None and 0 < mem.xla_peak <= mem.peak
