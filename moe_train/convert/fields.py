"""Every ``config.json`` field of the supported families, and what ``from-hf`` does with it.

Each field is one of:

* **mapped**: read into the kit's config (``use`` names the kit key; ``families.kit_tables``
  does the reading), possibly with the values the kit can run (``ok``);
* **checked**: the kit has no such setting and runs one value only (``ok``, ``supported``):
  any other value is refused, naming the field;
* **inert**: it does not change what the weights compute (serialisation, generation,
  initialisation, parallelism hints, fields transformers derives from others).

A field in no table is refused too: a config from a newer release may carry a setting that
changes the model, and guessing would convert it silently wrong. The tables cover the fields of
transformers' config classes and of the released ``config.json`` files
(``tests/test_hf_fields.py`` lists them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from moe_train.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Field:
    """How one ``config.json`` field is handled."""

    use: str  # the kit key it maps to, "checked", or "inert: why"
    ok: Callable[[Any], bool] | None = None  # the values the kit runs (None: any)
    supported: str = ""  # those values, for the error


def mapped(to: str, ok: Callable[[Any], bool] | None = None, supported: str = "") -> Field:
    return Field(to, ok, supported)


def checked(supported: str, ok: Callable[[Any], bool]) -> Field:
    return Field("checked", ok, supported)


def inert(why: str) -> Field:
    return Field(f"inert: {why}")


def _rope_type_ok(params: dict) -> bool:
    return (params.get("rope_type") or params.get("type") or "default") in ("default", "yarn")


def _fp8_blocks_ok(q: dict) -> bool:
    blocks = list(q.get("weight_block_size") or [128, 128])
    return q.get("quant_method") == "fp8" and blocks == [128, 128]


ROPE = {
    "rope_parameters": mapped("model.rope_theta, rope.*", _rope_type_ok, "rope_type default or yarn"),
    "rope_theta": mapped("model.rope_theta"),
    "rope_scaling": mapped("rope.*", _rope_type_ok, "type default or yarn"),
}
COMMON = {
    **ROPE,
    "vocab_size": mapped("model.vocab_size"),
    "hidden_size": mapped("model.hidden"),
    "num_hidden_layers": mapped("model.num_layers"),
    "num_attention_heads": mapped("model.num_heads"),
    "rms_norm_eps": mapped("model.norm_eps"),
    "tie_word_embeddings": mapped("model.tie_embeddings"),
    "max_position_embeddings": mapped("train.seq_len (at most 4096)"),
    "num_experts_per_tok": mapped("moe.top_k"),
    "hidden_act": checked("the kit's MLPs are SwiGLU: silu", lambda v: v == "silu"),
    "attention_dropout": checked("the kit has no dropout: 0.0", lambda v: v == 0),
    "attention_bias": checked("no attention biases: false", lambda v: not v),
    "transformers_version": inert("the writer's version"),
    "architectures": inert("read with model_type to pick the family"),
    "model_type": inert("picks the family"),
    "dtype": inert("the tensors keep their own stored dtypes"),
    "torch_dtype": inert("the tensors keep their own stored dtypes"),
    "_name_or_path": inert("where transformers loaded it from"),
    "name_or_path": inert("where transformers loaded it from"),
    "initializer_range": inert("initialisation only: the weights come from the files"),
    "use_cache": inert("generation (KV cache)"),
    "pad_token_id": inert("the tokenizer's ids"),
    "bos_token_id": inert("the tokenizer's ids"),
    "eos_token_id": inert("the tokenizer's ids"),
    "tokenizer_class": inert("the tokenizer"),
    "output_hidden_states": inert("what transformers returns"),
    "output_attentions": inert("what transformers returns"),
    "output_router_logits": inert("what transformers returns"),
    "return_dict": inert("what transformers returns"),
    "chunk_size_feed_forward": inert("a memory setting of transformers' forward"),
    "is_encoder_decoder": checked("a decoder-only model: false", lambda v: not v),
    "id2label": inert("classification heads only"),
    "label2id": inert("classification heads only"),
    "problem_type": inert("classification heads only"),
    "auto_map": inert("remote-code class names"),
}
GQA = {
    "num_key_value_heads": mapped("model.num_kv_heads"),
    "head_dim": mapped("model.head_dim"),
    "router_aux_loss_coef": mapped("moe.aux_loss_coef (times top_k)"),
}
MIXTRAL = {
    **COMMON,
    **GQA,
    "intermediate_size": mapped("moe.expert_ffn"),
    "num_local_experts": mapped("moe.num_experts"),
    "num_experts": mapped("moe.num_experts"),
    "sliding_window": checked("full causal attention only: null", lambda v: False),
    "router_jitter_noise": checked("the kit's router adds no noise: 0.0", lambda v: v == 0),
}
QWEN3_MOE = {
    **COMMON,
    **GQA,
    "moe_intermediate_size": mapped("moe.expert_ffn"),
    "num_experts": mapped("moe.num_experts"),
    "num_local_experts": mapped("moe.num_experts"),
    "norm_topk_prob": mapped("moe.normalize_top_k"),
    "intermediate_size": mapped("model.dense_ffn (with dense layers)"),
    "mlp_only_layers": mapped("model.first_dense_layers (the dense layers must come first)"),
    "decoder_sparse_step": mapped(
        "model.first_dense_layers (the dense layers must come first)", lambda v: int(v) >= 1, "1 or more"
    ),
    "use_sliding_window": checked("full causal attention only: false", lambda v: not v),
    "sliding_window": inert("transformers drops it unless use_sliding_window (refused)"),
    "max_window_layers": inert("sliding windows only (use_sliding_window is refused)"),
}
DEEPSEEK_V3 = {
    **COMMON,
    "q_lora_rank": mapped("model.q_lora_rank"),
    "kv_lora_rank": mapped("model.kv_lora_rank"),
    "qk_nope_head_dim": mapped("model.qk_nope_head_dim"),
    "qk_rope_head_dim": mapped("model.qk_rope_head_dim"),
    "v_head_dim": mapped("model.v_head_dim"),
    "rope_interleave": mapped("rope.layout"),
    "first_k_dense_replace": mapped("model.first_dense_layers"),
    "intermediate_size": mapped("model.dense_ffn"),
    "n_routed_experts": mapped("moe.num_experts"),
    "num_local_experts": mapped("moe.num_experts"),
    "moe_intermediate_size": mapped("moe.expert_ffn, moe.shared_ffn"),
    "n_shared_experts": mapped("moe.num_shared_experts"),
    "norm_topk_prob": mapped("moe.normalize_top_k"),
    "n_group": mapped("moe.num_groups"),
    "topk_group": mapped("moe.group_top_k"),
    "routed_scaling_factor": mapped("moe.routed_scaling"),
    "aux_loss_alpha": mapped("moe.seq_aux_loss_coef"),
    "seq_aux": mapped("moe.seq_aux_loss_coef"),
    "num_nextn_predict_layers": mapped("model.mtp_depth (when the files hold the MTP layers)"),
    "scoring_func": mapped(
        "moe.score_function",
        lambda v: v == "sigmoid",
        "sigmoid (transformers' and the release's only choice)",
    ),
    "num_key_value_heads": Field("checked: MLA has num_attention_heads (check compares)"),
    "moe_layer_freq": checked("every layer after the dense ones MoE: 1", lambda v: v == 1),
    "topk_method": checked("noaux_tc (group-limited, the bias chooses only)", lambda v: v == "noaux_tc"),
    "quantization_config": checked("fp8 with 128x128 weight blocks", _fp8_blocks_ok),
    "head_dim": inert("transformers sets it to qk_rope_head_dim"),
    "qk_head_dim": inert("transformers sets it to qk_nope_head_dim + qk_rope_head_dim"),
    "pretraining_tp": inert("transformers' DeepSeek-V3 does not read it"),
    "ep_size": inert("the release's expert-parallel size (a launch setting)"),
}
FIELDS = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}


def check(family: str, hf: dict) -> None:
    """ConfigError naming the first field of ``hf`` the kit does not know for ``family`` or
    cannot run with its value."""
    table = FIELDS[family]
    unknown = sorted(k for k in hf if k not in table)
    if unknown:
        raise ConfigError(
            f"config.json: {', '.join(unknown)}: not a {family} field the kit knows "
            "(each field is mapped, checked or known not to change the model: "
            "moe_train/convert/fields.py)"
        )
    for key, field in table.items():
        value = hf.get(key)
        if field.ok is not None and value is not None and not field.ok(value):
            raise ConfigError(f"config.json: {key}={value!r} is not supported ({field.supported})")
    heads, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if family == "deepseek_v3" and kv is not None and kv != heads:
        raise ConfigError(
            f"config.json: num_key_value_heads={kv!r} is not supported (MLA: num_attention_heads={heads!r})"
        )
