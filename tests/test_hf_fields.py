"""Every ``config.json`` field of Mixtral, Qwen3-MoE and DeepSeek-V3 is mapped into the kit's
config, checked, or known not to change the model (``moe_train/convert/fields.py``); any other
field or an unsupported value is refused with exit 2, naming it. The field lists are those of
transformers' config classes and of the released ``config.json`` files."""

import json

import pytest
from helpers import run_module

from moe_train.config import ConfigError
from moe_train.convert import fields
from moe_train.convert.families import FAMILIES, kit_tables

# The released config.json files (Mixtral-8x7B-v0.1, Qwen3-30B-A3B, DeepSeek-V3), as published.
RELEASED = {
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "initializer_range": 0.02,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_group": 8,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 129280,
    },
}
CONFIG_CLASSES = {
    "mixtral": "MixtralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
}

# (family, field, a value the kit cannot run)
REFUSED = [
    ("mixtral", "hidden_act", "gelu"),
    ("mixtral", "attention_dropout", 0.1),
    ("mixtral", "sliding_window", 4096),
    ("mixtral", "router_jitter_noise", 0.01),
    ("mixtral", "rope_theta_typo", 1.0),
    ("mixtral", "is_encoder_decoder", True),
    ("mixtral", "rope_scaling", {"type": "dynamic", "factor": 2.0}),
    ("qwen3_moe", "attention_bias", True),
    ("qwen3_moe", "use_sliding_window", True),
    ("qwen3_moe", "decoder_sparse_step", 2),
    ("qwen3_moe", "mlp_only_layers", [1]),
    ("qwen3_moe", "decoder_sparse_step", 0),
    ("qwen3_moe", "rope_parameters", {"rope_type": "llama3", "rope_theta": 1e6}),
    ("deepseek_v3", "scoring_func", "softmax"),
    ("deepseek_v3", "topk_method", "greedy"),
    ("deepseek_v3", "moe_layer_freq", 2),
    ("deepseek_v3", "num_key_value_heads", 8),
    ("deepseek_v3", "attention_bias", True),
    ("deepseek_v3", "quantization_config", {"quant_method": "fp8", "weight_block_size": [64, 64]}),
]


def test_every_field_says_how_it_is_handled():
    for family, table in fields.FIELDS.items():
        for key, field in table.items():
            assert field.use.startswith(("inert: ", "checked", "model.", "moe.", "rope.", "train.")), (
                family,
                key,
            )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_field_of_the_released_config_is_known(family):
    assert set(RELEASED[family]) <= set(fields.FIELDS[family])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_released_config_converts(family):
    tables, _ = kit_tables(FAMILIES[family], RELEASED[family], mtp=True)
    assert tables["model"]["num_layers"] == RELEASED[family]["num_hidden_layers"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_field_of_the_transformers_config_class_is_known(family):
    transformers = pytest.importorskip("transformers", reason="needs the interop extra")
    keys = set(getattr(transformers, CONFIG_CLASSES[family])().to_dict())
    assert keys <= set(fields.FIELDS[family]), sorted(keys - set(fields.FIELDS[family]))


@pytest.mark.parametrize("family,key,value", REFUSED)
def test_an_unsupported_value_or_unknown_field_is_refused_by_name(family, key, value):
    with pytest.raises(ConfigError, match=rf"config\.json: .*\b{key}\b"):
        kit_tables(FAMILIES[family], {**RELEASED[family], key: value}, mtp=False)


def test_the_cli_exits_2_naming_an_unknown_field(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**RELEASED["mixtral"], "moe_new_knob": 3}))
    proc = run_module("moe_train.convert", "from-hf", hf, tmp_path / "kit")
    assert proc.returncode == 2 and "moe_new_knob" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "kit").exists()


@pytest.mark.parametrize(
    "only,step,layers,dense",
    [([0], 1, 4, 1), ([0, 1], 1, 4, 2), ([], 2, 2, 1), ([], 1, 4, 0), ([0, 1, 2, 3], 1, 4, 4)],
)
def test_qwen3_dense_layers_become_the_first_dense_layers(only, step, layers, dense):
    hf = {
        **RELEASED["qwen3_moe"],
        "mlp_only_layers": only,
        "decoder_sparse_step": step,
        "num_hidden_layers": layers,
    }
    tables, sources = kit_tables(FAMILIES["qwen3_moe"], hf, mtp=False)
    assert tables["model"].get("first_dense_layers", 0) == dense
    if dense:
        assert tables["model"]["dense_ffn"] == 6144
        assert "mlp_only_layers" in sources["model.first_dense_layers"]


# ---------------------------------------------------------------- kit -> config.json (to-hf)


def exported(*overrides: str, preset: str = "tiny") -> dict:
    from moe_train import config
    from moe_train.convert.families import family_for, hf_config

    cfg = config.build(preset, list(overrides))
    return hf_config(family_for(cfg), cfg, "float32")


@pytest.mark.parametrize(
    "preset,overrides,family",
    [
        ("tiny", [], "mixtral"),
        ("tiny", ["model.qk_norm=true"], "qwen3_moe"),
        ("deepseek-v3-tiny", [], "deepseek_v3"),
    ],
)
def test_every_field_to_hf_writes_converts_back(preset, overrides, family):
    hf = exported(*overrides, preset=preset)
    assert hf["model_type"] == family and set(hf) <= set(fields.FIELDS[family])
    kit_tables(FAMILIES[family], hf, mtp=True)


def test_dense_first_layers_export_as_qwen3_mlp_only_layers():
    hf = exported("model.qk_norm=true", "model.first_dense_layers=1", "model.dense_ffn=96")
    assert hf["model_type"] == "qwen3_moe"
    assert hf["mlp_only_layers"] == [0] and hf["decoder_sparse_step"] == 1
    assert hf["intermediate_size"] == 96


def test_an_exported_config_converts_back_to_the_same_dense_layers():
    hf = exported("model.qk_norm=true", "model.first_dense_layers=1", "model.dense_ffn=96")
    tables, _ = kit_tables(FAMILIES["qwen3_moe"], hf, mtp=False)
    assert (tables["model"]["first_dense_layers"], tables["model"]["dense_ffn"]) == (1, 96)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.first_dense_layers=1"], "mixtral has no dense layers"),
        (["model.attention_kind=mla", "moe.score_function=softmax"], "sigmoid only"),
    ],
)
def test_a_config_no_family_expresses_is_refused_saying_why(overrides, match):
    with pytest.raises(ConfigError, match=match):
        exported(*overrides)
