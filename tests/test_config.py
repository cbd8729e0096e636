"""Config: presets, dotted overrides, validation messages."""

import dataclasses

import pytest

from moe_train import config
from moe_train.config import ConfigError


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
    cfg = config.build("tiny", ["moe.top_k=3", "optim.lr=1e-4", "model.qk_norm=true",
                                "data.source=synthetic"])
    assert (cfg.moe.top_k, cfg.optim.lr, cfg.model.qk_norm, cfg.data.source) == (3, 1e-4, True, "synthetic")


def test_bad_value_type_names_the_key():
    with pytest.raises(ConfigError, match="moe.top_k: expected int"):
        config.build("tiny", ["moe.top_k=two"])


def test_top_k_larger_than_experts():
    with pytest.raises(ConfigError, match="top_k=9 is larger than moe.num_experts=8"):
        config.build("tiny", ["moe.top_k=9"])


def test_heads_not_dividing_hidden_lists_valid_heads():
    with pytest.raises(ConfigError, match=r"num_heads=5 does not divide model.hidden=64; valid num_heads: 1, 2, 4"):
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

    for section in (config.ModelConfig, config.MoEConfig, config.DataConfig, config.OptimConfig,
                    config.TrainConfig, config.ParallelConfig, config.PrecisionConfig,
                    config.Config):
        source = inspect.getsource(section)
        for field in dataclasses.fields(section):
            line = next(l for l in source.splitlines() if l.strip().startswith(f"{field.name}:"))
            assert "#" in line, f"{section.__name__}.{field.name} has no comment"


def test_unknown_cluster_preset_names_the_valid_ones():
    with pytest.raises(config.ConfigError, match="parallel.cluster: unknown cluster preset 'h100'; valid presets: .*h100-dgx"):
        config.build("tiny", ["parallel.cluster=h100"])


def test_cluster_preset_gives_the_mfu_peak():
    from topology.presets import load
    assert load("h100-dgx").peak_flops("bfloat16") == 989e12
    assert load("cpu-local").peak_flops("bfloat16") is None  # nominal numbers are no peak


def test_model_dtype_moved_to_precision_compute():
    with pytest.raises(ConfigError, match=r"model.dtype moved to precision.compute; set "
                                          r"precision.compute=<fp32 \| bf16 \| fp8>"):
        config.build("tiny", ["model.dtype=bfloat16"])


def test_model_dtype_in_a_preset_table_is_refused_too():
    with pytest.raises(ConfigError, match="model.dtype moved to precision.compute"):
        config.apply_tables(config.Config(), {"model": {"dtype": "bfloat16"}})


def test_bad_precision_lists_choices():
    with pytest.raises(ConfigError, match="precision.compute='fp16' is not valid; choose one of: "
                                          "fp32, bf16, fp8"):
        config.build("tiny", ["precision.compute=fp16"])


def test_mxfp8_needs_transformer_engine():
    with pytest.raises(ConfigError, match="mxfp8 needs Transformer Engine.*delayed, current"):
        config.build("tiny", ["precision.compute=fp8", "precision.fp8_recipe=mxfp8",
                              "precision.fp8_backend=xla"])


def test_micro_batch_size_and_micro_batches_are_exclusive():
    with pytest.raises(config.ConfigError, match="set one of them"):
        config.build("tiny", ["train.micro_batch_size=2", "train.micro_batches=2"])


def test_micro_batch_size_becomes_micro_batches_for_the_job():
    cfg = config.build("tiny", ["train.micro_batch_size=2"])  # batch 8
    assert config.for_devices(cfg, 2).train.micro_batches == 2
    assert config.for_devices(cfg, 1).train.micro_batches == 4
