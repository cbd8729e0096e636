"""The supported Hugging Face model families and their configs, both ways.

* Mixtral (``mixtral``): GQA; MoE tensors ``block_sparse_moe.experts.{e}.w1/w3/w2``; router
  softmax top-k, renormalised.
* Qwen3-MoE (``qwen3_moe``): GQA, qk-norm; MoE tensors
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj``; router softmax top-k (``norm_topk_prob``).
* DeepSeek-V3 (``deepseek_v3``): MLA; MoE tensors as Qwen3 + ``mlp.shared_experts``, first layers
  dense; router sigmoid, group-limited, ``e_score_correction_bias``.

``kit_tables(family, hf)`` turns a ``config.json`` into the kit's config sections, each value
with the HF key it came from (``preset.toml`` shows them as comments); ``hf_config(family,
cfg)`` is the inverse, for ``to-hf``. Anything the kit cannot run (another activation,
attention biases, sliding windows, a RoPE type other than default/yarn, dense layers that are
not the first ones) is a ConfigError naming the key; ``moe_train.convert.fields`` lists every
field of each family and how it is handled. The balance loss: Hugging Face's
``router_aux_loss_coef`` multiplies a loss top_k times the kit's (``moe.aux_loss_coef``), so the
kit's coefficient is theirs times top_k, and back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from moe_train.config import Config, ConfigError
from moe_train.convert import fields


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face architecture."""

    name: str  # model_type
    architecture: str  # config.json "architectures"
    moe_prefix: str  # module of the MoE layer in a decoder layer
    expert_names: tuple[str, str, str]  # gate (wi_0), up (wi_1), down (wo) of one expert


FAMILIES = {
    f.name: f
    for f in (
        Family("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
        Family("deepseek_v3", "DeepseekV3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    )
}


# config.json keys every family has that are one kit model.* field each, as it is: kit_tables
# reads them, hf_config writes them back ({kit field: HF key})
MODEL_KEYS = {
    "vocab_size": "vocab_size",
    "hidden": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "norm_eps": "rms_norm_eps",
}
# the keys of a yarn RoPE's rope_scaling that are one kit rope.* field each, read and written alike
YARN_KEYS = {
    "factor": "factor",
    "original_max_positions": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}
# DeepSeek-V3's MLA sizes: config.json keys with the name of their kit model.* field, read and written alike
MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def family_of(hf: dict) -> Family:
    """The family of a ``config.json`` (by ``model_type``, else ``architectures``)."""
    kind = hf.get("model_type")
    if kind in FAMILIES:
        return FAMILIES[kind]
    for fam in FAMILIES.values():
        if fam.architecture in (hf.get("architectures") or []):
            return fam
    raise ConfigError(
        f"config.json: model_type={kind!r} (architectures "
        f"{hf.get('architectures')}) is not supported; supported: "
        f"{', '.join(f'{f.name} ({f.architecture})' for f in FAMILIES.values())}"
    )


def _rope(hf: dict) -> dict:
    """The RoPE parameters of either config style (``rope_parameters`` in transformers 5,
    ``rope_theta`` + ``rope_scaling`` before)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def kit_tables(fam: Family, hf: dict, *, mtp: bool) -> tuple[dict, dict]:
    """(config sections {section: {key: value}}, {"section.key": "the HF key it came from"}).
    ``mtp``: the checkpoint holds DeepSeek-V3's MTP layer(s)."""
    fields.check(fam.name, hf)
    t: dict[str, dict[str, Any]] = {"model": {}, "moe": {}, "rope": {}, "train": {}}
    src: dict[str, str] = {}

    def put(dotted: str, value: Any, origin: str) -> None:
        section, key = dotted.split(".")
        t[section][key] = value
        src[dotted] = origin

    def take(dotted: str, key: str, default: Any = None) -> None:
        """``key`` may be "a|b": the first present (releases spell some keys differently); its
        value is cast to the kit field's type."""
        present = [k for k in key.split("|") if hf.get(k) is not None]
        value = hf[present[0]] if present else default
        if value is None:
            raise ConfigError(f"config.json: {key.split('|')[0]} is missing (needed for {dotted})")
        put(dotted, _kit_type(dotted)(value), present[0] if present else f"{key.split('|')[0]} (default)")

    for key, hf_key in MODEL_KEYS.items():
        take(f"model.{key}", hf_key)
    tied = bool(hf.get("tie_word_embeddings", False))
    put("model.tie_embeddings", tied, "tie_word_embeddings")
    if tied:
        put("model.tied_logit_scale", 1.0, "tie_word_embeddings (transformers does not scale)")
    rope = _rope(hf)
    put("model.rope_theta", float(rope["rope_theta"]), "rope_theta")
    if rope["rope_type"] == "yarn":
        _yarn(rope, put)
    if hf.get("max_position_embeddings"):
        put(
            "train.seq_len",
            min(int(hf["max_position_embeddings"]), 4096),
            "max_position_embeddings (at most 4096)",
        )
    {"mixtral": _mixtral, "qwen3_moe": _qwen3, "deepseek_v3": _deepseek}[fam.name](hf, take, put, mtp)
    return {k: v for k, v in t.items() if v}, src


def _yarn(rope: dict, put) -> None:
    put("rope.scaling", "yarn", "rope_scaling.type")
    for kit, key in YARN_KEYS.items():
        if rope.get(key) is not None:
            put(f"rope.{kit}", _kit_type(f"rope.{kit}")(rope[key]), f"rope_scaling.{key}")


def _kit_type(dotted: str) -> Any:
    """The type of the kit's config field ``dotted`` ("section.key"): what a value read for it is cast to."""
    section, key = dotted.split(".")
    return get_type_hints(get_type_hints(Config)[section])[key]


def _gqa(hf: dict, take, put) -> None:
    take("model.num_kv_heads", "num_key_value_heads")
    if hf.get("head_dim"):
        take("model.head_dim", "head_dim")


def _balance(hf: dict, put, top_k: int) -> None:
    coef = float(hf.get("router_aux_loss_coef") or 0.0)
    put(
        "moe.aux_loss_coef",
        coef * top_k,
        "router_aux_loss_coef x num_experts_per_tok (transformers' balance loss is top_k times the kit's)",
    )


def _experts(take, num_key: str, ffn_key: str) -> None:
    """The routed experts: how many (HF ``num_key``), top-k, one's width (``ffn_key``)."""
    take("moe.num_experts", num_key)
    take("moe.top_k", "num_experts_per_tok")
    take("moe.expert_ffn", ffn_key)


def _mixtral(hf: dict, take, put, mtp: bool) -> None:
    _gqa(hf, take, put)
    _experts(take, "num_local_experts|num_experts", "intermediate_size")
    put("moe.score_function", "softmax", "MixtralSparseMoeBlock: softmax")
    put("moe.normalize_top_k", True, "MixtralSparseMoeBlock: renormalised top-k")
    _balance(hf, put, int(hf["num_experts_per_tok"]))


def _qwen3(hf: dict, take, put, mtp: bool) -> None:
    _gqa(hf, take, put)
    put("model.qk_norm", True, "Qwen3MoeAttention: q_norm, k_norm")
    _experts(take, "num_experts|num_local_experts", "moe_intermediate_size")
    put("moe.score_function", "softmax", "Qwen3MoeSparseMoeBlock: softmax")
    take("moe.normalize_top_k", "norm_topk_prob", False)
    _balance(hf, put, int(hf["num_experts_per_tok"]))
    dense = _qwen3_dense_layers(hf)
    if dense:
        put("model.first_dense_layers", dense, "mlp_only_layers, decoder_sparse_step")
        take("model.dense_ffn", "intermediate_size")


def _qwen3_dense_layers(hf: dict) -> int:
    """How many first layers are dense: transformers makes layer i dense when it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; the kit runs dense layers
    first only (``model.first_dense_layers``)."""
    step, only = int(hf.get("decoder_sparse_step") or 1), hf.get("mlp_only_layers") or []
    dense = [i for i in range(int(hf["num_hidden_layers"])) if i in only or (i + 1) % step]
    if dense != list(range(len(dense))):
        raise ConfigError(
            f"config.json: mlp_only_layers={only!r} with decoder_sparse_step={step} "
            f"makes layers {dense} dense; the kit supports dense layers only as "
            "the first ones (mlp_only_layers=[0, ..., k-1], decoder_sparse_step=1)"
        )
    return len(dense)


def _deepseek(hf: dict, take, put, mtp: bool) -> None:
    put("model.attention_kind", "mla", "model_type deepseek_v3: multi-head latent attention")
    put("model.num_kv_heads", int(hf["num_attention_heads"]), "num_attention_heads (MLA)")
    put("model.q_lora_rank", int(hf.get("q_lora_rank") or 0), "q_lora_rank")
    for key in MLA_DIMS:
        take(f"model.{key}", key)
    put("rope.layout", "interleaved" if hf.get("rope_interleave", True) else "half", "rope_interleave")
    take("model.first_dense_layers", "first_k_dense_replace", 0)
    take("model.dense_ffn", "intermediate_size")
    _experts(take, "n_routed_experts|num_local_experts", "moe_intermediate_size")
    take("moe.num_shared_experts", "n_shared_experts", 0)
    take("moe.shared_ffn", "moe_intermediate_size")
    take("moe.score_function", "scoring_func", "sigmoid")
    take("moe.normalize_top_k", "norm_topk_prob", True)
    take("moe.num_groups", "n_group", 0)
    take("moe.group_top_k", "topk_group", 0)
    take("moe.routed_scaling", "routed_scaling_factor", 1.0)
    put("moe.aux_loss_coef", 0.0, "auxiliary-loss-free balancing (the report)")
    put("moe.z_loss_coef", 0.0, "none in the report")
    put("moe.bias_update_rate", 0.001, "the report's bias update speed (not in config.json)")
    if hf.get("seq_aux", True) and hf.get("aux_loss_alpha") is not None:
        take("moe.seq_aux_loss_coef", "aux_loss_alpha")
    depth = int(hf.get("num_nextn_predict_layers") or 0) if mtp else 0
    put("model.mtp_depth", depth, "num_nextn_predict_layers (0 when the files hold no MTP layer)")


# ----------------------------------------------------------------------------- kit -> HF


def family_for(cfg: Config) -> Family:
    """The family a kit config can be exported as; ConfigError naming what fits none."""
    m, e = cfg.model, cfg.moe
    if m.attention_kind == "mla":
        if e.shared_ffn not in (0, e.expert_ffn) and e.num_shared_experts:
            raise ConfigError(
                f"to-hf: moe.shared_ffn={e.shared_ffn} differs from moe.expert_ffn="
                f"{e.expert_ffn}; deepseek_v3's shared experts have the routed width"
            )
        if e.score_function != "sigmoid":
            raise ConfigError(
                f"to-hf: moe.score_function={e.score_function!r}: transformers' "
                "deepseek_v3 routes with sigmoid only"
            )
        return FAMILIES["deepseek_v3"]
    if m.mtp_depth or e.num_shared_experts or e.score_function != "softmax":
        raise ConfigError(
            "to-hf: a GQA model with shared experts, MTP or sigmoid routing "
            "matches no supported family (mixtral, qwen3_moe; deepseek_v3 needs "
            "model.attention_kind=mla)"
        )
    if e.num_groups:
        raise ConfigError("to-hf: moe.num_groups (group-limited routing) needs deepseek_v3")
    if m.qk_norm:
        return FAMILIES["qwen3_moe"]
    if m.first_dense_layers:
        raise ConfigError(
            "to-hf: mixtral has no dense layers; model.first_dense_layers needs "
            "model.qk_norm=true (qwen3_moe: mlp_only_layers) or deepseek_v3"
        )
    if not e.normalize_top_k:
        raise ConfigError(
            "to-hf: mixtral renormalises the top-k weights; set "
            "model.qk_norm=true (qwen3_moe) or moe.normalize_top_k=true"
        )
    return FAMILIES["mixtral"]


def hf_config(fam: Family, cfg: Config, dtype: str) -> dict:
    """``config.json`` for ``cfg`` as ``fam`` (``dtype``: "bfloat16" or "float32")."""
    m, e, r = cfg.model, cfg.moe, cfg.rope
    hf: dict[str, Any] = {
        "architectures": [fam.architecture],
        "model_type": fam.name,
        "torch_dtype": dtype,
        **{hf_key: getattr(m, key) for key, hf_key in MODEL_KEYS.items()},
        "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu",
        "max_position_embeddings": max(cfg.train.seq_len, 4096),
        "rope_theta": m.rope_theta,
        "num_experts_per_tok": e.top_k,
    }
    if fam.name != "mixtral":  # Mixtral's config has no such field
        hf["attention_bias"] = False
    if r.scaling == "yarn":
        yarn = {key: getattr(r, kit) for kit, key in YARN_KEYS.items()}
        hf["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", **yarn}
    if fam.name != "deepseek_v3":
        hf.update(
            num_key_value_heads=m.num_kv_heads,
            router_aux_loss_coef=e.aux_loss_coef / e.top_k,
            output_router_logits=False,
        )
        if m.head_dim:
            hf["head_dim"] = m.head_dim
    if fam.name == "mixtral":
        hf.update(num_local_experts=e.num_experts, intermediate_size=e.expert_ffn, sliding_window=None)
    elif fam.name == "qwen3_moe":
        hf.update(
            num_experts=e.num_experts,
            moe_intermediate_size=e.expert_ffn,
            norm_topk_prob=e.normalize_top_k,
            decoder_sparse_step=1,
            mlp_only_layers=list(range(m.first_dense_layers)),
            use_sliding_window=False,
            head_dim=m.head_dim or m.hidden // m.num_heads,
        )
        if m.first_dense_layers:
            hf["intermediate_size"] = m.dense_ffn
    else:
        hf.update(_deepseek_hf(cfg))
    return hf


def _deepseek_hf(cfg: Config) -> dict:
    m, e = cfg.model, cfg.moe
    return {
        "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank or None,
        **{key: getattr(m, key) for key in MLA_DIMS},
        "qk_head_dim": m.qk_nope_head_dim + m.qk_rope_head_dim,
        "rope_interleave": cfg.rope.layout == "interleaved",
        "first_k_dense_replace": m.first_dense_layers,
        "intermediate_size": m.dense_ffn,
        "n_routed_experts": e.num_experts,
        "moe_intermediate_size": e.expert_ffn,
        "n_shared_experts": e.num_shared_experts,
        "scoring_func": e.score_function,
        "norm_topk_prob": e.normalize_top_k,
        "n_group": e.num_groups or 1,
        "topk_group": e.group_top_k or 1,
        "routed_scaling_factor": e.routed_scaling,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": m.mtp_depth,
        "aux_loss_alpha": e.seq_aux_loss_coef,
        "seq_aux": True,
    }
