"""Every reader of a checkpoint's arrays verifies it first (``moe_train.checkpoints.checkpoint``).

Real runs write real orbax checkpoints here; the faults are done to their files: the manifest
deleted (an unverified checkpoint), another step's state put under a step's manifest (every
array readable, none the one saved), a directory renamed, NaN written into a step. Converted
weights (the real ``from-hf`` of a safetensors file) are damaged alike: a bit flipped in a
part's data file, a part's manifest deleted. Resume falls back past them; ``train.init_from``,
``score``, ``eval`` and ``to-hf`` refuse them with exit 2 and one line naming the file, unless
``--trust-unverified``.
"""

import asyncio
import gc
import inspect
import os
import re
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import QUIET, losses, one_error_line, run_module, score_cli, token_ids, write_tokens
from helpers import tiny_saving as tiny

from moe_train import config
from moe_train.base.exits import EXIT_CONFIG, EXIT_DIVERGED, EXIT_OK
from moe_train.checkpoints import checkpoint, manifest
from moe_train.config import ConfigError
from moe_train.convert.score import score
from moe_train.convert.to_hf import to_hf
from moe_train.train.loop import run


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


def change_optimizer_state(out: Path, step: int) -> None:
    """Step ``step``'s optimizer moments changed under its own manifest (damage that leaves them
    readable); the parameters and the expert bias untouched."""
    state = (step_dir(out, step) / "state").absolute()
    tree = ocp.PyTreeCheckpointer().restore(state)
    tree["opt_state"] = jax.tree.map(lambda a: a + 1 if a.dtype.kind == "f" else a, tree["opt_state"])
    ocp.PyTreeCheckpointer().save(state, tree, force=True)


def rejected(out: Path) -> list[str]:
    return sorted(p.name.split("-")[0] for p in (out / "checkpoints-rejected").iterdir())


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


def test_resume_falls_back_past_a_changed_optimizer_state(copy):
    change_optimizer_state(copy, 6)
    lines = []
    assert run(tiny(steps=8), copy, log=lines.append) == EXIT_OK
    assert f"resumed from {step_dir(copy, 4)} (step 4)" in lines and rejected(copy) == ["6"]


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


def test_init_from_refusing_an_unverified_checkpoint_names_the_key_that_trusts_it(copy, tmp_path):
    drop_manifest(copy, 6)
    with pytest.raises(ConfigError, match=r"; train\.init_from_trust_unverified=true reads it as it is$"):
        run(tiny(f"train.init_from={copy}", steps=1), tmp_path / "new", **QUIET)


def test_init_from_trust_unverified_starts_from_the_weights_as_they_are(copy, six_steps, tmp_path):
    drop_manifest(copy, 6)
    trusted = tiny(f"train.init_from={copy}", "train.init_from_trust_unverified=true", steps=1)
    assert run(trusted, tmp_path / "trusted", **QUIET) == EXIT_OK
    assert run(tiny(f"train.init_from={six_steps}", steps=1), tmp_path / "verified", **QUIET) == EXIT_OK
    assert losses(tmp_path / "trusted") == losses(tmp_path / "verified")


def test_init_from_trust_unverified_warns_naming_the_missing_file(copy, tmp_path):
    drop_manifest(copy, 6)
    lines = []
    cfg = tiny(f"train.init_from={copy}", "train.init_from_trust_unverified=true", steps=1)
    run(cfg, tmp_path / "new", log=lines.append)
    assert (
        f"WARNING: {step_dir(copy, 6) / 'manifest' / 'metadata'} is missing: reading "
        f"{step_dir(copy, 6)} unverified (train.init_from_trust_unverified=true)"
    ) in lines


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


import test_score  # noqa: E402

converted, kit = test_score.converted, test_score.kit  # fixtures: a converted Mixtral, a copy


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


def assert_init_from_refuses(kit: Path, out: Path, match: str) -> None:
    """``train.init_from`` of ``kit`` stops with a ConfigError that matches ``match``."""
    with pytest.raises(ConfigError, match=match):
        init_from(kit, out)


def test_init_from_refuses_damaged_converted_weights_naming_the_part(kit, tmp_path):
    from test_convert import damage

    part = re.escape(str(damage(kit)))
    match = rf"^{part}: .* do not match the manifest: params/layer_1/\S+ checksum differs"
    assert_init_from_refuses(kit, tmp_path / "new", match)


def test_to_hf_of_damaged_converted_weights_exits_2_and_writes_nothing(kit, tmp_path):
    from test_convert import damage

    damage(kit)
    proc = run_module("moe_train.convert", "to-hf", kit, tmp_path / "hf")
    assert proc.returncode == EXIT_CONFIG and str(kit) in one_error_line(proc.stderr)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial-*"))


def test_init_from_refuses_converted_weights_without_a_manifest_saying_convert_again(kit, tmp_path):
    from test_convert import drop_manifest

    missing = re.escape(str(drop_manifest(kit)))
    match = rf"^{missing} is missing: .*; convert it again with python -m moe_train.convert from-hf"
    assert_init_from_refuses(kit, tmp_path / "new", match)


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


def test_score_of_a_damaged_checkpoint_exits_2_naming_it(copy, tmp_path):
    swap_state(copy, 6, 2)
    proc = score_cli(copy, write_tokens(tmp_path / "ids.npy", token_ids()), "--devices", "1")
    assert proc.returncode == EXIT_CONFIG and str(step_dir(copy, 6)) in one_error_line(proc.stderr)


def test_score_of_a_checkpoint_without_a_manifest_exits_2_naming_the_file(copy, tmp_path):
    drop_manifest(copy, 6)
    proc = score_cli(copy, write_tokens(tmp_path / "ids.npy", token_ids()), "--devices", "1")
    assert proc.returncode == EXIT_CONFIG
    assert f"{step_dir(copy, 6) / 'manifest' / 'metadata'} is missing" in one_error_line(proc.stderr)


def test_trust_unverified_scores_a_checkpoint_without_a_manifest_as_it_is(copy, six_steps):
    drop_manifest(copy, 6)
    assert (
        score(str(copy), token_ids(), devices=1, trust_unverified=True)[0]
        == score(str(six_steps), token_ids(), devices=1)[0]
    )


def test_to_hf_of_a_damaged_checkpoint_exits_2_and_writes_nothing(copy, tmp_path):
    swap_state(copy, 6, 2)
    proc = run_module("moe_train.convert", "to-hf", copy, tmp_path / "hf")
    assert proc.returncode == EXIT_CONFIG and str(step_dir(copy, 6)) in one_error_line(proc.stderr)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial-*"))


def test_to_hf_refuses_a_checkpoint_without_a_manifest(copy, tmp_path):
    drop_manifest(copy, 6)
    with pytest.raises(ConfigError, match=r"manifest/metadata is missing"):
        to_hf(copy, tmp_path / "hf", log=lambda s: None)


def same_export(a: Path, b: Path) -> bool:
    """Whether two ``to-hf`` outputs hold the same safetensors files, byte for byte."""
    files = sorted(p.name for p in b.glob("*.safetensors"))
    return bool(files) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_to_hf_trust_unverified_exports_the_same_tensors(copy, six_steps, tmp_path):
    drop_manifest(copy, 6)
    to_hf(copy, tmp_path / "trusted", log=lambda s: None, trust_unverified=True)
    to_hf(six_steps, tmp_path / "intact", log=lambda s: None)
    assert same_export(tmp_path / "trusted", tmp_path / "intact")


# A changed optimizer state is caught by resume (above); score and to-hf never read it (each
# array they read is verified), so it cannot change what they give.


def test_score_of_a_checkpoint_whose_optimizer_state_changed_is_the_intact_score(copy, six_steps):
    change_optimizer_state(copy, 6)
    assert score(str(copy), token_ids(), devices=1)[0] == score(str(six_steps), token_ids(), devices=1)[0]


def test_to_hf_of_a_checkpoint_whose_optimizer_state_changed_exports_the_intact_tensors(
    copy, six_steps, tmp_path
):
    change_optimizer_state(copy, 6)
    to_hf(copy, tmp_path / "changed", log=lambda s: None)
    to_hf(six_steps, tmp_path / "intact", log=lambda s: None)
    assert same_export(tmp_path / "changed", tmp_path / "intact")


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


class _OrbaxLikeRead:
    """A read left pending in an event loop that was then closed, as Orbax leaves the other
    reads of a restore whose first read failed: closing it raises (Orbax's read coroutine
    turns the GeneratorExit into an ``Exception``)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.coro = self._read()
        self.task = self.loop.create_task(self.coro)
        self.loop.run_until_complete(asyncio.sleep(0))  # the read starts and waits
        self.loop.close()

    async def _read(self):
        try:
            await asyncio.get_running_loop().create_future()  # never resolved
        except BaseException as err:
            raise Exception("Encountered error while reading array index") from err


def test_reads_a_failed_read_abandoned_are_counted_against_it():
    lines = []
    with checkpoint.quiet_reads(lines.append, "checkpoint 4"):
        read = _OrbaxLikeRead()
    assert inspect.getcoroutinestate(read.coro) == inspect.CORO_CLOSED and lines == [
        "note: reading checkpoint 4: 1 exception(s) ignored by the storage libraries (Exception), not shown"
    ]


def test_the_next_checkpoint_read_is_not_blamed_for_the_previous_ones_abandoned_reads():
    lines = []
    with checkpoint.quiet_reads(lines.append, "checkpoint 4"):
        read = _OrbaxLikeRead()  # kept alive past the read, as its TensorStore read in flight does
    with checkpoint.quiet_reads(lines.append, "checkpoint 2"):
        del read  # that read completes now
    assert [line.startswith("note: reading checkpoint 4: ") for line in lines] == [True]


def test_abandoned_reads_leave_nothing_for_the_console_at_exit(capfd, monkeypatch):
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # Python's, which prints
    with checkpoint.quiet_reads(lambda line: None, "checkpoint 4"):
        read = _OrbaxLikeRead()
    del read
    gc.collect()
    assert capfd.readouterr().err == ""


class _ClosedLoopCallback:
    """A TensorStore read that completes after its event loop was closed: it calls back
    into the closed loop, whose RuntimeError Python reports as unraisable."""

    def __del__(self):
        raise RuntimeError("Event loop is closed")


def test_a_late_callback_into_a_closed_loop_is_not_printed_after_a_read(capfd, monkeypatch):
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    with checkpoint.quiet_reads(lambda line: None, "checkpoint 4"):
        pass
    _ClosedLoopCallback()
    gc.collect()
    assert "Event loop is closed" not in capfd.readouterr().err


def test_a_late_callback_from_an_earlier_read_is_not_counted_against_the_next_read():
    lines = []
    with checkpoint.quiet_reads(lines.append, "checkpoint 2"):
        _ClosedLoopCallback()  # checkpoint 4's read, abandoned before, completes now
    assert lines == []


def test_the_fallback_past_a_truncated_checkpoint_blames_only_it(copy):
    """The intact checkpoint read after a truncated one gets no note (the abandoned reads of
    the truncated one were intermittently finalized during the next read: 1 run in 8)."""
    state = step_dir(copy, 6) / "state"
    os.truncate(max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size), 1000)
    ckpt, lines = checkpoint.open_for(copy, tiny().train), []
    try:
        for _ in range(5):
            with checkpoint.quiet_reads(lines.append, "checkpoint 6"):
                with pytest.raises(Exception, match="error while reading"):
                    ckpt.restore_saved(6)
            with checkpoint.quiet_reads(lines.append, "checkpoint 4"):
                ckpt.restore_saved(4)
    finally:
        ckpt.close()
    assert not [line for line in lines if "checkpoint 4" in line]
