"""``python -m moe_train.score`` and ``train.init_from`` on the kit's own runs: a run directory, one
step and a converted checkpoint all load; scores equal a direct forward pass; a run started
from weights takes them (fresh optimizer, step 0) and resumes itself later. Converted weights
(the real ``from-hf`` of a safetensors file) are verified against their manifests: they score
as read unverified, and damaged or manifest-less ones exit 2 with one line naming the file."""

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import QUIET, records, score_cli, tiny, token_ids, write_tokens

from moe_train.config import ConfigError
from moe_train.convert import weights
from moe_train.convert.score import score
from moe_train.data import make_source
from moe_train.train.loop import EXIT_CONFIG, EXIT_OK, run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert run(tiny(), out, **QUIET) == EXIT_OK
    return out


def test_a_run_and_its_last_step_score_alike(trained):
    a, logits = score(str(trained), token_ids())
    b, _ = score(str(trained / "checkpoints" / "2"), token_ids())
    assert a == b and logits.shape == (2, 17, 256) and logits.dtype == np.float32


def test_score_is_the_mean_next_token_cross_entropy_of_the_logits(trained):
    loss, logits = score(str(trained), token_ids())
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    want = -np.take_along_axis(np.asarray(logp), token_ids()[:, 1:, None], -1).mean()
    assert loss == pytest.approx(float(want), rel=1e-6)


def test_two_devices_score_as_one(trained):
    one, a = score(str(trained), token_ids(), devices=1)
    two, b = score(str(trained), token_ids(), devices=2)
    assert two == pytest.approx(one, rel=1e-6)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_cli_prints_loss_and_writes_logits(trained, tmp_path):
    tokens = write_tokens(tmp_path / "ids.npy", token_ids())
    proc = score_cli(trained, tokens, "--logits", tmp_path / "l.npy", "--devices", "1")
    assert proc.returncode == 0, proc.stderr
    assert "loss " in proc.stdout and "perplexity " in proc.stdout
    assert np.load(tmp_path / "l.npy").shape == (2, 17, 256)


@pytest.mark.parametrize(
    "bad,match",
    [
        (np.full((2, 5), 300), r"ids must be in \[0, 256\)"),
        (np.zeros((5,), np.int32), r"expected integer ids \[B, S\]"),
        (np.zeros((2, 5), np.float32), "expected integer ids"),
    ],
)
def test_bad_ids_exit_2_with_one_line(trained, tmp_path, bad, match):
    proc = score_cli(trained, write_tokens(tmp_path / "ids.npy", bad))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert pytest.importorskip("re").search(match, proc.stderr)


def test_a_path_without_weights_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no weights here"):
        weights.locate(tmp_path)


def test_init_from_starts_a_new_run_from_those_weights(trained, tmp_path):
    cfg = tiny(f"train.init_from={trained}", steps=1)
    assert run(cfg, tmp_path / "b", **QUIET) == EXIT_OK
    rec = records(tmp_path / "b")[0]
    assert rec["step"] == 1  # step 0 of a new run, not the source's step 2
    t = cfg.train
    batch = make_source(
        cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, batch_size=t.batch_size
    ).batch(0)
    want, _ = score(str(trained), np.asarray(batch))  # the first step's loss: before its update
    assert rec["loss"] == pytest.approx(want, rel=1e-5)


def test_a_run_started_from_weights_resumes_itself(trained, tmp_path):
    lines = []
    run(tiny(f"train.init_from={trained}", steps=1), tmp_path / "b", **QUIET)
    assert run(tiny(f"train.init_from={trained}", steps=2), tmp_path / "b", log=lines.append) == EXIT_OK
    assert any("resumed from" in line for line in lines)
    assert not any("initialised from" in line for line in lines)


def test_init_from_weights_of_another_shape_exits_2_naming_the_tensor(trained, tmp_path):
    cfg = tiny(f"train.init_from={trained}", "model.hidden=32", steps=1)
    with pytest.raises(
        ConfigError,
        match=r"tensor .*embed.* has shape \(256, 64\), this model "
        r"needs \(256, 32\)",
    ):
        run(cfg, tmp_path / "c", **QUIET)
    assert not (tmp_path / "c").exists() or EXIT_CONFIG == 2


def _npz(path: Path) -> None:
    with path.open("wb") as f:
        np.savez(f, ids=token_ids())


MALFORMED = {
    "no rows [0, 32]": lambda p: np.save(p, np.zeros((0, 32), np.int32)),
    "one token per row": lambda p: np.save(p, np.zeros((2, 1), np.int32)),
    "rank 3": lambda p: np.save(p, np.zeros((2, 3, 4), np.int32)),
    "bool ids": lambda p: np.save(p, np.ones((2, 5), bool)),
    "an empty file": lambda p: p.write_bytes(b""),
    "a truncated .npy": lambda p: (np.save(p, token_ids()), p.write_bytes(p.read_bytes()[:140])),
    "text, not .npy": lambda p: p.write_text("1 2 3\n"),
    "an .npz archive": _npz,
    "a directory": lambda p: p.mkdir(),
}


@pytest.mark.parametrize("make", MALFORMED, ids=list(MALFORMED))
def test_a_malformed_tokens_file_exits_2_with_one_line(trained, tmp_path, capsys, make):
    from moe_train.convert.score import main

    MALFORMED[make](tmp_path / "ids.npy")
    code = main([str(trained), "--tokens", str(tmp_path / "ids.npy"), "--devices", "1"])
    err = capsys.readouterr().err
    assert (
        code == EXIT_CONFIG
        and err.count("\n") == 1
        and err.startswith(f"error: --tokens {tmp_path / 'ids.npy'}: ")
    ), err


@pytest.mark.parametrize("devices", ["-1", "99"])
def test_a_device_count_this_machine_lacks_exits_2(trained, tmp_path, capsys, devices):
    from moe_train.convert.score import main

    tokens = write_tokens(tmp_path / "ids.npy", token_ids())
    code = main([str(trained), "--tokens", str(tokens), "--devices", devices])
    assert code == EXIT_CONFIG and capsys.readouterr().err.startswith(f"error: --devices {devices}:")


# --------------------------------------------------------------------------- converted weights


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A Mixtral converted by the real from-hf from a safetensors file (vocabulary 50)."""
    from test_convert import convert_mixtral

    return convert_mixtral(tmp_path_factory.mktemp("converted"))


@pytest.fixture
def kit(converted, tmp_path) -> Path:
    return Path(shutil.copytree(converted, tmp_path / "kit"))


def small_ids(tmp_path: Path) -> Path:
    return write_tokens(tmp_path / "ids.npy", token_ids() % 50)


def test_verified_converted_weights_score_as_unverified_ones(converted, kit):
    from test_convert import drop_manifest

    for part in ("model", "layer_0", "layer_1"):
        drop_manifest(kit, part)
    assert (
        score(str(converted), token_ids() % 50, devices=1)[0]
        == score(str(kit), token_ids() % 50, devices=1, trust_unverified=True)[0]
    )


def assert_score_refuses(kit: Path, tmp_path: Path, start: str) -> None:
    """Scoring ``kit`` exits 2 with one line that starts with ``start``."""
    proc = score_cli(kit, small_ids(tmp_path), "--devices", "1")
    assert (
        proc.returncode == EXIT_CONFIG and proc.stderr.count("\n") == 1 and proc.stderr.startswith(start)
    ), proc.stderr


def test_score_of_damaged_converted_weights_exits_2_naming_the_part(kit, tmp_path):
    from test_convert import damage

    assert_score_refuses(kit, tmp_path, f"error: {damage(kit)}: ")


def test_score_of_converted_weights_without_a_manifest_exits_2_naming_the_file(kit, tmp_path):
    from test_convert import drop_manifest

    assert_score_refuses(kit, tmp_path, f"error: {drop_manifest(kit)} is missing")
