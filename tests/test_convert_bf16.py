"""The figures ``to-hf --dtype bf16`` prints (``to_hf.BF16_NOTE``) are the measured ones: the
per-token logit change of a bf16 export of float32 weights (``max |change| / max |logit|`` of
each token), on the tiny Mixtral and DeepSeek-V3 test models initialized as Hugging Face does
(std 0.02 weights, norms near 1), scored by the kit before and after (fp32 math both ways)."""

import numpy as np
import pytest
from test_convert import DEEPSEEK, MIXTRAL, deepseek_tensors, mixtral_tensors, write_hf

from moe_train.convert.from_hf import from_hf
from moe_train.convert.score import score
from moe_train.convert.to_hf import BF16_MEDIAN, BF16_NOTE, BF16_WORST, to_hf


def hf_init(tensors: dict, seed: int) -> dict:
    """The test tensors rescaled as Hugging Face initializes a model (float32)."""
    rng = np.random.default_rng(100 + seed)
    out = {}
    for name, value in tensors.items():
        value = np.asarray(value, np.float32)
        if "norm" in name or "correction_bias" in name:
            out[name] = (1 + 0.1 * rng.normal(size=value.shape)).astype(np.float32)
        else:
            out[name] = 0.02 * value
    return out


def per_token_change(root, cfg: dict, tensors: dict) -> np.ndarray:
    quiet = lambda line: None  # noqa: E731
    from_hf(write_hf(root / "hf", cfg, tensors), root / "kit", log=quiet)
    to_hf(root / "kit", root / "bf16", dtype="bf16", log=quiet)
    from_hf(root / "bf16", root / "kit_bf16", log=quiet)
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], (4, 32))
    _, before = score(str(root / "kit"), ids, devices=1)
    _, after = score(str(root / "kit_bf16"), ids, devices=1)
    return (np.abs(after - before).max(-1) / np.abs(before).max(-1)).ravel()


@pytest.fixture(scope="module")
def changes(tmp_path_factory) -> np.ndarray:
    deepseek = {k: v for k, v in DEEPSEEK.items() if k != "quantization_config"}
    models = [(MIXTRAL, mixtral_tensors(seed=0)), (deepseek, deepseek_tensors(seed=0, fp8=False))]
    return np.concatenate(
        [
            per_token_change(tmp_path_factory.mktemp(f"m{i}"), cfg, hf_init(t, 0))
            for i, (cfg, t) in enumerate(models)
        ]
    )


@pytest.mark.slow
def test_the_stated_worst_token_is_the_measured_one_within_rounding(changes):
    assert BF16_WORST / 1.5 <= changes.max() <= BF16_WORST * 1.5


@pytest.mark.slow
def test_the_stated_median_is_the_measured_one_within_rounding(changes):
    assert BF16_MEDIAN / 1.5 <= np.median(changes) <= BF16_MEDIAN * 1.5


def test_the_note_says_per_token_median_and_worst_and_that_it_is_not_a_bound():
    assert all(s in BF16_NOTE for s in ("Per token", "(median)", "(worst token)", "not a bound"))
