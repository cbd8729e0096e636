"""moe_train.parallel.jobplan: the job rules every other module asks (no JAX needed)."""

import subprocess
import sys

import pytest

from moe_train.config.checks import ConfigError
from moe_train.parallel import jobplan
from moe_train.parallel.jobplan import BucketPolicy


def test_importing_jobplan_does_not_import_jax():
    code = "import sys, moe_train.parallel.jobplan; assert 'jax' not in sys.modules, 'jax imported'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ----------------------------------------------------------------------------- slots and stages


@pytest.mark.parametrize("factor, balanced", [(1.0, 3.0), (1.25, 100.0), (2.0, 17.5), (4.0, 1.0)])
def test_bucket_slots_are_a_multiple_of_8(factor, balanced):
    assert jobplan.bucket_slots(factor, balanced, 10**6) % 8 == 0


def test_bucket_slots_are_capped_at_the_worst_case():
    assert jobplan.bucket_slots(4.0, 100.0, 50) == 50


def test_bucket_slots_cover_the_factor_times_the_balanced_load():
    assert jobplan.bucket_slots(1.25, 100.0, 10**6) == 128  # 125 rounded up to 8


def test_worst_case_factor_is_the_worst():
    assert jobplan.bucket_slots(None, 100.0, 77) == 77


def test_a2a_worst_case_is_every_token_min_k_l_times():
    stage = jobplan.a2a_stage(tokens=64, top_k=4, local_experts=2, ep=8, factor=None)
    assert (stage.slots, stage.balanced, stage.peers) == (64 * 2, 64 * 4 / 8, 8)


def test_domain_hit_of_one_domain_is_certain():
    assert jobplan.domain_hit(1, 2) == 1.0


def test_hierarchical_stage_sizes():
    T, K, L, G, D = 64, 2, 2, 2, 4
    one, two = jobplan.hierarchical_stages(T, K, L, G, D, factor=1.0)
    assert one.balanced == T * jobplan.domain_hit(G, K) and one.peers == G
    assert one.slots == jobplan.bucket_slots(1.0, T * 0.75, T)
    assert two.balanced == T * K / D and two.peers == D
    assert two.slots == jobplan.bucket_slots(1.0, T * K / D, G * one.slots * min(K, L))


def test_hierarchical_worst_case_stage_one_takes_every_token():
    one, two = jobplan.hierarchical_stages(64, 2, 2, 2, 4, factor=None)
    assert one.slots == 64 and two.slots == 2 * 64 * 2


# ----------------------------------------------------------------------------- dispatcher


@pytest.mark.parametrize(
    "requested, devices, ep, domains, chosen",
    [
        ("auto", 1, 1, 1, "local"),
        ("a2a", 8, 1, 1, "local"),
        ("auto", 8, 8, 1, "a2a"),
        ("auto", 8, 8, 2, "hierarchical"),
        ("allgather", 8, 4, 2, "allgather"),
        ("a2a", 8, 8, 2, "a2a"),
        ("hierarchical", 8, 8, 2, "hierarchical"),
    ],
)
def test_dispatcher_choice(requested, devices, ep, domains, chosen):
    assert jobplan.dispatcher(requested, devices, ep, domains) == chosen


def test_hierarchical_in_one_domain_names_the_key_and_the_way_out():
    with pytest.raises(
        ConfigError,
        match=r"moe.dispatcher=hierarchical needs an EP group spanning "
        r"several domains: parallel.ep=4 .*use moe.dispatcher=a2a",
    ):
        jobplan.dispatcher("hierarchical", 8, 4, 1)


def test_unknown_dispatcher_lists_the_choices():
    with pytest.raises(ConfigError, match="choose one of: auto, allgather, a2a, hierarchical"):
        jobplan.dispatcher("ragged", 8, 8, 1)


@pytest.mark.parametrize("name", ["a2a", "hierarchical"])
def test_bucketed_dispatchers_compile_every_bucket_then_the_worst(name):
    assert jobplan.bucket_factors(name, (2.0, 1.0)) == (1.0, 2.0, None)


@pytest.mark.parametrize("name", ["local", "allgather"])
def test_other_dispatchers_compile_the_worst_case_only(name):
    assert jobplan.bucket_factors(name, (1.0, 2.0)) == (None,)


# ----------------------------------------------------------------------------- bucket policy


def test_policy_escalates_on_overflow():
    policy = BucketPolicy((1.0, 2.0, None), step_down_after=3)
    policy.overflowed()
    assert (policy.factor, policy.reruns) == (2.0, 1)


def test_policy_steps_down_after_n_fitting_steps():
    policy = BucketPolicy((1.0, 2.0, None), step_down_after=3)
    policy.overflowed()
    for _ in range(2):
        policy.finished(max_pair_load=0.9)
    assert policy.factor == 2.0
    policy.finished(max_pair_load=0.9)
    assert policy.factor == 1.0


def test_policy_a_step_that_would_not_fit_restarts_the_count():
    policy = BucketPolicy((1.0, 2.0, None), step_down_after=2)
    policy.overflowed()
    for load in (0.9, 1.5, 0.9):
        policy.finished(load)
    assert policy.factor == 2.0


def test_policy_never_goes_below_the_smallest_bucket():
    policy = BucketPolicy((1.0, None), step_down_after=1)
    for _ in range(5):
        policy.finished(0.1)
    assert policy.bucket == 0


def test_policy_raises_when_the_worst_case_overflows():
    policy = BucketPolicy((1.0, None), step_down_after=1)
    policy.overflowed()
    with pytest.raises(RuntimeError, match="worst-case bucket overflowed"):
        policy.overflowed()


def test_policy_needs_the_worst_case_last():
    with pytest.raises(ValueError, match="must end with the worst case None"):
        BucketPolicy((1.0, 2.0), step_down_after=1)


# ----------------------------------------------------------------------------- divisibility


def test_ep_not_dividing_the_devices_lists_valid_ep():
    with pytest.raises(
        ConfigError,
        match=r"^parallel.ep=3 does not divide the 8 devices; valid ep "
        r"\(dividing them and moe.num_experts=4\): 1, 2, 4$",
    ):
        jobplan.check_ep(8, 3, 4)


def test_ep_not_dividing_the_experts_lists_valid_ep():
    with pytest.raises(
        ConfigError,
        match=r"^moe.num_experts=8 is not divisible by parallel.ep=3; "
        r"valid ep for 6 devices: 1, 2$",
    ):
        jobplan.check_ep(6, 3, 8)


@pytest.mark.parametrize(
    "devices, ep, experts, fault",
    [(8, 4, 8, None), (8, 3, 8, "devices"), (8, 0, 8, "devices"), (8, 8, 4, "experts")],
)
def test_ep_fault_names_the_broken_rule(devices, ep, experts, fault):
    assert jobplan.ep_fault(devices, ep, experts) == fault


def test_dp_zero_follows_the_devices():
    assert jobplan.check_dp(8, 2, 0) == 4


def test_dp_that_does_not_multiply_to_the_devices_names_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"^parallel.dp=3 x parallel.ep=2 = 6 but the mesh has 8 "
        r"devices; set parallel.dp=4 \(or 0\)$",
    ):
        jobplan.check_dp(8, 2, 3)


def test_width_not_divisible_by_dp_lists_valid_sizes():
    with pytest.raises(
        ConfigError,
        match=r"^model.hidden=12 is not divisible by the data-parallel "
        r"size 8 .*valid data-parallel sizes: 1, 2, 3, 4, 6, 12$",
    ):
        jobplan.check_width(12, 8)


def test_batch_not_divisible_by_the_devices_lists_device_counts():
    with pytest.raises(
        ConfigError,
        match=r"^train.batch_size=6 is not divisible by 4 devices; "
        r"nearest that are: 4 or 8 \(or parallel.devices in "
        r"\[1, 2, 3\]\)$",
    ):
        jobplan.check_batch(6, 4)


def test_batch_not_divisible_names_the_tokens_per_step_of_the_nearest_sizes():
    with pytest.raises(
        ConfigError,
        match=r"nearest that are: 14336 \(58.7M tokens per step\) "
        r"or 16384 \(67.1M tokens per step\)",
    ):
        jobplan.check_batch(15360, 2048, seq_len=4096)


def test_micro_batches_not_dividing_the_rows_per_device_list_choices():
    with pytest.raises(
        ConfigError,
        match=r"^train.micro_batches=3 does not divide the 4 sequences "
        r"per device \(train.batch_size=8 over 2 devices\); "
        r"choose one of \[1, 2, 4\] or "
        r"train.batch_size=6 or 12$",
    ):
        jobplan.check_batch(8, 2, 3)


def test_sizes_that_divide_pass():
    jobplan.check_ep(8, 4, 8)
    jobplan.check_width(64, 2)
    jobplan.check_batch(8, 2, 2)
