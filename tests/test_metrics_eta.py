"""The ETA counts compile time (``metrics.eta_s``): a recompile after the first step (a new
capacity bucket, an overflow rerun) is expected again at the rate seen so far; the first
step's compile is a one-off."""

import pytest

from moe_train.train import metrics


def rec(step: int, seconds: float, compiled: bool = False) -> dict:
    return {"step": step, "step_time_s": seconds, "compiled": compiled}


def test_the_first_step_s_compile_is_not_spread_over_the_steps_left():
    records = [rec(1, 90.0, compiled=True), rec(2, 1.0), rec(3, 1.0)]
    assert metrics.eta_s(3, 100, records) == pytest.approx(97 * 1.0)


def test_a_recompile_adds_its_time_over_the_median_per_step_so_far():
    records = [rec(1, 90.0, True), rec(2, 1.0), rec(3, 1.0), rec(4, 11.0, True), rec(5, 1.0)]
    # 10 s over the median in 4 steps after the first: 2.5 s more for each of 95 steps left
    assert metrics.eta_s(5, 100, records) == pytest.approx(95 * 3.5)


def test_no_recompile_no_extra():
    records = [rec(1, 90.0, True)] + [rec(n, 2.0) for n in range(2, 10)]
    assert metrics.eta_s(9, 10, records) == pytest.approx(2.0)
