"""Config: presets, dotted overrides, validation messages."""

import dataclasses
import json
import tomllib
import typing

import pytest
from helpers import train_cli

from moe_train import config
from moe_train.config import ConfigError
from moe_train.config import checks as config_checks


def test_unknown_preset_lists_valid_presets():
    with pytest.raises(ConfigError, match="valid presets: .*tiny"):
        config.build("tinyy")


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown key moe\.topk; valid keys in \[moe\]: .*top_k"):
        config.build("tiny", ["moe.topk=2"])


def test_unknown_section_lists_sections():
    with pytest.raises(ConfigError, match="valid sections: model, moe, data"):
        config.build("tiny", ["mo.top_k=2"])


def test_override_without_dot_is_rejected():
    with pytest.raises(ConfigError, match="section.key=value"):
        config.build("tiny", ["top_k=2"])


def test_override_parses_by_field_type():
    cfg = config.build(
        "tiny", ["moe.top_k=3", "optim.lr=1e-4", "model.qk_norm=true", "data.source=synthetic"]
    )
    assert (cfg.moe.top_k, cfg.optim.lr, cfg.model.qk_norm, cfg.data.source) == (3, 1e-4, True, "synthetic")


def test_bad_value_type_names_the_key():
    with pytest.raises(ConfigError, match="moe.top_k: expected int"):
        config.build("tiny", ["moe.top_k=two"])


def test_top_k_larger_than_experts():
    with pytest.raises(ConfigError, match="top_k=9 is larger than moe.num_experts=8"):
        config.build("tiny", ["moe.top_k=9"])


def test_heads_not_dividing_hidden_lists_valid_heads():
    with pytest.raises(
        ConfigError, match=r"num_heads=5 does not divide model.hidden=64; valid num_heads: 1, 2, 4"
    ):
        config.build("tiny", ["model.num_heads=5", "model.num_kv_heads=1"])


def test_explicit_head_dim_allows_any_heads():
    cfg = config.build("tiny", ["model.num_heads=6", "model.num_kv_heads=2", "model.head_dim=16"])
    assert config.head_dim(cfg.model) == 16


def test_bad_choice_lists_choices():
    with pytest.raises(ConfigError, match="choose one of: auto, tiled, ragged_dot, mgpu, te"):
        config.build("tiny", ["moe.backend=cuda"])


def test_group_routing_checks_divisibility():
    with pytest.raises(ConfigError, match="num_groups=3 does not divide"):
        config.build("tiny", ["moe.num_groups=3", "moe.group_top_k=1"])


def test_round_trip_through_dict():
    cfg = config.build("tiny", ["moe.top_k=1"])
    assert config.from_dict(config.to_dict(cfg)) == cfg


def test_every_field_has_a_comment():
    import inspect

    sections = [type(getattr(config.Config(), f.name)) for f in dataclasses.fields(config.Config)]
    for section in (*sections, config.Config):
        lines = inspect.getsource(section).splitlines()
        for field in dataclasses.fields(section):
            i = next(i for i, l in enumerate(lines) if l.strip().startswith(f"{field.name}:"))
            commented = "#" in lines[i] or lines[i - 1].strip().startswith("#")  # same line or above
            assert commented, f"{section.__name__}.{field.name} has no comment"


def test_cluster_preset_gives_the_mfu_peak():
    from topology.presets import load

    assert load("h100-dgx").peak_flops("bfloat16") == 989e12
    assert load("cpu-local").peak_flops("bfloat16") is None  # nominal numbers are no peak


@pytest.mark.parametrize(
    "key, valid",
    [
        ("model.dtype", "param_dtype"),  # never shipped: precision.compute
        ("moe.chunks", "overlap_chunks"),  # never shipped: moe.overlap_chunks
        ("moe.router", "top_k"),  # study.router
        ("moe.capacity_factor", "top_k"),  # study.capacity_factor
    ],
)
def test_a_key_that_is_not_in_the_schema_is_an_unknown_key(key, valid):
    """No shims: --set, a preset table and a stored config all get the unknown-key error,
    which lists the section's valid keys."""
    section, field = key.split(".")
    needle = rf"^unknown key {section}\.{field}; valid keys in \[{section}\]: .*\b{valid}\b"
    with pytest.raises(ConfigError, match=needle):
        config.build("tiny", [f"{key}=1"])
    with pytest.raises(ConfigError, match=needle):
        config.apply_tables(config.Config(), {section: {field: 1}})
    with pytest.raises(ConfigError, match=needle):
        config.from_dict({section: {field: 1}})


def test_bad_precision_lists_choices():
    with pytest.raises(
        ConfigError, match="precision.compute='fp16' is not valid; choose one of: fp32, bf16, fp8"
    ):
        config.build("tiny", ["precision.compute=fp16"])


def test_mxfp8_needs_transformer_engine():
    with pytest.raises(ConfigError, match="mxfp8 needs Transformer Engine.*delayed, current"):
        config.build(
            "tiny", ["precision.compute=fp8", "precision.fp8_recipe=mxfp8", "precision.fp8_backend=xla"]
        )


def test_micro_batch_size_and_micro_batches_are_exclusive():
    with pytest.raises(config.ConfigError, match="set one of them"):
        config.build("tiny", ["train.micro_batch_size=2", "train.micro_batches=2"])


def test_micro_batch_size_becomes_micro_batches_for_the_job():
    cfg = config.build("tiny", ["train.micro_batch_size=2"])  # batch 8
    assert config.for_devices(cfg, 2).train.micro_batches == 2
    assert config.for_devices(cfg, 1).train.micro_batches == 4


# --- ranges of every numeric field, size limits, buckets, flags (issue #19 item 6) ---


def _numeric_keys() -> set[str]:
    names = {f.name: type(getattr(config.Config(), f.name)) for f in dataclasses.fields(config.Config)}
    keys = set()
    for section, cls in names.items():
        hints = typing.get_type_hints(cls)
        keys |= {f"{section}.{f.name}" for f in dataclasses.fields(cls) if hints[f.name] in (int, float)}
    return keys


def test_every_numeric_field_has_a_range():
    missing = _numeric_keys() - set(config_checks.RANGES)
    assert not missing, f"no range in config_checks.RANGES for: {sorted(missing)}"


def test_every_range_names_a_real_numeric_field():
    assert set(config_checks.RANGES) <= _numeric_keys()


def test_every_choice_names_a_real_field():
    for key in config.CHOICES:
        section, field = key.split(".")
        assert hasattr(getattr(config.Config(), section), field), key


FREE_TEXT = {
    "data.path",
    "parallel.cluster",
    "parallel.coordinator",
    "train.wandb_project",
    "train.init_from",
}


def test_every_str_field_has_choices_or_is_free_text():
    for section in (f.name for f in dataclasses.fields(config.Config)):
        cls = type(getattr(config.Config(), section))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            if hints[f.name] is str:
                assert key in config.CHOICES or key in FREE_TEXT, f"{key}: no choices"


def test_the_job_rules_import_first_and_without_jax():
    """jobplan builds on config.checks and config.schema, which never import it back."""
    import subprocess
    import sys

    code = (
        "import sys, moe_train.parallel.jobplan; "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')]"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_defaults_are_inside_their_ranges():
    config.validate(config.Config())


BAD = [
    "optim.lr=nan",
    "optim.lr=inf",
    "optim.lr=0",
    "optim.b1=2",
    "optim.b1=1",
    "optim.b2=-0.1",
    "optim.eps=-1e-8",
    "optim.eps=0",
    "optim.warmup_steps=-1",
    "optim.decay_steps=-1",
    "optim.grad_clip=nan",
    "optim.grad_clip=-1",
    "optim.min_lr_ratio=1.5",
    "optim.weight_decay=-0.1",
    "optim.weight_decay=inf",
    "train.checkpoint_every=-1",
    "train.steps=0",
    "train.batch_size=0",
    "train.batch_size=1000000000000000",
    "train.seq_len=-4",
    "train.seed=-1",
    "train.keep_checkpoints=0",
    "train.log_every=0",
    "train.telemetry_interval_s=-1",
    "train.telemetry_interval_s=nan",
    "train.micro_batches=0",
    "train.micro_batch_size=-1",
    "train.loss_chunk=-1",
    "train.max_nonfinite_skips=0",
    "model.hidden=99999999999",
    "model.vocab_size=0",
    "model.num_layers=0",
    "model.head_dim=-1",
    "model.rope_theta=0",
    "model.rope_theta=inf",
    "model.norm_eps=0",
    "model.norm_eps=-1e-6",
    "model.attention_block=-1",
    "model.first_dense_layers=-1",
    "moe.bias_update_rate=-0.1",
    "moe.bias_update_rate=nan",
    "moe.aux_loss_coef=-1",
    "moe.seq_aux_loss_coef=inf",
    "moe.z_loss_coef=-0.001",
    "moe.routed_scaling=0",
    "moe.overlap_chunks=0",
    "moe.tile_rows=-1",
    "moe.bucket_step_down_after=0",
    "moe.num_groups=-1",
    "data.seed=-1",
    "parallel.devices=-1",
    "parallel.ep=0",
    "parallel.dp=-1",
    "parallel.domain_size=-1",
    "parallel.num_processes=-1",
    "parallel.process_id=-2",
    "parallel.init_timeout_s=0",
    "parallel.heartbeat_timeout_s=0",
    "precision.amax_history=0",
    "precision.amax_history=100000",
    "precision.margin=-1",
    "precision.margin=17",
]


@pytest.mark.parametrize("item", BAD)
def test_out_of_range_value_names_the_key_and_the_range(item):
    key = item.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=\S+ is not valid; expected an? (integer|finite)"):
        config.build("tiny", [item])


@pytest.mark.parametrize(
    "item",
    [
        "optim.b1=0",
        "optim.min_lr_ratio=1",
        "optim.grad_clip=0",
        "train.checkpoint_every=0",
        "parallel.process_id=-1",
        "precision.margin=16",
        "moe.aux_loss_coef=0",
    ],
)
def test_range_edges_are_accepted(item):
    config.build("tiny", [item])


def test_float_range_message_says_the_interval():
    with pytest.raises(ConfigError, match=r"optim.b1=2.0 is not valid; expected a finite number in \[0, 1\)"):
        config.build("tiny", ["optim.b1=2"])


def test_int_range_message_says_the_bounds():
    with pytest.raises(
        ConfigError, match=r"model.hidden=99999999999 is not valid; expected an integer in 1..2147483647"
    ):
        config.build("tiny", ["model.hidden=99999999999"])


@pytest.mark.parametrize(
    "items, formula",
    [
        (["train.batch_size=65536", "train.seq_len=65536"], r"train.batch_size\*train.seq_len="),
        (
            ["model.vocab_size=2000000", "model.hidden=2048", "model.num_heads=8", "model.num_kv_heads=8"],
            r"model.vocab_size\*model.hidden=",
        ),
        (["moe.expert_ffn=1000000", "model.hidden=4096"], r"moe.expert_ffn\*model.hidden="),
        (["model.dense_ffn=1000000000"], r"model.hidden\*model.dense_ffn="),
    ],
)
def test_sizes_beyond_int32_are_config_errors(items, formula):
    with pytest.raises(ConfigError, match=rf"{formula}\d+ \(.*\) is too large: at most 2147483647"):
        config.build("tiny", items)


def test_expert_size_limit_counts_one_ep_shard():
    items = ["moe.num_experts=64", "moe.expert_ffn=8192", "model.hidden=8192"]  # 4.3e9 elements
    with pytest.raises(ConfigError, match="raise parallel.ep"):
        config.build("tiny", items)
    config.build("tiny", items + ["parallel.ep=4"])


def test_heads_message_for_a_huge_width_is_quick():
    with pytest.raises(ConfigError, match="model.hidden"):
        config.build("tiny", ["model.hidden=99999999999", "model.num_heads=7"])


def test_micro_batches_message_lists_some_divisors():
    with pytest.raises(
        ConfigError, match=r"choose one of \[1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 16, 20, \.\.\.\]"
    ):
        config.build("tiny", ["train.batch_size=15360", "train.micro_batches=7"])


@pytest.mark.parametrize(
    "n, expected",
    [
        (1, [1]),
        (12, [1, 2, 3, 4, 6, 12]),
        (97, [1, 97]),
        (0, []),
        (-4, []),
        (2**31 - 1, [1, 2**31 - 1]),
        (15360, [1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 16, 20]),
        (
            99999999999,
            [1, 3, 9, 21649, 64947, 194841, 513239, 1539717, 4619151, 11111111111, 33333333333, 99999999999],
        ),
    ],
)
def test_some_divisors(n, expected):
    assert config.some_divisors(n) == expected


def test_some_divisors_of_a_huge_prime_is_bounded():
    assert config.some_divisors(2**89 - 1, limit=3) == [1, 2**89 - 1]  # prime; 10**6 trials


def test_some_divisors_respects_the_limit():
    assert config.some_divisors(720720, limit=4) == [1, 2, 3, 4]


@pytest.mark.parametrize("text", ["", "1.0,x", "0,1.0", "-1", "1.0,nan", "inf", ",".join(["1.5"] * 17)])
def test_bad_capacity_buckets_are_refused_up_front(text):
    with pytest.raises(ConfigError, match="moe.capacity_buckets="):
        config.build("tiny", [f"moe.capacity_buckets={text}"])


def test_set_capacity_buckets_gives_a_sorted_tuple():
    cfg = config.build("tiny", ["moe.capacity_buckets=2.0, 1.0,1.5"])
    assert cfg.moe.capacity_buckets == (1.0, 1.5, 2.0)


def test_capacity_buckets_default_is_a_tuple_of_floats():
    assert config.MoEConfig().capacity_buckets == (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def test_config_json_lists_the_buckets_and_reads_them_back(tmp_path):
    cfg = config.build("tiny", ["moe.capacity_buckets=1.25,3"])
    config.save_json(cfg, tmp_path / "config.json")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["moe"]["capacity_buckets"] == [1.25, 3.0]
    assert config.from_dict(saved) == cfg


def test_old_config_json_with_comma_separated_buckets_still_loads():
    cfg = config.from_dict({"moe": {"capacity_buckets": "2.0,1.0,1.25"}})
    assert cfg.moe.capacity_buckets == (1.0, 1.25, 2.0)


def test_toml_array_of_buckets_is_sorted_floats():
    cfg = config.apply_tables(config.Config(), tomllib.loads("[moe]\ncapacity_buckets = [2, 1.5]"))
    assert cfg.moe.capacity_buckets == (1.5, 2.0)


def test_malformed_buckets_text_names_the_key_and_an_example():
    with pytest.raises(
        ConfigError,
        match=r"^moe.capacity_buckets='1,x': expected comma-separated "
        r"numbers such as 1.0,1.25,1.5,2.0$",
    ):
        config.build("tiny", ["moe.capacity_buckets=1,x"])


def test_buckets_list_of_non_numbers_is_refused():
    with pytest.raises(ConfigError, match="moe.capacity_buckets: expected a list of numbers"):
        config.from_dict({"moe": {"capacity_buckets": ["a"]}})


def test_same_buckets_written_two_ways_do_not_disagree():
    flags = {"--x": ("moe.capacity_buckets", "1.0,2.0")}
    config.build("tiny", ["moe.capacity_buckets=1,2"], flags=flags)


def test_on_nonfinite_lists_choices():
    with pytest.raises(
        ConfigError, match="train.on_nonfinite='ignore' is not valid; choose one of: stop, skip"
    ):
        config.build("tiny", ["train.on_nonfinite=ignore"])


def test_on_nonfinite_defaults():
    cfg = config.build("tiny", ["train.on_nonfinite=skip"])
    assert (cfg.train.on_nonfinite, cfg.train.max_nonfinite_skips) == ("skip", 10)


def test_flag_and_set_disagreeing_is_one_error_naming_both():
    with pytest.raises(ConfigError, match=r"^--devices 2 and --set parallel.devices=4 disagree; give one$"):
        config.build("tiny", ["parallel.devices=4"], flags={"--devices": ("parallel.devices", "2")})


def test_set_twice_disagreeing_on_a_command_line_is_one_error():
    with pytest.raises(ConfigError, match=r"--set moe.top_k=1 and --set moe.top_k=2 disagree"):
        config.build("tiny", ["moe.top_k=1", "moe.top_k=2"], flags={})


def test_code_composing_overrides_lets_the_later_one_win():
    assert config.build("tiny", ["moe.top_k=1", "moe.top_k=2"]).moe.top_k == 2


def test_same_value_twice_is_fine():
    cfg = config.build("tiny", ["optim.lr=0.001"], flags={"--lr": ("optim.lr", "1e-3")})
    assert cfg.optim.lr == 1e-3


def test_flags_are_applied_like_overrides():
    cfg = config.build(
        "tiny", flags={"--devices": ("parallel.devices", "2"), "--steps": ("train.steps", "5")}
    )
    assert (cfg.parallel.devices, cfg.train.steps) == (2, 5)


def test_flag_values_are_validated():
    with pytest.raises(ConfigError, match="parallel.devices=-1 is not valid"):
        config.build("tiny", flags={"--devices": ("parallel.devices", "-1")})


def test_cli_bad_range_prints_one_line_and_exits_2(tmp_path):
    proc = train_cli(tmp_path / "x", "--set", "optim.b1=2", timeout=120)
    assert (proc.returncode, proc.stderr.count("\n"), proc.stdout) == (2, 1, "")
    assert proc.stderr.startswith("error: optim.b1=2.0 is not valid")


def test_a_preset_file_that_is_not_toml_is_a_config_error_naming_it(tmp_path):
    bad = tmp_path / "preset.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match=rf"^preset {bad}: not valid TOML"):
        config.load_preset(str(bad))


def test_megablox_tile_rows_off_its_row_multiple_are_refused_up_front():
    with pytest.raises(ConfigError, match=r"moe.tile_rows=100: megablox .* choose e.g. 96 or 0"):
        config.build("tiny", ["moe.backend=megablox", "moe.tile_rows=100"])
