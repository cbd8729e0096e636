"""``study.capacity_factor``: the token-dropping baseline of studies, in the trainer. A factor
large enough to drop nothing takes the dropless step; a tight one drops and says how many
(and the run warns once that a study key is set); it refuses expert parallelism and fp8."""

import numpy as np
import pytest
from helpers import QUIET, records, tiny

from moe_train import config
from moe_train.config import ConfigError
from moe_train.train.loop import EXIT_OK, run


def run_records(cfg, out, log=QUIET["log"]):
    assert run(cfg, out, log=log) == EXIT_OK
    return records(out)


def test_a_factor_that_drops_nothing_takes_the_dropless_step(tmp_path):
    # capacity = factor x T*K/E = 8 x 512*2/8 = 1024 >= T: no expert can overflow
    capped = run_records(tiny("study.capacity_factor=8"), tmp_path / "capped")
    lines = []
    dropless = run_records(tiny(), tmp_path / "dropless", log=lines.append)
    assert not [line for line in lines if "[study]" in line]  # a real run: no study warning
    assert [r["dropped_tokens"] for r in capped] == [0, 0]
    np.testing.assert_allclose([r["loss"] for r in capped], [r["loss"] for r in dropless], rtol=1e-5)


def test_a_tight_factor_drops_and_counts_the_dropped_assignments(tmp_path):
    lines = []
    recs = run_records(tiny("study.capacity_factor=0.5"), tmp_path / "tight", log=lines.append)
    warned = [line for line in lines if "[study] keys are for benchmarks and studies only" in line]
    assert len(warned) == 1 and warned[0].startswith("WARNING: study.capacity_factor=0.5: "), lines
    # half the balanced load per expert: at least half of the T*K assignments are dropped
    assert all(r["dropped_tokens"] >= 8 * 64 * 2 * 2 // 2 for r in recs)  # 2 MoE layers
    assert all(np.isfinite(r["loss"]) for r in recs)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["parallel.devices=2", "parallel.ep=2"], "runs without expert parallelism"),
        (["precision.compute=fp8"], "has no fp8 path"),
        (["study.capacity_factor=-1"], "study.capacity_factor=-1"),
    ],
)
def test_the_baseline_refuses_what_it_cannot_run(extra, match):
    overrides = extra if "study.capacity_factor=-1" in extra else ["study.capacity_factor=1.25", *extra]
    with pytest.raises(ConfigError, match=match):
        config.build("tiny", overrides)
