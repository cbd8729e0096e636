"""Data from zero (``moe_train.data.train_tokenizer``): ``prepare --train-tokenizer N`` trains a
byte-level BPE on the inputs beside the corpus, a Hugging Face checkpoint directory serves as
``--tokenizer``, the summary prints the vocabulary, and the trainer takes
``model.vocab_size`` from the prepared corpus unless it is set. Real tokenizers throughout."""

import json
import shutil
from pathlib import Path

import pytest
from helpers import CORPUS, paragraphs, prepare_run, run_module, sets, train_cli, write_txt

from moe_train.data import DataError, prepare
from moe_train.train import cli as cli_module


def trained(inputs, out: Path, size: int = 512, log=None) -> prepare.Summary:
    return prepare_run("", inputs, out, log=log, train_tokenizer=size)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("corpus") / "c"
    lines: list[str] = []
    trained([CORPUS], out, log=lines.append)
    return out, lines


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_the_tokenizer_is_saved_beside_the_corpus(corpus):
    assert manifest(corpus[0])["tokenizer"]["path"] == str(corpus[0] / "tokenizer.json")


def test_the_vocabulary_has_the_asked_size(corpus):
    assert manifest(corpus[0])["vocab_size"] == 512


def test_the_summary_prints_the_vocabulary(corpus):
    assert any(line.startswith("  vocabulary: 512 tokens") for line in corpus[1]), corpus[1]


def test_the_trained_tokenizer_is_lossless(corpus):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(corpus[0] / "tokenizer.json"))
    docs = paragraphs(50)
    assert [tok.decode(tok.encode(d).ids) for d in docs] == docs


def test_training_twice_gives_the_same_tokenizer(corpus, tmp_path):
    trained([CORPUS], tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (corpus[0] / "tokenizer.json").read_bytes()


def test_a_rerun_reuses_the_tokenizer_and_the_shards(corpus, tmp_path):
    copy = shutil.copytree(corpus[0], tmp_path / "c")
    lines: list[str] = []
    assert trained([CORPUS], copy, log=lines.append).already, lines


def test_a_rerun_with_another_size_is_refused(corpus, tmp_path):
    copy = shutil.copytree(corpus[0], tmp_path / "c")
    with pytest.raises(DataError, match="trained_tokenizer"):
        trained([CORPUS], copy, size=1024)


def test_an_out_with_other_files_is_refused_before_training(tmp_path):
    (tmp_path / "mine.txt").write_text("x")
    with pytest.raises(DataError, match="not empty"):
        trained([CORPUS], tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()


def test_a_bad_input_stops_training_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text\n\nbroken \xff byte\n")
    with pytest.raises(DataError, match="bad.txt"):
        trained([bad], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_size_below_the_byte_alphabet_exits_2_with_one_line(tmp_path):
    args = ["prepare", "--train-tokenizer", 100, "--input", CORPUS, "--out", tmp_path / "o"]
    proc = run_module("moe_train.data", *args, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("size", ["0", "-3"])
def test_a_size_given_as_zero_or_less_is_named_not_called_missing(size, tmp_path, capsys):
    """argparse took ``--train-tokenizer 0`` (its old default) for no tokenizer at all."""
    from moe_train.data.__main__ import main

    argv = ["prepare", "--train-tokenizer", size, "--input", str(CORPUS), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    want = f"error: --train-tokenizer {size}: at least 257 (256 bytes and EOS), e.g. --train-tokenizer 8192\n"
    assert capsys.readouterr().err == want


def test_a_hugging_face_checkpoint_directory_is_a_tokenizer(corpus, tmp_path):
    """A checkpoint directory as from_pretrained reads it: config.json, tokenizer.json and a
    tokenizer_config.json that names the EOS."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(corpus[0] / "tokenizer.json", ckpt / "tokenizer.json")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "mixtral", "vocab_size": 512}))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    prepare_run(ckpt, [write_txt(tmp_path / "a.txt", paragraphs(20))], tmp_path / "out")
    assert manifest(tmp_path / "out")["tokenizer"]["eos_source"] == "tokenizer_config.json eos_token"


def resolved(corpus_dir: Path, *extra: str):
    args = cli_module.parser().parse_args(
        ["--preset", "tiny", "--out", "x", *sets("data.source=prepared", f"data.path={corpus_dir}", *extra)]
    )
    return cli_module.resolve(args)


def test_the_trainer_takes_the_vocabulary_from_the_manifest(corpus):
    assert resolved(corpus[0]).model.vocab_size == 512


def test_a_vocabulary_set_on_the_command_line_wins(corpus):
    assert resolved(corpus[0], "model.vocab_size=4096").model.vocab_size == 4096


def test_a_set_vocabulary_smaller_than_the_corpus_s_exits_2(corpus, tmp_path):
    proc = train_cli(
        tmp_path / "r",
        "--steps",
        "1",
        *sets("data.source=prepared", f"data.path={corpus[0]}", "model.vocab_size=300"),
        timeout=300,
    )
    assert proc.returncode == 2 and "model.vocab_size >= 512" in proc.stderr, proc.stderr
