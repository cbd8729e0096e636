"""Every reader of a checkpoint's arrays verifies it first (``moe_train.train.checkpoint``).

Real runs write real orbax checkpoints here; the faults are done to their files: the manifest
deleted (an unverified checkpoint), another step's state put under a step's manifest (every
array readable, none the one saved), a directory renamed, NaN written into a step. Converted
weights (the real ``from-hf`` of a safetensors file) are damaged alike: a bit flipped in a
part's data file, a part's manifest deleted. Resume falls back past them; ``train.init_from``,
``score``, ``eval`` and ``to-hf`` refuse them with exit 2 and one line naming the file, unless
``--trust-unverified``.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from moe_train import config
from moe_train.config import ConfigError
from moe_train.convert.score import score
from moe_train.convert.to_hf import to_hf
from moe_train.train import checkpoint, manifest
from moe_train.train.loop import run
from moe_train.train.signals import EXIT_CONFIG, EXIT_DIVERGED, EXIT_OK

ROOT = Path(__file__).resolve().parent.parent
QUIET = dict(log=lambda s: None)


def tiny(*overrides: str, steps: int) -> config.Config:
    return config.build(
        "tiny",
        [
            f"train.steps={steps}",
            "parallel.devices=1",
            "train.log_every=100",
            "train.checkpoint_every=2",
            "train.async_checkpoint=false",
            "train.telemetry_interval_s=0",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory) -> Path:
    """A run stopped after step 6, with checkpoints 2, 4 and 6."""
    out = tmp_path_factory.mktemp("six")
    assert run(tiny(steps=6), out, **QUIET) == EXIT_OK
    return out


@pytest.fixture
def copy(six_steps, tmp_path) -> Path:
    return Path(shutil.copytree(six_steps, tmp_path / "run"))


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / str(step)


def drop_manifest(out: Path, step: int) -> None:
    shutil.rmtree(step_dir(out, step) / "manifest")


def swap_state(out: Path, step: int, other: int) -> None:
    """Step ``step`` holds step ``other``'s arrays under its own manifest: all readable."""
    shutil.rmtree(step_dir(out, step) / "state")
    shutil.copytree(step_dir(out, other) / "state", step_dir(out, step) / "state")


def rejected(out: Path) -> list[str]:
    return sorted(p.name.split("-")[0] for p in (out / "checkpoints-rejected").iterdir())


def cli(module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, cwd=ROOT
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


# --------------------------------------------------------------------------- resume


def test_resume_walks_back_past_unverified_and_damaged_checkpoints(copy):
    drop_manifest(copy, 6)  # the probe's case: no manifest on the newest,
    swap_state(copy, 4, 2)  # and the one before damaged
    lines = []
    assert run(tiny(steps=8), copy, log=lines.append) == EXIT_OK
    assert [line for line in lines if line.startswith("resumed from")] == [
        f"resumed from {step_dir(copy, 2)} (step 2)"
    ] and rejected(copy) == ["4", "6"]


def test_the_log_names_a_renamed_checkpoint_directory_as_it_is(copy):
    step_dir(copy, 6).rename(step_dir(copy, 9))
    lines = []
    assert run(tiny(steps=8), copy, log=lines.append) == EXIT_OK
    assert f"resumed from {step_dir(copy, 9)} (step 6)" in lines


def test_a_divergence_names_the_checkpoint_resumed_from_and_the_one_that_failed(copy):
    drop_manifest(copy, 6)
    lines = []
    code = run(tiny("optim.lr=1e30", steps=12), copy, log=lines.append)
    error = [line for line in lines if line.startswith("error:")]
    assert code == EXIT_DIVERGED and len(error) == 1
    assert (
        f"this start resumed from {step_dir(copy, 4)}; checkpoint 6 failed verification "
        f"at this start ({step_dir(copy, 6) / 'manifest' / 'metadata'} is missing" in error[0]
    )


def test_resume_step_resumes_an_unverified_checkpoint_with_a_warning(copy):
    drop_manifest(copy, 4)
    lines = []
    assert run(tiny(steps=6), copy, log=lines.append, resume_step=4) == EXIT_OK
    assert "WARNING: checkpoint 4 has no manifest: resumed unverified, as --resume-step 4 asks" in lines


# --------------------------------------------------------------------------- init_from


def test_init_from_refuses_a_checkpoint_without_a_manifest(copy, tmp_path):
    drop_manifest(copy, 6)
    with pytest.raises(ConfigError, match=r"checkpoints/6/manifest/metadata is missing"):
        run(tiny(f"train.init_from={copy}", steps=1), tmp_path / "new", **QUIET)


def test_init_from_refuses_a_damaged_checkpoint(copy, tmp_path):
    swap_state(copy, 6, 2)
    with pytest.raises(ConfigError, match=r"checkpoints/6: .* do not match the manifest"):
        run(tiny(f"train.init_from={copy}", steps=1), tmp_path / "new", **QUIET)


def test_init_from_verifies_the_weights_as_stored_then_casts_them(six_steps, tmp_path):
    """fp32 weights into a bf16 run: checked in their own dtype, not in the run's."""
    cfg = tiny(f"train.init_from={six_steps}", "model.param_dtype=bfloat16", steps=1)
    assert run(cfg, tmp_path / "new", **QUIET) == EXIT_OK


def test_non_finite_initial_weights_are_named_as_the_cause(copy):
    """NaN can reach a start only unverified: ``--resume-step`` of a step without a manifest
    (``train.init_from`` refuses such weights, and a manifest records non-finite arrays)."""
    state = (step_dir(copy, 6) / "state").absolute()
    tree = ocp.PyTreeCheckpointer().restore(state)
    tree["params"]["embed"] = np.full_like(tree["params"]["embed"], np.nan)
    ocp.PyTreeCheckpointer().save(state, tree, force=True)
    drop_manifest(copy, 6)
    lines = []
    assert run(tiny(steps=8), copy, log=lines.append, resume_step=6) == EXIT_DIVERGED
    assert any(
        line.startswith("error: step 7: the initial weights are non-finite")
        and f"resumed from {step_dir(copy, 6)} (unverified" in line
        for line in lines
    )


# --------------------------------------------------------------------------- converted weights


from test_score import converted, kit  # noqa: E402,F401  (fixtures: a converted Mixtral, a copy)


def init_from(kit: Path, out: Path) -> int:
    cfg = config.build(
        str(kit / "preset.toml"),
        [
            "train.steps=1",
            "train.batch_size=2",
            "train.seq_len=16",
            "parallel.devices=1",
            f"train.init_from={kit}",
            "data.source=synthetic",
            "train.telemetry_interval_s=0",
        ],
    )
    return run(cfg, out, **QUIET)


def test_init_from_refuses_damaged_converted_weights_naming_the_part(kit, tmp_path):
    from test_convert import damage

    part = re.escape(str(damage(kit)))
    with pytest.raises(
        ConfigError,
        match=rf"^{part}: .* do not match the manifest: "
        r"params/layer_1/\S+ checksum differs",
    ):
        init_from(kit, tmp_path / "new")


def test_init_from_refuses_converted_weights_without_a_manifest_saying_convert_again(kit, tmp_path):
    from test_convert import drop_manifest

    missing = re.escape(str(drop_manifest(kit)))
    with pytest.raises(
        ConfigError,
        match=rf"^{missing} is missing: .*; convert it again with "
        r"python -m moe_train.convert from-hf",
    ):
        init_from(kit, tmp_path / "new")


def test_to_hf_of_damaged_converted_weights_exits_2_and_writes_nothing(kit, tmp_path):
    from test_convert import damage

    damage(kit)
    proc = cli("moe_train.convert", "to-hf", kit, tmp_path / "hf")
    assert proc.returncode == EXIT_CONFIG and str(kit) in one_error_line(proc)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial-*"))


def test_to_hf_refuses_converted_weights_without_a_manifest(kit, tmp_path):
    from test_convert import drop_manifest

    missing = re.escape(str(drop_manifest(kit, "model")))
    with pytest.raises(ConfigError, match=rf"^{missing} is missing"):
        to_hf(kit, tmp_path / "hf", log=lambda s: None)


def test_to_hf_trust_unverified_exports_converted_weights_as_verified(kit, converted, tmp_path):
    from test_convert import drop_manifest

    drop_manifest(kit)
    to_hf(kit, tmp_path / "trusted", log=lambda s: None, trust_unverified=True)
    to_hf(converted, tmp_path / "verified", log=lambda s: None)
    files = sorted(p.name for p in (tmp_path / "verified").glob("*.safetensors"))
    assert files and all(
        (tmp_path / "trusted" / f).read_bytes() == (tmp_path / "verified" / f).read_bytes() for f in files
    )


# --------------------------------------------------------------------------- score, to-hf


def ids() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int32)


def test_score_of_a_damaged_checkpoint_exits_2_naming_it(copy, tmp_path):
    swap_state(copy, 6, 2)
    np.save(tmp_path / "ids.npy", ids())
    proc = cli("moe_train.score", copy, "--tokens", tmp_path / "ids.npy", "--devices", "1")
    assert proc.returncode == EXIT_CONFIG and str(step_dir(copy, 6)) in one_error_line(proc)


def test_score_of_a_checkpoint_without_a_manifest_exits_2_naming_the_file(copy, tmp_path):
    drop_manifest(copy, 6)
    np.save(tmp_path / "ids.npy", ids())
    proc = cli("moe_train.score", copy, "--tokens", tmp_path / "ids.npy", "--devices", "1")
    assert proc.returncode == EXIT_CONFIG
    assert f"{step_dir(copy, 6) / 'manifest' / 'metadata'} is missing" in one_error_line(proc)


def test_trust_unverified_scores_a_checkpoint_without_a_manifest_as_it_is(copy, six_steps):
    drop_manifest(copy, 6)
    assert (
        score(str(copy), ids(), devices=1, trust_unverified=True)[0]
        == score(str(six_steps), ids(), devices=1)[0]
    )


def test_to_hf_of_a_damaged_checkpoint_exits_2_and_writes_nothing(copy, tmp_path):
    swap_state(copy, 6, 2)
    proc = cli("moe_train.convert", "to-hf", copy, tmp_path / "hf")
    assert proc.returncode == EXIT_CONFIG and str(step_dir(copy, 6)) in one_error_line(proc)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial-*"))


def test_to_hf_refuses_a_checkpoint_without_a_manifest(copy, tmp_path):
    drop_manifest(copy, 6)
    with pytest.raises(ConfigError, match=r"manifest/metadata is missing"):
        to_hf(copy, tmp_path / "hf", log=lambda s: None)


def test_to_hf_trust_unverified_exports_the_same_tensors(copy, six_steps, tmp_path):
    drop_manifest(copy, 6)
    to_hf(copy, tmp_path / "trusted", log=lambda s: None, trust_unverified=True)
    to_hf(six_steps, tmp_path / "intact", log=lambda s: None)
    files = sorted(p.name for p in (tmp_path / "intact").glob("*.safetensors"))
    assert files and all(
        (tmp_path / "trusted" / f).read_bytes() == (tmp_path / "intact" / f).read_bytes() for f in files
    )


# --------------------------------------------------------------------------- the pieces


def test_a_host_array_checked_in_blocks_has_the_devices_checksums():
    x = np.random.default_rng(1).normal(size=(5, 13)).astype(np.float32)
    want = manifest.fingerprint({"x": jnp.asarray(x)})["arrays"]["x"]
    assert manifest.leaf_entry(x, block=7) == want


def test_a_manifest_that_is_not_json_is_a_corrupt_checkpoint(copy):
    (step_dir(copy, 6) / checkpoint.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(checkpoint.CorruptCheckpoint, match="cannot read the manifest"):
        checkpoint.read_manifest(step_dir(copy, 6))


class _RaisesWhenCollected:
    def __del__(self):
        raise RuntimeError("an abandoned read")


def test_ignored_exceptions_while_reading_are_one_line_not_a_dump(capfd):
    lines = []
    with checkpoint.quiet_reads(lines.append, "checkpoint 6"):
        for _ in range(50):
            _RaisesWhenCollected()
    assert "Exception ignored" not in capfd.readouterr().err and lines == [
        "note: reading checkpoint 6: 50 exception(s) ignored by the storage libraries "
        "(RuntimeError), not shown"
    ]
