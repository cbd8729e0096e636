"""Against Hugging Face transformers (PyTorch, fp32): tiny random Mixtral, Qwen3-MoE (tied, with
a dense first layer) and DeepSeek-V3 (with an MTP layer) models built and saved with
``save_pretrained`` here; ``from-hf`` + ``score`` give their logits, ``to-hf`` writes what
``from_pretrained`` loads with no missing or unused weights (but the MTP layer transformers does
not run) and the kit's logits, each within 1e-5 relative (``max|a - b| / max|b|``) in fp32. A
bf16 export of fp32 weights stays within ``BF16_EXPORT_REL``. Needs the ``interop`` extra
(torch CPU build + transformers)."""

import importlib
import json

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="needs the interop extra (torch, CPU build): make test EXTRAS=test,cluster,report,interop"
)
transformers = pytest.importorskip("transformers", reason="needs the interop extra (transformers)")

from moe_train.convert.from_hf import from_hf  # noqa: E402
from moe_train.convert.score import score  # noqa: E402
from moe_train.convert.to_hf import to_hf  # noqa: E402

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=64,
    attn_implementation="eager",
)
FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            num_key_value_heads=2,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_theta=1e6,
            router_aux_loss_coef=0.02,
            sliding_window=None,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            moe_intermediate_size=24,
            intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            rope_theta=1e6,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=64,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            v_head_dim=12,
            qk_nope_head_dim=8,
            norm_topk_prob=True,
            rope_interleave=True,
        ),
    ),
}


VARIANTS = {"tied": {"tie_word_embeddings": True}, "dense": {"mlp_only_layers": [0]}, "mtp": {}}
FIXTURES = [*FAMILIES, "qwen3_moe:tied", "qwen3_moe:dense", "deepseek_v3:mtp"]
REL = 1e-5  # fp32 both ways
BF16_EXPORT_REL = 3e-2  # bf16 weights (8 mantissa bits), fp32 math; measured 2e-3 .. 1.8e-2


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def hf_model(family: str, seed: int = 0, **extra):
    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **kwargs, **extra})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # make the routers and norms non-trivial (HF inits them flat)
        for name, p in model.named_parameters():
            if "norm" in name or "e_score_correction_bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def add_mtp_layer(hf_dir, seed: int = 5) -> list[str]:
    """Append DeepSeek-V3's MTP layer (transformers saves none) to a saved tiny model: layer
    ``L`` as a copy of layer ``L - 1``'s shapes with random values, its projections and norms,
    and the release's copies of the embedding and the head; returns the added names."""
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    path = hf_dir / "model.safetensors"
    t = load_file(str(path))
    rng = np.random.default_rng(seed)
    new = {
        n.replace(f"layers.{layers - 1}.", f"layers.{layers}."): (
            (1.0 + 0.1 * rng.standard_normal(a.shape))
            if n.endswith("norm.weight")
            else 0.1 * rng.standard_normal(a.shape)
        ).astype(a.dtype)
        for n, a in t.items()
        if n.startswith(f"model.layers.{layers - 1}.")
    }
    p = f"model.layers.{layers}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        new[f"{p}{name}.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    new[f"{p}eh_proj.weight"] = (0.1 * rng.standard_normal((hidden, 2 * hidden))).astype(np.float32)
    new[f"{p}embed_tokens.weight"] = t["model.embed_tokens.weight"]
    new[f"{p}shared_head.head.weight"] = t["lm_head.weight"]
    save_file({**t, **new}, str(path), metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return sorted(new)


@pytest.fixture(scope="module", params=FIXTURES)
def saved(request, tmp_path_factory):
    """(family, variant, HF model, the directory holding its save_pretrained ``hf/`` and the
    converted ``kit/``); ``:tied`` ties the embeddings (the kit then scales logits by 1),
    ``:dense`` makes Qwen3's first layer dense, ``:mtp`` adds DeepSeek-V3's MTP layer."""
    family, _, variant = request.param.partition(":")
    root = tmp_path_factory.mktemp(family)
    model = hf_model(family, **VARIANTS.get(variant, {}))
    model.save_pretrained(root / "hf", safe_serialization=True)
    if variant == "mtp":
        add_mtp_layer(root / "hf")
    from_hf(root / "hf", root / "kit", log=lambda s: None)
    return family, variant, model, root


def ids_of(seed: int = 1, shape=(2, 11)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 97, shape).astype(np.int32)


def test_scored_logits_equal_transformers(saved):
    family, _, model, root = saved
    ids = ids_of()
    loss, logits = score(str(root / "kit"), ids, devices=1)
    want = hf_logits(model, ids)
    assert rel_err(logits, want) <= REL
    ref = torch.nn.functional.cross_entropy(
        torch.as_tensor(want[:, :-1]).reshape(-1, 97), torch.as_tensor(ids[:, 1:]).long().reshape(-1)
    )
    assert loss == pytest.approx(float(ref), rel=1e-5)


def load(family: str, path, **kw):
    return getattr(transformers, FAMILIES[family][1]).from_pretrained(
        path, output_loading_info=True, attn_implementation="eager", **kw
    )


def test_to_hf_loads_with_no_missing_or_unused_weights_and_the_kits_logits(saved, tmp_path):
    family, variant, model, root = saved
    to_hf(root / "kit", tmp_path / "back", log=lambda s: None)  # fp32 source: kept fp32
    back, info = load(family, tmp_path / "back")
    mtp = f"model.layers.{model.config.num_hidden_layers}."  # transformers runs no MTP layer
    assert not info["missing_keys"] and not info.get("mismatched_keys"), info
    assert all(k.startswith(mtp) for k in info["unexpected_keys"]), info
    assert bool(info["unexpected_keys"]) == (variant == "mtp"), info
    ids = ids_of(2)
    _, ours = score(str(root / "kit"), ids, devices=1)
    assert back.dtype == torch.float32 and rel_err(hf_logits(back.eval(), ids), ours) <= REL


def test_a_bf16_export_stays_within_its_stated_bound(saved, tmp_path):
    family, _, model, root = saved
    to_hf(root / "kit", tmp_path / "back", dtype="bf16", log=lambda s: None)
    back, _ = load(family, tmp_path / "back", dtype=torch.float32)  # bf16 weights, fp32 math
    ids = ids_of(2)
    _, ours = score(str(root / "kit"), ids, devices=1)
    assert rel_err(hf_logits(back.eval(), ids), ours) <= BF16_EXPORT_REL


def test_round_trip_reproduces_the_tensors_bitwise(saved, tmp_path):
    from safetensors.numpy import load_file

    family, _, _, root = saved
    to_hf(root / "kit", tmp_path / "back", dtype="fp32", log=lambda s: None)

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    src, back = tensors(root / "hf"), tensors(tmp_path / "back")
    assert set(back) == set(src)
    for name in src:
        np.testing.assert_array_equal(back[name], src[name], err_msg=name)


def test_preset_names_where_each_value_came_from(saved):
    family, variant, _, root = saved
    text = (root / "kit" / "preset.toml").read_text()
    assert "hidden = 32  # hidden_size" in text
    assert "num_layers = " in text and "# num_hidden_layers" in text
    record = json.loads((root / "kit" / "convert.json").read_text())
    assert record["family"] == family
    if variant == "dense":
        assert "first_dense_layers = 1  # mlp_only_layers" in text


@pytest.mark.parametrize("saved", ["qwen3_moe:dense"], indirect=True)
def test_qwen3_dense_layers_export_as_mlp_only_layers(saved, tmp_path):
    _, _, _, root = saved
    to_hf(root / "kit", tmp_path / "back", log=lambda s: None)
    hf = json.loads((tmp_path / "back" / "config.json").read_text())
    assert hf["mlp_only_layers"] == [0] and hf["decoder_sparse_step"] == 1
    assert hf["intermediate_size"] == 64


def test_transformers_balance_loss_is_top_k_times_ours():
    import jax.numpy as jnp

    mixtral = importlib.import_module("transformers.models.mixtral.modeling_mixtral")  # the interop extra

    from moe_train.moe.router import Routing, route, router_stats

    logits = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    routing = Routing(top_k=2, score_function="softmax", normalize_top_k=True)
    _, experts_TK, scores_TE = route(jnp.asarray(logits), routing)
    ours = router_stats(jnp.asarray(logits), scores_TE, experts_TK).aux_loss
    theirs = mixtral.load_balancing_loss_func((torch.as_tensor(logits),), num_experts=8, top_k=2)
    assert float(theirs) == pytest.approx(2 * float(ours), rel=1e-5)


def test_a_trained_scanned_run_exports_to_mixtral_with_the_logits_it_scores(tmp_path):
    from moe_train import config
    from moe_train.train.loop import EXIT_OK, run

    cfg = config.build("tiny", ["train.steps=2", "parallel.devices=1", "train.log_every=100"])
    assert cfg.model.scan_layers  # stacked [L, ...] leaves, split back per layer on export
    assert run(cfg, tmp_path / "run", log=lambda s: None) == EXIT_OK
    to_hf(tmp_path / "run", tmp_path / "hf", log=lambda s: None)  # the run's fp32, as stored
    model, info = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = np.random.default_rng(3).integers(0, 256, (2, 9)).astype(np.int32)
    _, ours = score(str(tmp_path / "run"), ids, devices=1)
    assert model.dtype == torch.float32
    assert rel_err(hf_logits(model.eval(), ids), ours) <= REL
