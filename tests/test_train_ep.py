"""The trainer with expert parallelism on fake CPU devices: same losses, buckets, resharding."""

import numpy as np
import pytest
from helpers import losses, records

from moe_train import config
from moe_train.config import ConfigError
from moe_train.train.loop import EXIT_OK, run

STEPS = 3


def cfg_for(*overrides: str, steps: int = STEPS) -> config.Config:
    return config.build("tiny", [f"train.steps={steps}", "train.log_every=100", *overrides])


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("single")
    assert run(cfg_for("parallel.devices=1"), out, log=lambda s: None) == EXIT_OK
    return losses(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices,ep,domain,dispatcher",
    [
        (8, 8, 0, "a2a"),
        (8, 4, 0, "allgather"),
        (4, 2, 0, "a2a"),
        (8, 8, 2, "hierarchical"),
    ],
)
def test_expert_parallel_training_matches_single_device(tmp_path, single, devices, ep, domain, dispatcher):
    cfg = cfg_for(
        f"parallel.devices={devices}",
        f"parallel.ep={ep}",
        f"moe.dispatcher={dispatcher}",
        f"parallel.domain_size={domain}",
        "moe.capacity_buckets=100",
    )
    assert run(cfg, tmp_path, log=lambda s: None) == EXIT_OK
    np.testing.assert_allclose(losses(tmp_path), single, rtol=1e-5)


@pytest.mark.slow
def test_overflow_reruns_are_reported_and_change_nothing(tmp_path, single):
    cfg = cfg_for(
        "parallel.devices=4", "parallel.ep=4", "moe.dispatcher=a2a", "moe.capacity_buckets=1.0,1.25"
    )
    run(cfg, tmp_path, log=lambda s: None)
    recs = records(tmp_path)
    assert recs[-1]["ep_overflow_reruns"] >= 1  # tiny's routing is skewed at the start
    assert recs[-1]["compilations"] == recs[-1]["ep_overflow_reruns"] + 1
    assert all(0 < r["recv_buffer_fill"] <= 1 for r in recs)
    np.testing.assert_allclose(losses(tmp_path), single, rtol=1e-5)


@pytest.mark.slow
def test_resume_with_another_ep_size_and_device_count(tmp_path, single):
    first = cfg_for("parallel.devices=4", "parallel.ep=2", "moe.capacity_buckets=100", steps=2)
    assert run(first, tmp_path, log=lambda s: None) == EXIT_OK
    lines = []
    again = cfg_for("parallel.devices=8", "parallel.ep=8", "moe.capacity_buckets=100")
    assert run(again, tmp_path, log=lines.append) == EXIT_OK
    assert any("resumed from" in l for l in lines)
    np.testing.assert_allclose(losses(tmp_path), single, rtol=1e-5)


@pytest.mark.slow
def test_micro_batches_with_expert_parallelism_and_reruns_match_one_device(tmp_path):
    """Gradient accumulation under EP: the overflow flag of any micro-batch reruns the step."""
    ref = cfg_for("parallel.devices=1", "moe.aux_loss_coef=0")
    assert run(ref, tmp_path / "one", log=lambda s: None) == EXIT_OK
    cfg = cfg_for(
        "parallel.devices=4",
        "parallel.ep=4",
        "moe.dispatcher=a2a",
        "moe.capacity_buckets=1.0,1.25",
        "moe.aux_loss_coef=0",
        "train.micro_batches=2",
    )
    assert run(cfg, tmp_path / "ep", log=lambda s: None) == EXIT_OK
    assert records(tmp_path / "ep")[-1]["ep_overflow_reruns"] >= 1
    np.testing.assert_allclose(losses(tmp_path / "ep"), losses(tmp_path / "one"), rtol=1e-5)


def test_experts_not_divisible_by_ep_names_valid_sizes(tmp_path):
    with pytest.raises(ConfigError, match=r"num_experts=8 is not divisible by parallel.ep=3"):
        run(cfg_for("parallel.devices=6", "parallel.ep=3", "train.batch_size=6"), tmp_path)


def test_hierarchical_needs_several_domains(tmp_path):
    with pytest.raises(ConfigError, match="needs an EP group spanning several domains"):
        run(cfg_for("parallel.devices=4", "parallel.ep=4", "moe.dispatcher=hierarchical"), tmp_path)


def test_dp_times_ep_must_equal_devices(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"parallel.dp=4 x parallel.ep=4 = 16 but the mesh has 8 "
        r"devices; set parallel.dp=2",
    ):
        run(cfg_for("parallel.devices=8", "parallel.ep=4", "parallel.dp=4"), tmp_path)
