"""Parameter and FLOP accounting (moe_train.model.flops) and device peaks (topology.peaks)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_train import config
from moe_train.model.flops import (
    attention_flops_per_token,
    forward_flops_per_token,
    param_counts,
    train_flops_per_token,
)
from topology.peaks import device_model, peak_flops

# A 1-layer model small enough to count on paper: V=10, H=4, 2 query heads and 1 KV head of
# width 2, 3 experts of width 5, top-1.
HAND = {
    "model": {
        "vocab_size": 10,
        "hidden": 4,
        "num_layers": 1,
        "num_heads": 2,
        "num_kv_heads": 1,
        "first_dense_layers": 0,
        "qk_norm": False,
        "tie_embeddings": False,
    },
    "moe": {"num_experts": 3, "top_k": 1, "expert_ffn": 5, "num_shared_experts": 0, "shared_ffn": 0},
    "train": {"seq_len": 8},
    "data": {"source": "synthetic"},
}


def hand_cfg(**changes: dict) -> config.Config:
    sections = {name: dict(values) for name, values in HAND.items()}
    for name, values in changes.items():
        sections.setdefault(name, {}).update(values)
    # overrides and flags given by position and name: the ** unpacking can only fill sections
    return config.build("tiny", (), flags=None, **sections)


def test_one_layer_counted_by_hand():
    p = param_counts(hand_cfg())
    assert p["embedding"] == 10 * 4 and p["lm_head"] == 4 * 10
    assert p["attention"] == 4 * 4 + 4 * 2 + 4 * 2 + 4 * 4  # q, k, v, o = 48
    assert p["norms"] == 4 + 4 + 4  # attn_norm, mlp_norm, final_norm
    assert p["router"] == 4 * 3
    assert p["routed_experts"] == 3 * (4 * 5 + 4 * 5 + 5 * 4)  # 180
    assert p["active_routed_experts"] == 60
    assert p["dense_mlp"] == 0 and p["shared_experts"] == 0
    assert p["total"] == 40 + 40 + 48 + 12 + 12 + 180 == 332
    assert p["active"] == 332 - 180 + 60 == 212
    assert p["matmul_active"] == 212 - 40 - 12 == 160  # no lookup table, no norms


def test_flops_formula_by_hand():
    cfg = hand_cfg()
    # causal attention: 2 (QK^T, AV) x 2 FLOPs x seq 8 x (2 heads x 2) / 2 = 64 per layer
    assert attention_flops_per_token(cfg) == 64.0
    assert forward_flops_per_token(cfg) == 2 * 160 + 64 == 384.0
    assert train_flops_per_token(cfg) == 3 * 384.0


def test_qk_norm_adds_two_head_dim_vectors_per_layer():
    base = param_counts(hand_cfg())
    qk = param_counts(hand_cfg(model=dict(qk_norm=True, num_layers=3)))
    three = param_counts(hand_cfg(model=dict(num_layers=3)))
    assert qk["total"] - three["total"] == 3 * 2 * 2
    assert qk["norms"] == 3 * (4 + 4 + 2 + 2) + 4
    assert base["total"] < three["total"]


def test_explicit_head_dim():
    p = param_counts(hand_cfg(model=dict(head_dim=3)))
    assert p["attention"] == 4 * 6 + 4 * 3 + 4 * 3 + 6 * 4


def test_tied_embeddings_counted_once():
    untied = param_counts(hand_cfg())
    tied = param_counts(hand_cfg(model=dict(tie_embeddings=True)))
    assert tied["lm_head"] == 0 and tied["embedding"] == 40
    assert tied["total"] == untied["total"] - 40
    assert tied["active"] == untied["active"] - 40
    # the shared table still does the output matmul
    assert tied["matmul_active"] == untied["matmul_active"] == 160
    assert forward_flops_per_token(hand_cfg(model=dict(tie_embeddings=True))) == 384.0


def test_shared_experts_are_always_active():
    p = param_counts(hand_cfg(moe=dict(num_shared_experts=2, shared_ffn=3)))
    assert p["shared_experts"] == 3 * 4 * (2 * 3)  # one fused SwiGLU of width 6
    assert p["total"] == 332 + 72 and p["active"] == 212 + 72
    # shared_ffn = 0 means the routed expert width
    q = param_counts(hand_cfg(moe=dict(num_shared_experts=1)))
    assert q["shared_experts"] == 3 * 4 * 5


def test_first_dense_layers():
    p = param_counts(hand_cfg(model=dict(num_layers=3, first_dense_layers=2, dense_ffn=7)))
    assert p["dense_mlp"] == 2 * 3 * 4 * 7
    assert p["router"] == 1 * 4 * 3  # only the one MoE layer has a gate and experts
    assert p["routed_experts"] == 180 and p["active_routed_experts"] == 60
    assert p["total"] == 40 + 40 + 3 * 48 + (3 * 8 + 4) + 168 + 12 + 180
    all_dense = param_counts(hand_cfg(model=dict(first_dense_layers=1, dense_ffn=7)))
    assert all_dense["router"] == all_dense["routed_experts"] == 0
    assert all_dense["total"] == all_dense["active"]


def test_components_sum_to_total():
    for name in config.list_presets():
        p = param_counts(config.build(name))
        parts = (
            "embedding",
            "lm_head",
            "attention",
            "norms",
            "dense_mlp",
            "router",
            "routed_experts",
            "shared_experts",
        )
        assert sum(p[k] for k in parts) == p["total"], name
        assert p["active"] == p["total"] - p["routed_experts"] + p["active_routed_experts"]
        assert all(isinstance(v, int) for v in p.values())


def test_flops_monotonic_in_top_k():
    values = [train_flops_per_token(config.build("small", moe=dict(top_k=k))) for k in range(1, 17)]
    assert all(a < b for a, b in zip(values, values[1:]))


def test_flops_grow_with_seq_len_only_through_attention():
    a = config.build("small", train=dict(seq_len=128))
    b = config.build("small", train=dict(seq_len=256))
    diff = forward_flops_per_token(b) - forward_flops_per_token(a)
    m = b.model
    assert diff == m.num_layers * 2 * 128 * m.num_heads * config.head_dim(m)


# Published totals/actives. They are given to 2-3 significant digits (Qwen's 3.3B is 3.35B
# truncated), so the active counts get 2% and the totals 0.5%.
@pytest.mark.parametrize(
    "preset,total,active",
    [
        ("mixtral-8x7b", 46.7e9, 12.9e9),  # Mixtral paper / model card
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),  # Qwen3 model card
    ],
)
def test_published_counts(preset, total, active):
    p = param_counts(config.build(preset))
    assert p["total"] == pytest.approx(total, rel=0.005)
    assert p["active"] == pytest.approx(active, rel=0.02)


def test_qwen3_non_embedding_count():
    # the Qwen3-30B-A3B model card also gives 29.9B parameters without the two vocab tables
    p = param_counts(config.build("qwen3-30b-a3b"))
    assert p["total"] - p["embedding"] - p["lm_head"] == pytest.approx(29.9e9, rel=0.005)


def mla_attention_params() -> int:
    """DeepSeek-V3's Multi-head Latent Attention, all 61 layers (published dims), counted
    by hand (weights only)."""
    hidden, heads, layers = 7168, 128, 61
    q_lora, kv_lora, nope, rope, v_head = 1536, 512, 128, 64, 128
    per_layer = (
        hidden * q_lora  # q down-projection
        + q_lora * heads * (nope + rope)  # q up-projection
        + hidden * (kv_lora + rope)  # joint kv down-projection (+ shared rope key)
        + kv_lora * heads * (nope + v_head)  # k_nope and v up-projection
        + heads * v_head * hidden
    )  # output projection
    return layers * per_layer


def test_deepseek_v3_matches_published():
    # the report: 671B total, 37B activated per token in the main model; the released files
    # add the 14B MTP module (its block, eh_proj and norms, plus copies of the embedding and
    # head): 685B in all
    p = param_counts(config.build("deepseek-v3"))
    assert p["attention"] == mla_attention_params() == pytest.approx(11.41e9, rel=0.001)
    assert p["total"] == pytest.approx(671e9, rel=0.005)
    assert p["active"] == pytest.approx(37e9, rel=0.02)
    assert p["mtp_with_shared"] == pytest.approx(14e9, rel=0.05)
    assert p["total"] + p["mtp_with_shared"] == pytest.approx(685e9, rel=0.005)


def test_mtp_module_is_one_moe_layer_plus_its_projection_and_norms():
    cfg = config.build("deepseek-v3")
    p = param_counts(cfg)
    H = 7168
    moe_layer = (
        p["attention"] // 61
        + 7168 * 256
        + 257 * 3 * H * 2048  # attn, gate, experts
        + 2 * H
        + 1536
        + 512
    )  # block norms, MLA's latent norms
    assert p["mtp"] == moe_layer + 2 * H * H + 3 * H
    assert p["total_with_mtp"] == p["total"] + p["mtp"]
    no_mtp = param_counts(config.build("deepseek-v3", ["model.mtp_depth=0"]))
    assert no_mtp["mtp"] == 0 and no_mtp["total"] == p["total"]
    # its work counts in the FLOPs: one more MoE layer's matmuls, eh_proj and the head again
    assert p["matmul_active"] - no_mtp["matmul_active"] == (
        p["mtp_active"] - (2 * H + 1536 + 512 + 3 * H) + H * 129280
    )


def test_mla_attention_flops_use_both_head_dims():
    cfg = config.build("deepseek-v3")
    # QK^T over 192 dims and AV over 128, causal: 2 * S * N * (192 + 128) / 2 per layer
    assert attention_flops_per_token(cfg) == (61 + 1) * 4096 * 128 * (192 + 128)


def test_deepseek_v3_moe_parts():
    p = param_counts(config.build("deepseek-v3"))
    assert p["dense_mlp"] == 3 * 3 * 7168 * 18432
    assert p["routed_experts"] == 58 * 256 * 3 * 7168 * 2048
    assert p["shared_experts"] == 58 * 3 * 7168 * 2048
    assert p["active_routed_experts"] == 58 * 8 * 3 * 7168 * 2048


def test_mixtral_flops_value():
    cfg = config.build("mixtral-8x7b")
    p = param_counts(cfg)
    attn = 32 * 2 * 4096 * 32 * 128  # 2 x 2 x seq x nh*hd / 2, 32 layers
    assert forward_flops_per_token(cfg) == 2 * p["matmul_active"] + attn
    # about 6 x 12.75B matmul parameters plus the causal attention term
    assert train_flops_per_token(cfg) == pytest.approx(6 * 12.749e9 + 3 * attn, rel=1e-3)


@pytest.mark.parametrize(
    "kind,model,bf16",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
        ("NVIDIA H100 SXM5 80GB", "H100 SXM", 989e12),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", "H100 NVL", 835e12),
        ("NVIDIA H200", "H200", 989e12),
        ("NVIDIA H200 NVL", "H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", "GH200", 989e12),
        ("NVIDIA B200", "B200", 2250e12),
        ("NVIDIA GB200", "GB200", 2500e12),
    ],
)
def test_peak_flops_gpus(kind, model, bf16):
    assert device_model(kind) == model
    assert peak_flops(kind) == bf16
    assert peak_flops(kind, "bfloat16") == peak_flops(kind, "float16") == bf16
    assert peak_flops(kind, "float8_e4m3fn") == pytest.approx(2 * bf16, rel=0.001)


@pytest.mark.parametrize("kind", ["cpu", "TFRT_CPU_0", "TPU v4", "NVIDIA A100-SXM4-80GB", ""])
def test_peak_flops_unknown(kind):
    assert peak_flops(kind) is None


def test_peak_flops_unknown_dtype():
    assert peak_flops("NVIDIA H100 80GB HBM3", "float32") is None
    assert peak_flops("NVIDIA H100 80GB HBM3", "int4") is None


def test_peak_flops_on_this_machine():
    jax = pytest.importorskip("jax")
    kind = jax.devices()[0].device_kind
    value = peak_flops(kind)
    assert value is None or value > 1e14


@pytest.mark.parametrize(
    "preset,overrides",
    [
        ("tiny", []),
        (
            "tiny",
            [
                "model.tie_embeddings=true",
                "model.qk_norm=true",
                "model.num_layers=3",
                "model.first_dense_layers=1",
                "moe.num_shared_experts=2",
                "moe.shared_ffn=32",
            ],
        ),
        ("mixtral-8x7b", []),
        ("deepseek-v3", []),
        ("deepseek-v3-tiny", []),
        ("deepseek-v3-tiny", ["model.q_lora_rank=0", "model.mtp_depth=2"]),
        ("deepseek-v3-tiny", ["model.first_dense_layers=3"]),  # no MoE layers: a dense MTP block
    ],
)
def test_counts_equal_the_parameters_the_model_creates(preset, overrides):
    import jax
    import jax.numpy as jnp

    from moe_train.model.settings import model_settings
    from moe_train.model.transformer import Transformer

    cfg = config.build(preset, overrides)
    shapes = jax.eval_shape(
        lambda k: Transformer(model_settings(cfg)).init(k, jnp.zeros((1, 8), jnp.int32)), jax.random.key(0)
    )
    created = sum(
        int(np.prod(x.value.shape if hasattr(x, "value") else x.shape))
        for x in jax.tree.leaves(shapes["params"], is_leaf=lambda x: hasattr(x, "value"))
    )
    assert created == param_counts(cfg)["total_with_mtp"]
