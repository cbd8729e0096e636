"""``python -m moe_train.eval``: a saved run's held-out loss equals the one its run logged, and
bad weights or data exit 2 with one line. Prepared corpora are built with a small real BPE
(tests/helpers.py)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import QUIET, paragraphs, prepare_run, records, run_module, tiny, train_bpe, write_jsonl

from moe_train.eval import evaluate_weights
from moe_train.train.loop import EXIT_OK, run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval")
    tok = train_bpe(root / "tok/tokenizer.json", ["<unk>", "</s>"], vocab=300)
    data = write_jsonl(root / "docs.jsonl", [f"doc {i}: {d}" for i, d in enumerate(paragraphs(80))])
    prepare_run(tok, [data], root / "prep", val_fraction=0.25)
    prepare_run(tok, [data], root / "no_val", val_fraction=0.0)
    return root


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    cfg = tiny(
        "data.source=prepared",
        f"data.path={corpus / 'prep'}",
        "model.vocab_size=320",
        "train.eval_every=2",
        "train.seq_len=32",
    )
    assert run(cfg, out, **QUIET) == EXIT_OK
    return out


def test_eval_of_a_run_equals_the_eval_loss_it_logged(trained, corpus):
    logged = records(trained)
    want = [r for r in logged if "eval_loss" in r][-1]
    got = evaluate_weights(str(trained), str(corpus / "prep"), devices=1, batch_size=8)
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    assert got["eval_tokens"] == want["eval_tokens"]


def test_two_devices_evaluate_as_one(trained, corpus):
    one = evaluate_weights(str(trained), str(corpus / "prep"), devices=1, batch_size=8)
    two = evaluate_weights(str(trained), str(corpus / "prep"), devices=2, batch_size=8)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)


def cli(*args):
    return run_module("moe_train.eval", *args)


def test_cli_prints_loss_and_perplexity(trained, corpus):
    proc = cli(trained, "--data", corpus / "prep", "--devices", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["eval_ppl"] == pytest.approx(2.718281828 ** out["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("data,match", [("no_val", "val"), ("missing", "missing")])
def test_data_without_a_val_split_exits_2_with_one_line(trained, corpus, data, match):
    proc = cli(trained, "--data", corpus / data, "--devices", "1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert match in proc.stderr


def test_a_directory_without_weights_exits_2(corpus):
    proc = cli(corpus, "--data", corpus / "prep")
    assert proc.returncode == 2 and "no weights here" in proc.stderr


def unverified_copy(trained: Path, tmp_path: Path) -> Path:
    """The run with its newest checkpoint's manifest deleted."""
    out = Path(shutil.copytree(trained, tmp_path / "run"))
    shutil.rmtree(out / "checkpoints" / "2" / "manifest")
    return out


def test_a_checkpoint_without_a_manifest_exits_2_naming_the_file(trained, corpus, tmp_path):
    out = unverified_copy(trained, tmp_path)
    proc = cli(out, "--data", corpus / "prep", "--devices", "1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"error: {out / 'checkpoints' / '2' / 'manifest' / 'metadata'} is missing" in proc.stderr


def test_trust_unverified_evaluates_it_as_it_is(trained, corpus, tmp_path):
    out = unverified_copy(trained, tmp_path)
    got = evaluate_weights(str(out), str(corpus / "prep"), devices=1, batch_size=8, trust_unverified=True)
    want = evaluate_weights(str(trained), str(corpus / "prep"), devices=1, batch_size=8)
    assert got["eval_loss"] == want["eval_loss"]


def test_a_missing_data_dir_is_named_as_the_flag_the_user_typed(tmp_path):
    missing = tmp_path / "no-such"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_train.eval", str(tmp_path), "--data", str(missing)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: --data {missing} not found; expected a directory written by python -m moe_train.data prepare"
    )
