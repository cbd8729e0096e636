"""The platform is an input (``moe_train.base.platform``): the model and the MoE layer choose
kernels for the ``Platform`` they are given, ``Platform.here()`` is the one place that reads
JAX's backend to choose, and ``make compile`` passes the target GPU's instead of patching."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from moe_train import config
from moe_train.base.platform import Platform
from moe_train.model import attention
from moe_train.model.settings import model_settings
from moe_train.moe import gemm, layer, megablox
from moe_train.planner.compile import facts
from topology import targets

ROOT = Path(__file__).resolve().parents[1]
# the code that chooses kernels, tiles and attention for a platform
CHOOSERS = (
    "moe_train/model",
    "moe_train/moe",
    "moe_train/planner/compile",
    "moe_train/selftest/candidates.py",
)
READERS = ("default_backend", "devices", "local_devices")  # jax.<name>: the machine's platform
H100 = facts.platform_of(targets.load("h100-sxm"))
TPU = Platform("tpu", "TPU v5 lite")


def _reads_of_jax(path: Path) -> list[str]:
    """'file:line jax.name' for each read of ``jax.default_backend``/``devices``/``local_devices``."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} jax.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in READERS
        and isinstance(node.value, ast.Name)
        and node.value.id == "jax"
    ]


def test_only_the_platform_reader_asks_jax_which_machine_this_is():
    files = [
        p for c in CHOOSERS for p in ([ROOT / c] if c.endswith(".py") else sorted((ROOT / c).rglob("*.py")))
    ]
    assert [r for f in files for r in _reads_of_jax(f)] == []
    assert _reads_of_jax(ROOT / "moe_train/base/platform.py")  # the one reader (the scan can fail)


def test_here_is_this_machine():
    here = Platform.here()
    assert (here.name, here.device_kind) == (jax.default_backend(), jax.devices()[0].device_kind)
    if here.name != "gpu":
        assert (here.cuda, here.compute_capability, here.cudnn_version) == (False, None, None)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU target on a CPU machine")
def test_an_explicit_gpu_target_resolves_the_gpu_backend_on_this_cpu():
    te = gemm._te_import_error() is None
    assert gemm.resolve_backend("auto", jnp.bfloat16, hidden=128, ffn=256, platform=H100) == (
        "te" if te else "mgpu"
    )
    assert gemm.resolve_backend("auto", jnp.bfloat16, hidden=128, ffn=256) == "tiled"  # no target: here


def test_an_explicit_tpu_target_resolves_megablox_and_its_tiles():
    if (why := megablox.import_error()) is not None:
        pytest.skip(why)
    assert gemm.resolve_backend("auto", jnp.bfloat16, platform=TPU) == "megablox"
    assert megablox.Setup.of(512, TPU) == megablox.Setup(512, "TPU v5 lite", interpret=False)


def test_the_gpu_target_sets_the_tiled_backends_tiles():
    assert layer.row_tiles("tiled", None, 65536, 8, H100) == (128, 1)
    assert layer.row_tiles("tiled", None, 65536, 8, Platform("cpu")) == (32, 1)


def test_the_model_settings_carry_the_target():
    cfg = config.build("tiny")
    assert model_settings(cfg, H100).target == H100
    assert model_settings(cfg).target == Platform.here()
    target = model_settings(cfg, H100).target
    impl, _ = attention.resolve(
        "auto", platform=target, dtype="bfloat16", head_dim=64, v_head_dim=64, seq_len=64
    )
    assert impl == "cudnn"


def test_compile_replaces_no_public_jax_state():
    target, devices = targets.load("h100-sxm"), jax.devices()[:1]
    public = (jax.default_backend, jax.devices, jax.local_devices)
    with facts.jax_reads(target, devices):
        assert (jax.default_backend, jax.devices, jax.local_devices) == public
    patched = [getattr(obj, "__name__", "") for obj, _, _ in facts._replacements(target, devices)]
    assert patched and all(name.startswith("jax._src.") or name == facts.MGPU_GRADIENT for name in patched)
