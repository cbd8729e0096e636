"""The study's variants compare what they claim to (``make study`` itself is a study, run by
hand; its numbers are in docs/benchmarks.md): same FLOPs per token or same parameters, same data."""

from pathlib import Path

import pytest

from moe_train.bench import study
from moe_train.model import flops

DATA = Path("/nonexistent/prepared")  # configs only: nothing is read


def cfg(name):
    return study.variant_config(name, DATA, seed=0, steps=10)


def test_dense_active_has_the_moes_flops_per_token():
    moe, dense = (
        flops.train_flops_per_token(cfg("dropless")),
        flops.train_flops_per_token(cfg("dense-active")),
    )
    assert dense == pytest.approx(moe, rel=0.02)  # the router's matmul is the difference


def test_dense_total_has_the_moes_parameters():
    moe, dense = flops.param_counts(cfg("dropless")), flops.param_counts(cfg("dense-total"))
    assert dense["total"] == pytest.approx(moe["total"], rel=0.02)
    assert dense["total"] == dense["active"]


def test_variants_differ_only_in_what_they_study():
    base = cfg("dropless")
    for name in study.VARIANTS:
        c = cfg(name)
        assert (c.train, c.data, c.optim) == (base.train, base.data, base.optim), name
    assert cfg("capacity-1.25").study.capacity_factor == 1.25
    assert cfg("aux-free").moe.aux_loss_coef == 0 and cfg("aux-free").moe.bias_update_rate > 0


def test_summary_averages_seeds_and_rates_the_drops():
    c = cfg("capacity-1.0")
    assigned = 16 * 128 * 2 * 2  # batch x seq x top_k x MoE layers
    runs = [
        [
            {"step": 5, "loss": 3.0, "dropped_tokens": 0, "eval_loss": 2.0},
            {"step": 10, "loss": 2.5, "dropped_tokens": assigned // 10, "eval_loss": 1.0},
        ],
        [
            {"step": 5, "loss": 3.0, "dropped_tokens": 0, "eval_loss": 2.2},
            {"step": 10, "loss": 2.5, "dropped_tokens": assigned // 10, "eval_loss": 1.2},
        ],
    ]
    row = study.summarize("capacity-1.0", c, runs)
    assert row["eval_loss_mean"] == pytest.approx(1.1) and row["eval_loss_std"] > 0
    assert row["curve"] == pytest.approx([2.1, 1.1])
    assert row["drop_rate"] == pytest.approx(0.05, rel=1e-3)  # half the steps drop a tenth
    assert "| capacity-1.0 |" in study.markdown([row], 10, 2, 60.0)
