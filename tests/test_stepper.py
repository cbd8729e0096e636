"""The pipelined stepper: step n+1 is dispatched before step n's overflow flag is read, and
overflowed steps rerun without changing any result.

Overflows are forced through the real model: rows of a batch that repeat one token route
every token the same way (causal attention keeps their hidden states equal), so the shard
holding them sends all its tokens to one destination. On 8 fake devices, EP 8, 4 rows of
64 tokens per shard, top-2 of 8 experts, the balanced pair load is 64 and:

- ordinary batches: largest pair load < 3.0 x balanced (fits bucket 3.0);
- ``MID`` (3 of the shard's 4 rows repeated): about 3.6 x (overflows 3.0, fits 3.875);
- ``ALL`` (all 4 rows repeated): exactly 4.0 x, the worst case (overflows every bucket).
"""

from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import records

from moe_train import config
from moe_train.checkpoints import checkpoint
from moe_train.parallel import sharding
from moe_train.train import loop as run_mod
from moe_train.train.loop import EXIT_OK
from moe_train.train.stepper import BucketedStep

MID, ALL = 3, 4  # repeated rows on the first shard
SAME = (
    "loss",
    "total_loss",
    "aux_loss",
    "z_loss",
    "grad_norm",
    "lr",
    "tokens_per_expert",
    "dropped_tokens",
    "skipped",
)  # what the buckets must not change


def cfg_for(*overrides: str, steps: int = 4) -> config.Config:
    return config.build(
        "tiny",
        [
            f"train.steps={steps}",
            "train.log_every=100",
            "train.telemetry_interval_s=0",
            "train.async_checkpoint=false",
            "train.checkpoint_every=0",
            *overrides,
        ],
    )


def ep_cfg(buckets: str, steps: int) -> config.Config:
    return cfg_for(
        "parallel.devices=8",
        "parallel.ep=8",
        "moe.dispatcher=a2a",
        "train.batch_size=32",
        f"moe.capacity_buckets={buckets}",
        "moe.bucket_step_down_after=100",
        steps=steps,
    )


class Recording(BucketedStep):
    """The real stepper, logging ("dispatch", step) and ("read", step) in order."""

    events: list = []
    steps: dict = {}  # id(batch) -> its step, filled by the batches below

    def _dispatch(self, state, batch, hold, again=None):
        state, flight = super()._dispatch(state, batch, hold, again)
        Recording.events.append(("dispatch", Recording.steps[id(batch)]))
        Recording.steps[id(flight.raw)] = Recording.steps[id(batch)]
        return state, flight

    def _read(self, raw):
        Recording.events.append(("read", Recording.steps[id(raw)]))
        return super()._read(raw)


def arm(mp: pytest.MonkeyPatch, rows: dict[int, int]) -> None:
    """The loop runs the Recording stepper, and the batches of the steps in ``rows`` repeat
    one token in their first ``rows[step]`` rows."""
    Recording.events, Recording.steps = [], {}

    def batch(source, step, mesh):
        local = source.batch(step).copy()
        local[: rows.get(step + 1, 0)] = 65
        out = jax.make_array_from_process_local_data(sharding.batch_sharding(mesh), local)
        Recording.steps[id(out)] = step + 1
        return out

    mp.setattr(run_mod, "global_batch", batch)
    mp.setattr(run_mod, "BucketedStep", Recording)


def saved(out: Path, step: int) -> list[np.ndarray]:
    ck = checkpoint.Checkpointer(out, keep=10, use_async=False)
    try:
        return [np.asarray(x) for x in jax.tree.leaves(ck.restore_saved(step))]
    finally:
        ck.close()


def run_pair(tmp_path: Path, rows: dict[int, int], steps: int):
    """The same steps with worst-case buffers (factor 100), then with buckets 3.0, 3.875:
    (bucketed run, worst-case run, the bucketed run's events)."""
    with pytest.MonkeyPatch.context() as mp:
        arm(mp, rows)
        assert run_mod.run(ep_cfg("100", steps), tmp_path / "worst", log=lambda s: None) == EXIT_OK
        arm(mp, rows)
        assert run_mod.run(ep_cfg("3.0,3.875", steps), tmp_path / "bucketed", log=lambda s: None) == EXIT_OK
    return tmp_path / "bucketed", tmp_path / "worst", list(Recording.events)


@pytest.fixture(scope="module")
def two_in_a_row(tmp_path_factory):
    """Step 2 overflows 3.0, step 3 (held by 2, then run again) overflows 3.875; step 4,
    which would not overflow, is held by 3."""
    return run_pair(tmp_path_factory.mktemp("two-in-a-row"), {2: MID, 3: ALL}, steps=5)


@pytest.fixture(scope="module")
def first_and_last(tmp_path_factory):
    """The first step overflows 3.0, the last one (saved right after its rerun) 3.875."""
    return run_pair(tmp_path_factory.mktemp("first-last"), {1: MID, 4: ALL}, steps=4)


def same_fields(out: Path) -> list[dict]:
    return [{k: r[k] for k in SAME} for r in records(out)]


def assert_same_records(pair) -> None:
    """The bucketed run of a ``run_pair`` logged what its worst-case run logged."""
    bucketed, worst, _ = pair
    assert same_fields(bucketed) == same_fields(worst)


def assert_same_state(pair, step: int) -> None:
    """The bucketed run of a ``run_pair`` saved at ``step`` what its worst-case run saved."""
    bucketed, worst, _ = pair
    for ours, ref in zip(saved(bucketed, step), saved(worst, step), strict=True):
        np.testing.assert_array_equal(ours, ref)


def reruns(pair) -> list[tuple]:
    """(bucket, reruns) of each step of the bucketed run of a ``run_pair``."""
    return [(r["ep_bucket"], r["ep_overflow_reruns"]) for r in records(pair[0])]


def test_records_match_worst_case_buffers_when_steps_overflow_in_a_row(two_in_a_row):
    assert_same_records(two_in_a_row)


def test_final_state_matches_worst_case_buffers_when_steps_overflow_in_a_row(two_in_a_row):
    assert_same_state(two_in_a_row, 5)


def test_steps_in_a_row_rerun_once_per_bucket(two_in_a_row):
    assert reruns(two_in_a_row) == [(3.0, 0), (3.875, 1), ("worst", 2), ("worst", 2), ("worst", 2)]


def test_a_held_step_is_dropped_and_dispatched_again_after_the_rerun(two_in_a_row):
    assert two_in_a_row[2] == [
        ("dispatch", 1),
        ("read", 1),  # the first step is confirmed at once
        ("dispatch", 2),
        ("dispatch", 3),
        ("read", 2),  # 2 overflowed: 3 was held
        ("dispatch", 2),
        ("dispatch", 3),
        ("read", 2),  # 2 reruns, then 3 again
        ("dispatch", 4),
        ("read", 3),  # 3 overflowed: 4 was held
        ("dispatch", 3),
        ("dispatch", 4),
        ("read", 3),
        ("dispatch", 5),
        ("read", 4),
        ("read", 5),
    ]  # 5 is the last step: confirmed at once


def test_first_and_last_step_each_rerun(first_and_last):
    assert reruns(first_and_last) == [(3.875, 1), (3.875, 1), (3.875, 1), ("worst", 2)]
    assert first_and_last[2][-3:] == [("read", 4), ("dispatch", 4), ("read", 4)]


def test_first_and_last_step_overflows_change_no_record(first_and_last):
    assert_same_records(first_and_last)


def test_a_checkpoint_right_after_an_overflowed_step_holds_the_rerun(first_and_last):
    assert_same_state(first_and_last, 4)


def test_one_device_dispatches_each_step_before_reading_the_one_before(tmp_path, monkeypatch):
    arm(monkeypatch, {})
    assert run_mod.run(cfg_for("parallel.devices=1"), tmp_path, log=lambda s: None) == EXIT_OK
    assert Recording.events == [
        ("dispatch", 1),
        ("read", 1),
        ("dispatch", 2),
        ("dispatch", 3),
        ("read", 2),
        ("dispatch", 4),
        ("read", 3),
        ("read", 4),
    ]
