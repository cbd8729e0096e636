"""``python -m moe_train.data prepare``: real tokenizers, real files, one property per test."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moe_train.data import DataError, prepare, prepared, progress, split, tokenizer
from moe_train.data import __main__ as prepare_cli

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "moe_train/assets/corpus.txt"


# ---------------------------------------------------------------------------------------------
# Tokenizers, trained here


def _train_bpe(path: Path, specials: list[str], vocab: int = 500) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(CORPUS)], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """Byte-level BPE (lossless) with ``</s>`` among its special tokens."""
    return _train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", ["<unk>", "</s>"])


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    """SentencePiece BPE, identity normalisation and byte fallback: lossless on any text."""
    import sentencepiece

    folder = tmp_path_factory.mktemp("spm")
    (folder / "train.txt").write_text(CORPUS.read_text(encoding="utf-8")[:150_000])
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "train.txt"),
        model_prefix=str(folder / "spm"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        minloglevel=2,
    )
    return folder / "spm.model"


def _decode(tok_path: Path, ids) -> str:
    if tok_path.suffix == ".model":
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(tok_path)).decode(list(ids))
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_path)).decode(list(ids), skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# Inputs and runs


def paragraphs(n: int) -> list[str]:
    """The first ``n`` blank-line separated documents of the shipped corpus."""
    text = CORPUS.read_text(encoding="utf-8")
    return [p.strip("\n") for p in re.split(r"\n(?:[ \t]*\n)+", text) if p.strip()][:n]


def write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def run(tok: Path, inputs, out: Path, **kw) -> prepare.Summary:
    kw.setdefault("workers", 1)
    kw.setdefault("val_fraction", 0.0)
    opts = prepare.Options(tokenizer=str(tok), inputs=tuple(str(i) for i in inputs), out=out, **kw)
    return prepare.run(opts, log=lambda line: None, stream=io.StringIO())


def error_of(tok: Path, inputs, out: Path, **kw) -> str:
    with pytest.raises(DataError) as info:
        run(tok, inputs, out, **kw)
    message = str(info.value)
    assert "\n" not in message
    return message


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_train.data", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def one_error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def files_of(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {k: v for k, v in files_of(out).items() if k.startswith(("train/", "val/"))}


def flip_byte(path: Path, at: int = 10, keep_mtime: bool = False) -> None:
    """Change one byte of ``path`` in place (same size). Its mtime moves 1 s later, as a later
    write's would whatever the file system's clock granularity, or stays (``keep_mtime``)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    later = 0 if keep_mtime else 1_000_000_000
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + later))


def decoded_docs(tok: Path, out: Path, name: str = "train") -> list[str]:
    s = prepared.open_split(out, name)
    return [_decode(tok, s.document(d)[:-1]) for d in range(len(s))]


DOCS = paragraphs(60)


# ---------------------------------------------------------------------------------------------
# Round trip


@pytest.mark.parametrize("which", ["bpe", "spm_model"])
def test_each_document_decodes_back_to_its_text(which, request, tmp_path):
    tok = request.getfixturevalue(which)
    run(tok, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=2000)
    assert decoded_docs(tok, tmp_path / "out") == DOCS


def test_every_document_ends_with_eos_and_has_no_eos_inside(bpe, tmp_path):
    run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=2000)
    s = prepared.open_split(tmp_path / "out")
    eos_positions = np.flatnonzero(s.tokens[0 : len(s.tokens)] == s.eos_id)
    np.testing.assert_array_equal(eos_positions, s.doc_starts[1:] - 1)


def test_eos_id_is_the_tokenizers_eos_token(bpe, tmp_path):
    run(bpe, [write_txt(tmp_path / "a.txt", DOCS[:3])], tmp_path / "out")
    from tokenizers import Tokenizer

    assert prepared.open_split(tmp_path / "out").eos_id == Tokenizer.from_file(str(bpe)).token_to_id("</s>")


def test_shard_index_holds_document_starts_then_the_token_count(bpe, tmp_path):
    run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=2000)
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(bpe))
    idx = np.load(tmp_path / "out/train/shard_00000.idx.npy")
    lengths = [len(t.encode(d, add_special_tokens=False).ids) + 1 for d in DOCS[: len(idx) - 1]]
    np.testing.assert_array_equal(idx, np.concatenate([[0], np.cumsum(lengths)]))
    assert (tmp_path / "out/train/shard_00000.bin").stat().st_size == 2 * idx[-1]


def test_no_document_is_split_across_shards_and_shards_respect_the_limit(bpe, tmp_path):
    run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=1500)
    man = json.loads((tmp_path / "out/manifest.json").read_text())
    files = man["splits"]["train"]["files"]
    assert len(files) > 2 and all(f["tokens"] <= 1500 for f in files)
    assert sum(f["documents"] for f in files) == len(DOCS)


# ---------------------------------------------------------------------------------------------
# Input formats


def test_jsonl_reads_the_text_field(bpe, tmp_path):
    run(bpe, [write_jsonl(tmp_path / "a.jsonl", DOCS[:20], "body")], tmp_path / "out", text_field="body")
    assert decoded_docs(bpe, tmp_path / "out") == DOCS[:20]


def test_parquet_gives_the_same_tokens_as_jsonl(bpe, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"id": list(range(20)), "text": DOCS[:20]}), tmp_path / "a.parquet", row_group_size=7
    )
    run(bpe, [tmp_path / "a.parquet"], tmp_path / "pq")
    run(bpe, [write_jsonl(tmp_path / "a.jsonl", DOCS[:20])], tmp_path / "js")
    assert shard_bytes(tmp_path / "pq") == shard_bytes(tmp_path / "js")


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl"])
def test_gzip_gives_the_same_tokens_as_plain(bpe, tmp_path, name):
    plain = (write_txt if name.endswith(".txt") else write_jsonl)(tmp_path / name, DOCS[:20])
    packed = tmp_path / "gz" / (name + ".gz")
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    run(bpe, [plain], tmp_path / "plain")
    run(bpe, [packed], tmp_path / "packed")
    assert shard_bytes(tmp_path / "plain") == shard_bytes(tmp_path / "packed")


def test_glob_is_expanded_in_sorted_order(bpe, tmp_path):
    (tmp_path / "in").mkdir()
    for name, docs in (("b.txt", DOCS[5:10]), ("a.txt", DOCS[:5]), ("c.txt", DOCS[10:15])):
        write_txt(tmp_path / "in" / name, docs)
    run(bpe, [tmp_path / "in/*.txt"], tmp_path / "out")
    man = json.loads((tmp_path / "out/manifest.json").read_text())
    assert [Path(i["path"]).name for i in man["inputs"]] == ["a.txt", "b.txt", "c.txt"]
    assert decoded_docs(bpe, tmp_path / "out") == DOCS[:15]


def test_split_on_file_makes_each_file_one_document(bpe, tmp_path):
    texts = ["\n\n".join(DOCS[i : i + 3]) + "\n" for i in (0, 3, 6)]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    run(bpe, [tmp_path / f"{i}.txt" for i in range(3)], tmp_path / "out", split_on="file")
    assert decoded_docs(bpe, tmp_path / "out") == texts


def test_crlf_and_whitespace_only_lines_separate_documents(bpe, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"one\r\nline two\r\n \t\r\n\r\nthree\r\n")
    run(bpe, [tmp_path / "a.txt"], tmp_path / "out")
    assert decoded_docs(bpe, tmp_path / "out") == ["one\nline two", "three"]


# ---------------------------------------------------------------------------------------------
# Determinism, reruns


def test_worker_count_does_not_change_the_bytes(bpe, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", paragraphs(3000))
    run(bpe, [data], tmp_path / "w1", workers=1, shard_tokens=20_000, val_fraction=0.05)
    run(bpe, [data], tmp_path / "w3", workers=3, shard_tokens=20_000, val_fraction=0.05)
    assert files_of(tmp_path / "w1") == files_of(tmp_path / "w3")


def test_same_job_gives_byte_identical_outputs(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    run(bpe, [data], tmp_path / "one", shard_tokens=2000, val_fraction=0.1)
    run(bpe, [data], tmp_path / "two", shard_tokens=2000, val_fraction=0.1)
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")


def _mtimes(out: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in out.rglob("shard_*")}


def test_a_rerun_of_a_finished_job_rewrites_nothing(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    run(bpe, [data], tmp_path / "out", shard_tokens=2000)
    before = _mtimes(tmp_path / "out")
    assert run(bpe, [data], tmp_path / "out", shard_tokens=2000).already
    assert _mtimes(tmp_path / "out") == before


def test_a_rerun_keeps_complete_shards_and_redoes_the_rest(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    out = tmp_path / "out"
    run(bpe, [data], out, shard_tokens=1500)
    reference, before = files_of(out), _mtimes(out)
    (out / "manifest.json").unlink()
    (out / "train/shard_00002.idx.npy").unlink()  # shard 2 is now unfinished
    summary = run(bpe, [data], out, shard_tokens=1500)
    assert summary.splits["train"].kept_shards == 2 and files_of(out) == reference
    assert all(
        _mtimes(out)[str(out / f"train/shard_0000{k}{ext}")] == before[str(out / f"train/shard_0000{k}{ext}")]
        for k in (0, 1)
        for ext in (".bin", ".idx.npy")
    )


def test_a_rerun_rebuilds_a_shard_changed_in_place(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    run(bpe, [data], tmp_path / "out", shard_tokens=1500)
    reference = shard_bytes(tmp_path / "out")
    flip_byte(tmp_path / "out/train/shard_00001.bin")
    run(bpe, [data], tmp_path / "out", shard_tokens=1500)
    assert shard_bytes(tmp_path / "out") == reference


def test_a_rerun_rewrites_only_the_shard_that_fails(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    out = tmp_path / "out"
    run(bpe, [data], out, shard_tokens=1500)
    flip_byte(out / "train/shard_00001.bin")
    before = _mtimes(out)
    run(bpe, [data], out, shard_tokens=1500)
    changed = {p for p, t in _mtimes(out).items() if before[p] != t}
    assert changed == {str(out / "train/shard_00001.bin"), str(out / "train/shard_00001.idx.npy")}


def test_a_rerun_names_the_shard_it_rebuilt_and_why(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    run(bpe, [data], tmp_path / "out", shard_tokens=1500)
    flip_byte(tmp_path / "out/train/shard_00002.bin")
    summary = run(bpe, [data], tmp_path / "out", shard_tokens=1500)
    assert summary.repaired == [
        "train/shard_00002.bin: sha256 differs from the manifest (changed in place or corrupted)"
    ]


def test_a_rerun_rebuilds_a_deleted_val_shard(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    run(bpe, [data], tmp_path / "out", shard_tokens=1500, val_fraction=0.2)
    reference = shard_bytes(tmp_path / "out")
    (tmp_path / "out/val/shard_00000.bin").unlink()
    run(bpe, [data], tmp_path / "out", shard_tokens=1500, val_fraction=0.2)
    assert shard_bytes(tmp_path / "out") == reference


def test_a_rerun_hashes_every_shard_whatever_was_recorded(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    run(bpe, [data], tmp_path / "out", shard_tokens=1500)
    prepared.open_split(tmp_path / "out")  # records every train shard as verified
    flip_byte(tmp_path / "out/train/shard_00000.bin", keep_mtime=True)
    assert run(bpe, [data], tmp_path / "out", shard_tokens=1500).repaired


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
    run(bpe, [data], tmp_path / "out", shard_tokens=2000)
    before = files_of(tmp_path / "out")
    message = error_of(bpe, [data], tmp_path / "out", **{"shard_tokens": 2000, **change})
    assert f"({key} differ)" in message and files_of(tmp_path / "out") == before


def test_a_rerun_with_other_inputs_is_refused(bpe, tmp_path):
    run(bpe, [write_txt(tmp_path / "a.txt", DOCS[:10])], tmp_path / "out")
    message = error_of(bpe, [write_txt(tmp_path / "a.txt", DOCS[:11])], tmp_path / "out")
    assert "inputs differ" in message


def test_a_foreign_non_empty_directory_is_refused(bpe, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out/notes.txt").write_text("mine")
    assert "not empty" in error_of(bpe, [write_txt(tmp_path / "a.txt", DOCS[:3])], tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# Validation split


def _distinct_docs(n: int) -> list[str]:
    return [f"document {i}: {d}" for i, d in enumerate(paragraphs(n))]


def test_val_split_is_disjoint_from_train_and_together_they_hold_every_document(bpe, tmp_path):
    docs = _distinct_docs(200)
    run(bpe, [write_jsonl(tmp_path / "a.jsonl", docs)], tmp_path / "out", val_fraction=0.2)
    train, val = decoded_docs(bpe, tmp_path / "out"), decoded_docs(bpe, tmp_path / "out", "val")
    assert val and not set(train) & set(val) and sorted(train + val) == sorted(docs)


def test_val_split_is_the_same_for_the_same_seed_and_differs_for_another(bpe, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", _distinct_docs(200))
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        run(bpe, [data], tmp_path / name, val_fraction=0.2, seed=seed)
    val = {n: decoded_docs(bpe, tmp_path / n, "val") for n in "abc"}
    assert val["a"] == val["b"] != val["c"]


def test_val_documents_are_scattered_not_a_block_at_either_end(bpe, tmp_path):
    docs = _distinct_docs(200)
    run(bpe, [write_jsonl(tmp_path / "a.jsonl", docs)], tmp_path / "out", val_fraction=0.2)
    where = sorted(docs.index(d) for d in decoded_docs(bpe, tmp_path / "out", "val"))
    assert where != list(range(where[0], where[0] + len(where)))


def test_val_docs_holds_out_exactly_n_documents_chosen_by_hash(bpe, tmp_path):
    docs = _distinct_docs(200)
    run(
        bpe,
        [write_jsonl(tmp_path / "a.jsonl", docs)],
        tmp_path / "out",
        val_docs=7,
        val_fraction=None,
        seed=3,
    )
    val = decoded_docs(bpe, tmp_path / "out", "val")
    assert val == [docs[i] for i in split.smallest(3, 200, 7)]


def test_vectorised_document_hash_equals_the_scalar_one():
    assert split.doc_hashes(5, 1000, 50).tolist() == [split.doc_hash(5, i) for i in range(1000, 1050)]


# ---------------------------------------------------------------------------------------------
# Bad inputs: exit 2, one line, nothing written


def test_missing_input_exits_2_with_one_line(bpe, tmp_path):
    proc = cli(
        "prepare",
        "--tokenizer",
        str(bpe),
        "--input",
        str(tmp_path / "nope.txt"),
        "--out",
        str(tmp_path / "out"),
    )
    assert "nope.txt: not found" in one_error_line(proc) and not (tmp_path / "out").exists()


def test_unreadable_tokenizer_exits_2_with_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    write_txt(tmp_path / "a.txt", DOCS[:2])
    proc = cli(
        "prepare",
        "--tokenizer",
        str(tmp_path / "tokenizer.json"),
        "--input",
        str(tmp_path / "a.txt"),
        "--out",
        str(tmp_path / "out"),
    )
    assert "cannot load it as a Hugging Face tokenizer.json" in one_error_line(proc)


def test_unreadable_sentencepiece_model_is_one_line(tmp_path):
    (tmp_path / "bad.model").write_bytes(b"\x00garbage")
    write_txt(tmp_path / "a.txt", DOCS[:2])
    assert "SentencePiece" in error_of(tmp_path / "bad.model", [tmp_path / "a.txt"], tmp_path / "o")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_names_it(bpe, tmp_path):
    path = write_txt(tmp_path / "a.txt", DOCS[:2])
    path.chmod(0)
    assert "a.txt: cannot read" in error_of(bpe, [path], tmp_path / "out")


def test_a_directory_as_input_is_an_error(bpe, tmp_path):
    (tmp_path / "d").mkdir()
    assert "a directory" in error_of(bpe, [tmp_path / "d"], tmp_path / "out")


def test_a_corrupt_gzip_file_names_it(bpe, tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(b"this is not gzip")
    message = error_of(bpe, [tmp_path / "a.txt.gz"], tmp_path / "o")
    assert "a.txt.gz: not a valid gzip file" in message


def test_a_truncated_gzip_file_names_it(bpe, tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"hello world\n" * 500)[:-20])
    message = error_of(bpe, [tmp_path / "a.txt.gz"], tmp_path / "o")
    assert "a.txt.gz: not a valid gzip file" in message


def test_an_empty_file_is_an_error(bpe, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    assert "a.txt: no documents (empty file)" in error_of(bpe, [tmp_path / "a.txt"], tmp_path / "o")


def test_a_file_of_blank_lines_is_an_error(bpe, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "  "}\n\n{"text": ""}\n')
    assert "a.jsonl: no documents (2 empty documents skipped)" in error_of(
        bpe, [tmp_path / "a.jsonl"], tmp_path / "o"
    )


def test_a_file_named_twice_is_an_error(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS[:3])
    assert "is already an input" in error_of(bpe, [data, tmp_path / "*.txt"], tmp_path / "out")


def test_a_glob_matching_nothing_is_an_error(bpe, tmp_path):
    assert "matches no file" in error_of(bpe, [tmp_path / "*.txt"], tmp_path / "out")


def test_invalid_utf8_names_the_line_and_byte_offset(bpe, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello\n\nworld \xff!\n")
    assert "a.txt:3: invalid UTF-8 at byte offset 13 (byte 0xff)" in error_of(
        bpe, [tmp_path / "a.txt"], tmp_path / "out"
    )


def test_invalid_utf8_in_gzip_counts_decompressed_bytes(bpe, tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"hello\n\nworld \xc3(\n"))
    assert "a.txt.gz:3: invalid UTF-8 at byte offset 13 of the decompressed stream" in error_of(
        bpe, [tmp_path / "a.txt.gz"], tmp_path / "out"
    )


def test_invalid_utf8_in_one_file_document_names_the_offset(bpe, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"ok\nstill ok\n\x80")
    assert "a.txt:3: invalid UTF-8 at byte offset 12" in error_of(
        bpe, [tmp_path / "a.txt"], tmp_path / "out", split_on="file"
    )


def test_missing_text_field_names_the_line(bpe, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n')
    message = error_of(bpe, [tmp_path / "a.jsonl"], tmp_path / "out")
    assert "a.jsonl:3: no 'text' field (fields: body)" in message and "--text-field" in message


def test_a_line_that_is_not_json_names_the_line(bpe, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n{"text": "b",\n')
    assert "a.jsonl:2: not JSON" in error_of(bpe, [tmp_path / "a.jsonl"], tmp_path / "out")


def test_a_non_string_text_field_names_the_line(bpe, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n{"text": 5}\n')
    assert "a.jsonl:2: field 'text' is a JSON int" in error_of(bpe, [tmp_path / "a.jsonl"], tmp_path / "out")


def test_a_parquet_null_names_the_row(bpe, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", None]}), tmp_path / "a.parquet")
    assert "a.parquet: row 2 (counting from 0): 'text' is null" in error_of(
        bpe, [tmp_path / "a.parquet"], tmp_path / "out"
    )


def test_a_bad_input_after_good_ones_writes_nothing(bpe, tmp_path):
    good = write_txt(tmp_path / "a.txt", DOCS)
    (tmp_path / "b.txt").write_bytes(b"fine\n\n\xfe\n")
    error_of(bpe, [good, tmp_path / "b.txt"], tmp_path / "out", shard_tokens=500)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Tokenizers: EOS, dtype


def test_eos_comes_from_tokenizer_config_json_next_to_the_tokenizer(tmp_path):
    folder = tmp_path / "tok"
    _train_bpe(folder / "tokenizer.json", ["</s>", "<|endoftext|>"], vocab=300)
    (folder / "tokenizer_config.json").write_text('{"eos_token": {"content": "<|endoftext|>"}}')
    info = tokenizer.load(str(folder))  # the directory form
    assert (info.eos_token, info.eos_source) == ("<|endoftext|>", "tokenizer_config.json eos_token")


def test_a_tokenizer_without_eos_exits_2_offering_eos_id(tmp_path):
    tok = _train_bpe(tmp_path / "tokenizer.json", [], vocab=300)
    message = error_of(tok, [write_txt(tmp_path / "a.txt", DOCS[:2])], tmp_path / "out")
    assert "no EOS token found" in message and "--eos-id" in message


def test_eos_id_flag_sets_the_eos(tmp_path):
    tok = _train_bpe(tmp_path / "tokenizer.json", [], vocab=300)
    run(tok, [write_txt(tmp_path / "a.txt", DOCS[:2])], tmp_path / "out", eos_id=7)
    s = prepared.open_split(tmp_path / "out")
    assert s.eos_id == 7 and s.document(0)[-1] == 7


def test_sentencepiece_eos_is_its_eos_id(spm_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    assert tokenizer.load(str(spm_model)).eos_id == sp.eos_id()


def test_small_vocabulary_is_stored_as_uint16(bpe, tmp_path):
    run(bpe, [write_txt(tmp_path / "a.txt", DOCS[:3])], tmp_path / "out")
    assert json.loads((tmp_path / "out/manifest.json").read_text())["dtype"] == "uint16"


def test_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(" ".join(DOCS[:5]).split()))
    vocab = {"[UNK]": 0, "</s>": 1} | {f"filler{i}": i for i in range(2, 65_600)}
    vocab |= {w: 65_600 + i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    run(tmp_path / "tokenizer.json", [write_txt(tmp_path / "a.txt", DOCS[:5])], tmp_path / "out")
    s = prepared.open_split(tmp_path / "out")
    want = tok.encode(DOCS[0], add_special_tokens=False).ids + [1]
    assert s.dtype == np.dtype("<u4") and s.document(0).tolist() == want and max(want) > 65_535


def test_token_dtype_by_vocabulary_size():
    assert tokenizer.token_dtype(65_536) == np.uint16 and tokenizer.token_dtype(65_537) == np.uint32
    with pytest.raises(DataError, match="does not fit uint32"):
        tokenizer.token_dtype(2**32 + 1)


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
    proc = subprocess.run(
        [sys.executable, "-m", "moe_train.data", *_cli_args(bpe, data, tmp_path / "out")],
        cwd=ROOT,
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "File too large" in one_error_line(proc, code=5)
    _assert_no_incomplete_shard_looks_complete(tmp_path / "out")
    assert not [p for p in (tmp_path / "out").rglob("*") if p.suffix in (".tmp", ".bin")]


@pytest.mark.slow
def test_a_killed_run_leaves_no_complete_looking_shard_and_a_rerun_finishes_it(bpe, tmp_path):
    data = _big_input(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_train.data", *_cli_args(bpe, data, out)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while not (out / "train/shard_00003.idx.npy").exists() and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _assert_no_incomplete_shard_looks_complete(out)
    assert cli(*_cli_args(bpe, data, out)).returncode == 0
    assert cli(*_cli_args(bpe, data, tmp_path / "clean")).returncode == 0
    assert files_of(out) == files_of(tmp_path / "clean")


# ---------------------------------------------------------------------------------------------
# Reader API, progress, CLI


def test_open_split_tokens_span_shards_like_one_array(bpe, tmp_path):
    run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=1500)
    s = prepared.open_split(tmp_path / "out", "train", verify=True)
    bins = sorted((tmp_path / "out/train").glob("*.bin"))
    whole = np.concatenate([np.fromfile(p, "<u2") for p in bins])
    assert len(s.shards) > 2 and len(s.tokens) == len(whole) == s.doc_starts[-1]
    np.testing.assert_array_equal(s.tokens[1000:4000], whole[1000:4000])
    assert s.tokens[-1] == whole[-1] == s.eos_id and s.vocab_size == 500


def test_open_split_refuses_a_truncated_shard(bpe, tmp_path):
    run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=1500)
    path = tmp_path / "out/train/shard_00001.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(DataError, match="shard_00001.bin: does not match the manifest"):
        prepared.open_split(tmp_path / "out")


def test_open_split_verify_false_checks_sizes_only(bpe, tmp_path):
    run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out")
    flip_byte(tmp_path / "out/train/shard_00000.bin")
    assert len(prepared.open_split(tmp_path / "out", verify=False)) == len(DOCS)


def test_manifest_records_the_tokenizer_and_inputs_with_checksums(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS)
    run(bpe, [data], tmp_path / "out")
    man = json.loads((tmp_path / "out/manifest.json").read_text())
    assert man["tokenizer"]["sha256"] == tokenizer.sha256_file(bpe)
    assert man["inputs"][0]["sha256"] == tokenizer.sha256_file(data)
    assert man["inputs"][0]["documents"] == len(DOCS) == man["splits"]["train"]["documents"]
    assert man["val"]["rule"] == "fraction" and man["policy"]["split_on"] == "blank-lines"


def test_progress_line_shows_rate_share_and_eta():
    text = progress.line("tokenize", 1200, 3_400_000, 10.0, 25, 100)
    assert text == "tokenize: 1,200 docs, 3.40M tokens, 340.00k tok/s, 25% of 100B, ETA 30s"


def test_progress_on_a_terminal_redraws_one_line(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(progress, "TTY_EVERY_S", 0.0)
    stream = Tty()
    p = progress.Progress("tokenize", 100, stream)
    p.update(1, 10, 50)
    p.update(2, 20, 60)
    p.close()
    assert stream.getvalue().count("\r") == 2 and stream.getvalue().endswith("\n")


def test_a_short_run_off_a_terminal_prints_only_the_summary(bpe, tmp_path):
    stream, lines = io.StringIO(), []
    data = write_txt(tmp_path / "a.txt", DOCS)
    prepare.run(
        prepare.Options(tokenizer=str(bpe), inputs=(str(data),), out=tmp_path / "out", workers=1),
        log=lines.append,
        stream=stream,
    )
    assert stream.getvalue() == "" and lines[0].startswith(f"prepared {tmp_path / 'out'}")
    assert re.match(r"  train: [\d,]+ documents, [\d,]+ tokens \(uint16\), 1 shard$", lines[1])


def test_cli_prepares_and_prints_the_summary(bpe, tmp_path):
    first, second = write_txt(tmp_path / "a.txt", DOCS[:30]), write_txt(tmp_path / "b.txt", DOCS[30:])
    proc = cli(
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
