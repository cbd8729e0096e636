"""``python -m moe_train.data prepare`` (``moe_train.data.prepare``): real tokenizers, real files,
one property per test. Inputs, the validation split, tokenizers, the reader and progress are in
test_prepare_inputs.py, test_prepare_split.py, test_prepare_tokenizer.py, test_prepared.py and
test_prepare_progress.py."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    DOCS,
    data_cli,
    decoded_docs,
    files_of,
    flip_byte,
    paragraphs,
    prepare_error,
    prepare_run,
    refused,
    run_module,
    shard_bytes,
    start_module,
    write_jsonl,
    write_txt,
)

from moe_train.data import DataError, prepared, tokenizer
from moe_train.data import __main__ as prepare_cli

# ---------------------------------------------------------------------------------------------
# Round trip


@pytest.mark.parametrize("which", ["bpe", "spm_model"])
def test_each_document_decodes_back_to_its_text(which, request, tmp_path):
    tok = request.getfixturevalue(which)
    prepare_run(tok, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=2000)
    assert decoded_docs(tok, tmp_path / "out") == DOCS


def test_every_document_ends_with_eos_and_has_no_eos_inside(bpe, tmp_path):
    prepare_run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=2000)
    s = prepared.open_split(tmp_path / "out")
    eos_positions = np.flatnonzero(s.tokens[0 : len(s.tokens)] == s.eos_id)
    np.testing.assert_array_equal(eos_positions, s.doc_starts[1:] - 1)


def test_eos_id_is_the_tokenizers_eos_token(bpe, tmp_path):
    prepare_run(bpe, [write_txt(tmp_path / "a.txt", DOCS[:3])], tmp_path / "out")
    from tokenizers import Tokenizer

    assert prepared.open_split(tmp_path / "out").eos_id == Tokenizer.from_file(str(bpe)).token_to_id("</s>")


def test_shard_index_holds_document_starts_then_the_token_count(bpe, tmp_path):
    prepare_run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=2000)
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(bpe))
    idx = np.load(tmp_path / "out/train/shard_00000.idx.npy")
    lengths = [len(t.encode(d, add_special_tokens=False).ids) + 1 for d in DOCS[: len(idx) - 1]]
    np.testing.assert_array_equal(idx, np.concatenate([[0], np.cumsum(lengths)]))
    assert (tmp_path / "out/train/shard_00000.bin").stat().st_size == 2 * idx[-1]


def test_no_document_is_split_across_shards_and_shards_respect_the_limit(bpe, tmp_path):
    prepare_run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=1500)
    man = json.loads((tmp_path / "out/manifest.json").read_text())
    files = man["splits"]["train"]["files"]
    assert len(files) > 2 and all(f["tokens"] <= 1500 for f in files)
    assert sum(f["documents"] for f in files) == len(DOCS)


# ---------------------------------------------------------------------------------------------
# Determinism, reruns


def test_worker_count_does_not_change_the_bytes(bpe, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", paragraphs(3000))
    prepare_run(bpe, [data], tmp_path / "w1", workers=1, shard_tokens=20_000, val_fraction=0.05)
    prepare_run(bpe, [data], tmp_path / "w3", workers=3, shard_tokens=20_000, val_fraction=0.05)
    assert files_of(tmp_path / "w1") == files_of(tmp_path / "w3")


def test_same_job_gives_byte_identical_outputs(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    prepare_run(bpe, [data], tmp_path / "one", shard_tokens=2000, val_fraction=0.1)
    prepare_run(bpe, [data], tmp_path / "two", shard_tokens=2000, val_fraction=0.1)
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")


def _mtimes(out: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in out.rglob("shard_*")}


def test_a_rerun_of_a_finished_job_rewrites_nothing(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    prepare_run(bpe, [data], tmp_path / "out", shard_tokens=2000)
    before = _mtimes(tmp_path / "out")
    assert prepare_run(bpe, [data], tmp_path / "out", shard_tokens=2000).already
    assert _mtimes(tmp_path / "out") == before


def test_a_rerun_keeps_complete_shards_and_redoes_the_rest(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    out = tmp_path / "out"
    prepare_run(bpe, [data], out, shard_tokens=1500)
    reference, before = files_of(out), _mtimes(out)
    (out / "manifest.json").unlink()
    (out / "train/shard_00002.idx.npy").unlink()  # shard 2 is now unfinished
    summary = prepare_run(bpe, [data], out, shard_tokens=1500)
    assert summary.splits["train"].kept_shards == 2 and files_of(out) == reference
    assert all(
        _mtimes(out)[str(out / f"train/shard_0000{k}{ext}")] == before[str(out / f"train/shard_0000{k}{ext}")]
        for k in (0, 1)
        for ext in (".bin", ".idx.npy")
    )


def test_a_rerun_rebuilds_a_shard_changed_in_place(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    prepare_run(bpe, [data], tmp_path / "out", shard_tokens=1500)
    reference = shard_bytes(tmp_path / "out")
    flip_byte(tmp_path / "out/train/shard_00001.bin")
    prepare_run(bpe, [data], tmp_path / "out", shard_tokens=1500)
    assert shard_bytes(tmp_path / "out") == reference


def test_a_rerun_rewrites_only_the_shard_that_fails(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    out = tmp_path / "out"
    prepare_run(bpe, [data], out, shard_tokens=1500)
    flip_byte(out / "train/shard_00001.bin")
    before = _mtimes(out)
    prepare_run(bpe, [data], out, shard_tokens=1500)
    changed = {p for p, t in _mtimes(out).items() if before[p] != t}
    assert changed == {str(out / "train/shard_00001.bin"), str(out / "train/shard_00001.idx.npy")}


def test_a_rerun_names_the_shard_it_rebuilt_and_why(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    prepare_run(bpe, [data], tmp_path / "out", shard_tokens=1500)
    flip_byte(tmp_path / "out/train/shard_00002.bin")
    summary = prepare_run(bpe, [data], tmp_path / "out", shard_tokens=1500)
    assert summary.repaired == [
        "train/shard_00002.bin: sha256 differs from the manifest (changed in place or corrupted)"
    ]


def test_a_rerun_rebuilds_a_deleted_val_shard(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    prepare_run(bpe, [data], tmp_path / "out", shard_tokens=1500, val_fraction=0.2)
    reference = shard_bytes(tmp_path / "out")
    (tmp_path / "out/val/shard_00000.bin").unlink()
    prepare_run(bpe, [data], tmp_path / "out", shard_tokens=1500, val_fraction=0.2)
    assert shard_bytes(tmp_path / "out") == reference


def test_a_rerun_hashes_every_shard_whatever_was_recorded(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    prepare_run(bpe, [data], tmp_path / "out", shard_tokens=1500)
    prepared.open_split(tmp_path / "out")  # records every train shard as verified
    flip_byte(tmp_path / "out/train/shard_00000.bin", keep_mtime=True)
    assert prepare_run(bpe, [data], tmp_path / "out", shard_tokens=1500).repaired


@pytest.mark.parametrize(
    "change, key",
    [
        ({"seed": 1}, "val"),
        ({"shard_tokens": 999}, "shard_tokens"),
        ({"val_docs": 3, "val_fraction": None}, "val"),
    ],
)
def test_a_rerun_with_other_options_is_refused(bpe, tmp_path, change, key):
    data = write_txt(tmp_path / "a.txt", DOCS[:10])
    prepare_run(bpe, [data], tmp_path / "out", shard_tokens=2000)
    before = files_of(tmp_path / "out")
    message = prepare_error(bpe, [data], tmp_path / "out", **{"shard_tokens": 2000, **change})
    assert f"({key} differ)" in message and files_of(tmp_path / "out") == before


def test_a_rerun_with_other_inputs_is_refused(bpe, tmp_path):
    prepare_run(bpe, [write_txt(tmp_path / "a.txt", DOCS[:10])], tmp_path / "out")
    message = prepare_error(bpe, [write_txt(tmp_path / "a.txt", DOCS[:11])], tmp_path / "out")
    assert "inputs differ" in message


def test_a_foreign_non_empty_directory_is_refused(bpe, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out/notes.txt").write_text("mine")
    assert "not empty" in prepare_error(bpe, [write_txt(tmp_path / "a.txt", DOCS[:3])], tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# Failures leave nothing that looks complete


def _assert_no_incomplete_shard_looks_complete(out: Path) -> None:
    assert not (out / "manifest.json").exists()
    for idx in out.rglob("*.idx.npy"):
        starts = np.load(idx)
        assert idx.with_name(idx.name.replace(".idx.npy", ".bin")).stat().st_size == 2 * starts[-1]
    with pytest.raises(DataError, match="not a finished prepared corpus"):
        prepared.open_split(out)


def _big_input(tmp_path: Path) -> Path:
    docs = paragraphs(4000)
    return write_jsonl(tmp_path / "big.jsonl", [f"{k} {d}" for k in range(8) for d in docs])


def _cli_args(tok: Path, data: Path, out: Path) -> list[str]:
    return [
        "prepare",
        "--tokenizer",
        str(tok),
        "--input",
        str(data),
        "--out",
        str(out),
        "--workers",
        "1",
        "--shard-tokens",
        "20000",
        "--val-fraction",
        "0.01",
    ]


def test_a_size_limited_output_exits_5_and_leaves_no_complete_looking_shard(bpe, tmp_path):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))

    data = write_jsonl(tmp_path / "a.jsonl", paragraphs(600))
    proc = run_module(
        "moe_train.data", *_cli_args(bpe, data, tmp_path / "out"), preexec_fn=limit, timeout=120
    )
    assert "File too large" in refused(proc, code=5)
    _assert_no_incomplete_shard_looks_complete(tmp_path / "out")
    assert not [p for p in (tmp_path / "out").rglob("*") if p.suffix in (".tmp", ".bin")]


@pytest.mark.slow
def test_a_killed_run_leaves_no_complete_looking_shard_and_a_rerun_finishes_it(bpe, tmp_path):
    data = _big_input(tmp_path)
    out = tmp_path / "out"
    proc = start_module(
        "moe_train.data", *_cli_args(bpe, data, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while not (out / "train/shard_00003.idx.npy").exists() and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _assert_no_incomplete_shard_looks_complete(out)
    assert data_cli(*_cli_args(bpe, data, out)).returncode == 0
    assert data_cli(*_cli_args(bpe, data, tmp_path / "clean")).returncode == 0
    assert files_of(out) == files_of(tmp_path / "clean")


# ---------------------------------------------------------------------------------------------
# The manifest, the command line


def test_manifest_records_the_tokenizer_and_inputs_with_checksums(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    prepare_run(bpe, [data], tmp_path / "out")
    man = json.loads((tmp_path / "out/manifest.json").read_text())
    assert man["tokenizer"]["sha256"] == tokenizer.sha256_file(bpe)
    assert man["inputs"][0]["sha256"] == tokenizer.sha256_file(data)
    assert man["inputs"][0]["documents"] == len(DOCS) == man["splits"]["train"]["documents"]
    assert man["val"]["rule"] == "fraction" and man["policy"]["split_on"] == "blank-lines"


def test_cli_prepares_and_prints_the_summary(bpe, tmp_path):
    first, second = write_txt(tmp_path / "a.txt", DOCS[:30]), write_txt(tmp_path / "b.txt", DOCS[30:])
    proc = data_cli(
        "prepare",
        "--tokenizer",
        str(bpe),
        "--input",
        str(first),
        "--input",
        str(second),
        "--out",
        str(tmp_path / "out"),
        "--val-docs",
        "5",
        "--workers",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    assert f"  train: {len(DOCS) - 5} documents" in proc.stdout and "  val: 5 documents" in proc.stdout


def test_help_states_the_split_and_utf8_policies(capsys):
    with pytest.raises(SystemExit):
        prepare_cli.main(["prepare", "--help"])
    text = capsys.readouterr().out
    assert "separated by one or more blank lines" in text and "UTF-8 is strict" in text
