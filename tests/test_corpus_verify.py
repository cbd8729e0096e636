"""A prepared corpus's shards are verified against the manifest (size and sha256) the first
time they are opened, and the result is remembered next to the corpus by size and mtime so
later opens pay a stat (``moe_train.data.verify``). Real corpora made by ``prepare`` with a
real tokenizer (tests/helpers.py)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    DOCS,
    ROOT,
    flip_byte,
    make_read_only,
    make_writable,
    prepare_run,
    sets,
    train_cli,
    write_txt,
)

from moe_train.data import DataError, prepared, verify


@pytest.fixture
def corpus(bpe, tmp_path) -> Path:
    """A prepared corpus of a few train shards and a val split."""
    out = tmp_path / "corpus"
    prepare_run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], out, shard_tokens=1500, val_fraction=0.1)
    return out


def records(corpus: Path) -> dict:
    return json.loads((corpus / verify.CACHE).read_text())["files"]


def test_a_shard_changed_in_place_is_refused_at_open(corpus):
    flip_byte(corpus / "train/shard_00001.bin")
    with pytest.raises(
        DataError,
        match=r"train/shard_00001\.bin: sha256 differs from the "
        r"manifest .*; rerun the python -m moe_train\.data prepare",
    ):
        prepared.open_split(corpus, "train")


def test_the_first_open_records_every_shard_file_by_size_mtime_and_inode(corpus):
    split = prepared.open_split(corpus, "train")
    want = {}
    for entry in split.manifest["splits"]["train"]["files"]:
        for rel in (entry["bin"], entry["idx"]):
            st = (corpus / rel).stat()
            want[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
    assert {k: (v["size"], v["mtime_ns"], v["inode"]) for k, v in records(corpus).items()} == want


def test_a_later_open_trusts_the_record_for_the_same_size_and_mtime(corpus):
    prepared.open_split(corpus, "train")
    flip_byte(corpus / "train/shard_00000.bin", keep_mtime=True)  # only a stat is paid
    assert len(prepared.open_split(corpus, "train")) > 0


def test_verify_true_hashes_despite_the_record(corpus):
    prepared.open_split(corpus, "train")
    flip_byte(corpus / "train/shard_00000.bin", keep_mtime=True)
    with pytest.raises(DataError, match=r"shard_00000\.bin: sha256 differs"):
        prepared.open_split(corpus, "train", verify=True)


def test_a_write_after_the_record_makes_the_next_open_hash_again(corpus):
    prepared.open_split(corpus, "train")
    flip_byte(corpus / "train/shard_00002.bin")
    with pytest.raises(DataError, match=r"shard_00002\.bin: sha256 differs"):
        prepared.open_split(corpus, "train")


def test_a_copy_of_a_recorded_corpus_is_hashed_again(corpus):
    prepared.open_split(corpus, "train")
    copy = shutil.copytree(corpus, corpus.parent / "copy")  # mtimes and verified.json kept
    flip_byte(copy / "train/shard_00000.bin", keep_mtime=True)
    with pytest.raises(DataError, match=r"copy/train/shard_00000\.bin: sha256 differs"):
        prepared.open_split(copy, "train")


def test_a_changed_index_file_is_refused(corpus):
    flip_byte(corpus / "val/shard_00000.idx.npy", at=130)
    with pytest.raises(DataError, match=r"val/shard_00000\.idx\.npy: sha256 differs"):
        prepared.open_split(corpus, "val")


def test_a_malformed_record_file_is_ignored_and_rewritten(corpus):
    (corpus / verify.CACHE).write_text('{"format": "moe_train.verified", "files": [1')
    prepared.open_split(corpus, "val")
    assert set(records(corpus)) == {"val/shard_00000.bin", "val/shard_00000.idx.npy"}


@pytest.fixture
def read_only(corpus):
    """``corpus`` with its top directory unwritable (its split folders stay writable)."""
    if not make_read_only(corpus):
        pytest.skip("cannot make a directory read-only for root here (no chattr +i)")
    yield corpus
    make_writable(corpus)


def test_a_read_only_corpus_opens_and_nothing_is_written_there(read_only):
    before = sorted(p.name for p in read_only.iterdir())
    prepared.open_split(read_only, "train")
    assert sorted(p.name for p in read_only.iterdir()) == before


def test_a_read_only_corpus_is_verified_at_every_open(read_only):
    prepared.open_split(read_only, "train")
    flip_byte(read_only / "train/shard_00000.bin", keep_mtime=True)  # nothing recorded to trust
    with pytest.raises(DataError, match=r"shard_00000\.bin: sha256 differs"):
        prepared.open_split(read_only, "train")


def test_a_second_process_waits_for_the_one_verifying(corpus):
    fd = os.open(corpus / verify.LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.lockf(fd, fcntl.LOCK_EX)  # as a process verifying the corpus holds it
    started = corpus.parent / "started"
    code = (
        "import sys; from pathlib import Path; from moe_train.data import prepared; "
        f"Path({str(started)!r}).touch(); prepared.open_split({str(corpus)!r}, 'train')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        deadline = time.time() + 60
        while not started.exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        waiting = proc.poll() is None
    finally:
        os.close(fd)
    assert waiting and proc.wait(timeout=60) == 0


def test_training_on_a_changed_shard_exits_2_naming_it(corpus):
    flip_byte(corpus / "train/shard_00001.bin")
    proc = train_cli(
        corpus.parent / "run",
        *sets(
            "data.source=prepared",
            f"data.path={corpus}",
            "model.vocab_size=512",
            "train.steps=2",
            "train.seq_len=32",
            "parallel.devices=1",
            "train.skip_selftest=true",
        ),
        timeout=600,
    )
    lines = proc.stderr.strip().splitlines()
    assert (proc.returncode, len(lines)) == (2, 1), proc.stderr
    assert lines[0].startswith(f"error: {corpus}/train/shard_00001.bin: sha256 differs")
