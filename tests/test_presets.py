"""Every shipped preset loads, validates, documents itself, and the published ones match."""

from __future__ import annotations

import tomllib

import pytest

from moe_train import config

PRESETS = config.list_presets()
BIG = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")


def test_expected_presets_exist():
    for name in ("tiny", "small", *BIG):
        assert name in PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_builds_and_validates(name):
    cfg = config.build(name)
    config.validate(cfg)
    # every key in the file is a real config key with the file's value
    with (config.PRESET_DIR / f"{name}.toml").open("rb") as f:
        tables = tomllib.load(f)
    for section, values in tables.items():
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"


@pytest.mark.parametrize("name", PRESETS)
def test_preset_has_header_comment(name):
    lines = (config.PRESET_DIR / f"{name}.toml").read_text().splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    assert len(header) >= 2, f"{name}.toml needs a comment header saying what the model is"
    assert header[0].startswith(f"# {name}:")


# Mixtral's and Qwen3's router: a softmax over the experts, the top k renormalised; no shared
# experts, groups, scaling or bias updates
SOFTMAX_ROUTER = {
    "moe.num_shared_experts": 0,
    "moe.score_function": "softmax",
    "moe.normalize_top_k": True,
    "moe.num_groups": 0,
    "moe.routed_scaling": 1.0,
    "moe.bias_update_rate": 0.0,
}
# Published shapes (model papers and released Hugging Face configs).
PUBLISHED = {
    "mixtral-8x7b": {
        "model.vocab_size": 32000,
        "model.hidden": 4096,
        "model.num_layers": 32,
        "model.num_heads": 32,
        "model.num_kv_heads": 8,
        "model.rope_theta": 1e6,
        "model.norm_eps": 1e-5,
        "model.tie_embeddings": False,
        "model.qk_norm": False,
        "model.first_dense_layers": 0,
        "moe.num_experts": 8,
        "moe.top_k": 2,
        "moe.expert_ffn": 14336,
        **SOFTMAX_ROUTER,
        "moe.aux_loss_coef": 0.02 * 2,  # router_aux_loss_coef x top_k: the same penalty
    },
    "qwen3-30b-a3b": {
        "model.vocab_size": 151936,
        "model.hidden": 2048,
        "model.num_layers": 48,
        "model.num_heads": 32,
        "model.num_kv_heads": 4,
        "model.head_dim": 128,
        "model.qk_norm": True,
        "model.rope_theta": 1e6,
        "model.norm_eps": 1e-6,
        "model.tie_embeddings": False,
        "model.first_dense_layers": 0,
        "moe.num_experts": 128,
        "moe.top_k": 8,
        "moe.expert_ffn": 768,
        **SOFTMAX_ROUTER,
        "moe.aux_loss_coef": 0.001 * 8,  # router_aux_loss_coef x top_k: the same penalty
    },
    "deepseek-v3": {
        "model.vocab_size": 129280,
        "model.hidden": 7168,
        "model.num_layers": 61,
        "model.num_heads": 128,
        "model.first_dense_layers": 3,
        "model.attention_kind": "mla",
        "model.q_lora_rank": 1536,
        "model.kv_lora_rank": 512,
        "model.qk_nope_head_dim": 128,
        "model.qk_rope_head_dim": 64,
        "model.v_head_dim": 128,
        "model.mtp_depth": 1,
        "rope.layout": "interleaved",
        "model.rope_theta": 10000.0,
        "model.dense_ffn": 18432,
        "model.tie_embeddings": False,
        "model.norm_eps": 1e-6,
        "moe.num_experts": 256,
        "moe.top_k": 8,
        "moe.expert_ffn": 2048,
        "moe.num_shared_experts": 1,
        "moe.shared_ffn": 2048,
        "moe.score_function": "sigmoid",
        "moe.normalize_top_k": True,
        "moe.num_groups": 8,
        "moe.group_top_k": 4,
        "moe.routed_scaling": 2.5,
        "moe.bias_update_rate": 0.001,
        "moe.seq_aux_loss_coef": 0.0001,
        "moe.aux_loss_coef": 0.0,
    },
}


@pytest.mark.parametrize("name", BIG)
def test_big_presets_match_published(name):
    cfg = config.build(name)
    for dotted, expected in PUBLISHED[name].items():
        section, key = dotted.split(".")
        assert getattr(getattr(cfg, section), key) == expected, f"{name}: {dotted}"


@pytest.mark.parametrize("name", BIG)
def test_big_presets_are_bf16_and_synthetic_by_default(name):
    cfg = config.build(name)
    assert cfg.precision.compute == "bf16"
    assert cfg.data.source == "synthetic"


def test_deepseek_preset_is_the_real_architecture_and_the_gqa_stand_in_is_gone():
    text = (config.PRESET_DIR / "deepseek-v3.toml").read_text()
    assert "Multi-head Latent Attention" in text and "GQA" not in text
    assert "deepseek-v3-moe" not in PRESETS
