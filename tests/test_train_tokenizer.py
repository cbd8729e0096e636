"""Data from zero (``moe_train.data.train_tokenizer``): ``prepare --train-tokenizer N`` trains a
byte-level BPE on the inputs beside the corpus, a Hugging Face checkpoint directory serves as
``--tokenizer``, the summary prints the vocabulary, and the trainer takes
``model.vocab_size`` from the prepared corpus unless it is set. Real tokenizers throughout."""

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_prepare import CORPUS, paragraphs, write_txt

from moe_train.data import DataError, prepare
from moe_train.train import cli as cli_module

ROOT = Path(__file__).resolve().parent.parent


def trained(inputs, out: Path, size: int = 512, log=None) -> prepare.Summary:
    opts = prepare.Options(
        tokenizer="",
        inputs=tuple(str(i) for i in inputs),
        out=out,
        workers=1,
        val_fraction=0.0,
        train_tokenizer=size,
    )
    return prepare.run(opts, log=log or (lambda line: None), stream=io.StringIO())


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
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_train.data",
            "prepare",
            "--train-tokenizer",
            "100",
            "--input",
            str(CORPUS),
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr


def test_a_hugging_face_checkpoint_directory_is_a_tokenizer(corpus, tmp_path):
    """A checkpoint directory as from_pretrained reads it: config.json, tokenizer.json and a
    tokenizer_config.json that names the EOS."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(corpus[0] / "tokenizer.json", ckpt / "tokenizer.json")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "mixtral", "vocab_size": 512}))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    opts = prepare.Options(
        tokenizer=str(ckpt),
        inputs=(str(write_txt(tmp_path / "a.txt", paragraphs(20))),),
        out=tmp_path / "out",
        workers=1,
        val_fraction=0.0,
    )
    prepare.run(opts, log=lambda line: None, stream=io.StringIO())
    assert manifest(tmp_path / "out")["tokenizer"]["eos_source"] == "tokenizer_config.json eos_token"


def resolved(corpus_dir: Path, *sets: str):
    args = cli_module.parser().parse_args(
        [
            "--preset",
            "tiny",
            "--out",
            "x",
            "--set",
            "data.source=prepared",
            "--set",
            f"data.path={corpus_dir}",
            *[a for s in sets for a in ("--set", s)],
        ]
    )
    return cli_module.resolve(args)


def test_the_trainer_takes_the_vocabulary_from_the_manifest(corpus):
    assert resolved(corpus[0]).model.vocab_size == 512


def test_a_vocabulary_set_on_the_command_line_wins(corpus):
    assert resolved(corpus[0], "model.vocab_size=4096").model.vocab_size == 4096


def test_a_set_vocabulary_smaller_than_the_corpus_s_exits_2(corpus, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_train",
            "--preset",
            "tiny",
            "--out",
            str(tmp_path / "r"),
            "--steps",
            "1",
            "--set",
            "data.source=prepared",
            "--set",
            f"data.path={corpus[0]}",
            "--set",
            "model.vocab_size=300",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "model.vocab_size >= 512" in proc.stderr, proc.stderr
