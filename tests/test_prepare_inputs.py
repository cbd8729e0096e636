"""The inputs of ``prepare`` (``moe_train.data.inputs``): each format read alike, and each bad
input refused before anything is written, with one line naming the file and where."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from helpers import (
    DOCS,
    data_cli,
    decoded_docs,
    prepare_error,
    prepare_run,
    refused,
    shard_bytes,
    write_jsonl,
    write_txt,
)

# ---------------------------------------------------------------------------------------------
# Input formats


def test_jsonl_reads_the_text_field(bpe, tmp_path):
    prepare_run(
        bpe, [write_jsonl(tmp_path / "a.jsonl", DOCS[:20], "body")], tmp_path / "out", text_field="body"
    )
    assert decoded_docs(bpe, tmp_path / "out") == DOCS[:20]


def test_parquet_gives_the_same_tokens_as_jsonl(bpe, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"id": list(range(20)), "text": DOCS[:20]}), tmp_path / "a.parquet", row_group_size=7
    )
    prepare_run(bpe, [tmp_path / "a.parquet"], tmp_path / "pq")
    prepare_run(bpe, [write_jsonl(tmp_path / "a.jsonl", DOCS[:20])], tmp_path / "js")
    assert shard_bytes(tmp_path / "pq") == shard_bytes(tmp_path / "js")


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl"])
def test_gzip_gives_the_same_tokens_as_plain(bpe, tmp_path, name):
    plain = (write_txt if name.endswith(".txt") else write_jsonl)(tmp_path / name, DOCS[:20])
    packed = tmp_path / "gz" / (name + ".gz")
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    prepare_run(bpe, [plain], tmp_path / "plain")
    prepare_run(bpe, [packed], tmp_path / "packed")
    assert shard_bytes(tmp_path / "plain") == shard_bytes(tmp_path / "packed")


def test_glob_is_expanded_in_sorted_order(bpe, tmp_path):
    (tmp_path / "in").mkdir()
    for name, docs in (("b.txt", DOCS[5:10]), ("a.txt", DOCS[:5]), ("c.txt", DOCS[10:15])):
        write_txt(tmp_path / "in" / name, docs)
    prepare_run(bpe, [tmp_path / "in/*.txt"], tmp_path / "out")
    man = json.loads((tmp_path / "out/manifest.json").read_text())
    assert [Path(i["path"]).name for i in man["inputs"]] == ["a.txt", "b.txt", "c.txt"]
    assert decoded_docs(bpe, tmp_path / "out") == DOCS[:15]


def test_split_on_file_makes_each_file_one_document(bpe, tmp_path):
    texts = ["\n\n".join(DOCS[i : i + 3]) + "\n" for i in (0, 3, 6)]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    prepare_run(bpe, [tmp_path / f"{i}.txt" for i in range(3)], tmp_path / "out", split_on="file")
    assert decoded_docs(bpe, tmp_path / "out") == texts


def test_crlf_and_whitespace_only_lines_separate_documents(bpe, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"one\r\nline two\r\n \t\r\n\r\nthree\r\n")
    prepare_run(bpe, [tmp_path / "a.txt"], tmp_path / "out")
    assert decoded_docs(bpe, tmp_path / "out") == ["one\nline two", "three"]


# ---------------------------------------------------------------------------------------------
# Bad inputs: exit 2, one line, nothing written


def test_missing_input_exits_2_with_one_line(bpe, tmp_path):
    proc = data_cli(
        "prepare",
        "--tokenizer",
        str(bpe),
        "--input",
        str(tmp_path / "nope.txt"),
        "--out",
        str(tmp_path / "out"),
    )
    assert "nope.txt: not found" in refused(proc) and not (tmp_path / "out").exists()


def test_unreadable_tokenizer_exits_2_with_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    write_txt(tmp_path / "a.txt", DOCS[:2])
    proc = data_cli(
        "prepare",
        "--tokenizer",
        str(tmp_path / "tokenizer.json"),
        "--input",
        str(tmp_path / "a.txt"),
        "--out",
        str(tmp_path / "out"),
    )
    assert "cannot load it as a Hugging Face tokenizer.json" in refused(proc)


def test_unreadable_sentencepiece_model_is_one_line(tmp_path):
    (tmp_path / "bad.model").write_bytes(b"\x00garbage")
    write_txt(tmp_path / "a.txt", DOCS[:2])
    assert "SentencePiece" in prepare_error(tmp_path / "bad.model", [tmp_path / "a.txt"], tmp_path / "o")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_names_it(bpe, tmp_path):
    path = write_txt(tmp_path / "a.txt", DOCS[:2])
    path.chmod(0)
    assert "a.txt: cannot read" in prepare_error(bpe, [path], tmp_path / "out")


def test_a_directory_as_input_is_an_error(bpe, tmp_path):
    (tmp_path / "d").mkdir()
    assert "a directory" in prepare_error(bpe, [tmp_path / "d"], tmp_path / "out")


def test_a_corrupt_gzip_file_names_it(bpe, tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(b"this is not gzip")
    message = prepare_error(bpe, [tmp_path / "a.txt.gz"], tmp_path / "o")
    assert "a.txt.gz: not a valid gzip file" in message


def test_a_truncated_gzip_file_names_it(bpe, tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"hello world\n" * 500)[:-20])
    message = prepare_error(bpe, [tmp_path / "a.txt.gz"], tmp_path / "o")
    assert "a.txt.gz: not a valid gzip file" in message


def test_an_empty_file_is_an_error(bpe, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    assert "a.txt: no documents (empty file)" in prepare_error(bpe, [tmp_path / "a.txt"], tmp_path / "o")


def test_a_file_of_blank_lines_is_an_error(bpe, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "  "}\n\n{"text": ""}\n')
    assert "a.jsonl: no documents (2 empty documents skipped)" in prepare_error(
        bpe, [tmp_path / "a.jsonl"], tmp_path / "o"
    )


def test_a_file_named_twice_is_an_error(bpe, tmp_path):
    data = write_txt(tmp_path / "a.txt", DOCS[:3])
    assert "is already an input" in prepare_error(bpe, [data, tmp_path / "*.txt"], tmp_path / "out")


def test_a_glob_matching_nothing_is_an_error(bpe, tmp_path):
    assert "matches no file" in prepare_error(bpe, [tmp_path / "*.txt"], tmp_path / "out")


def test_invalid_utf8_names_the_line_and_byte_offset(bpe, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello\n\nworld \xff!\n")
    assert "a.txt:3: invalid UTF-8 at byte offset 13 (byte 0xff)" in prepare_error(
        bpe, [tmp_path / "a.txt"], tmp_path / "out"
    )


def test_invalid_utf8_in_gzip_counts_decompressed_bytes(bpe, tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"hello\n\nworld \xc3(\n"))
    assert "a.txt.gz:3: invalid UTF-8 at byte offset 13 of the decompressed stream" in prepare_error(
        bpe, [tmp_path / "a.txt.gz"], tmp_path / "out"
    )


def test_invalid_utf8_in_one_file_document_names_the_offset(bpe, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"ok\nstill ok\n\x80")
    assert "a.txt:3: invalid UTF-8 at byte offset 12" in prepare_error(
        bpe, [tmp_path / "a.txt"], tmp_path / "out", split_on="file"
    )


def test_missing_text_field_names_the_line(bpe, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n')
    message = prepare_error(bpe, [tmp_path / "a.jsonl"], tmp_path / "out")
    assert "a.jsonl:3: no 'text' field (fields: body)" in message and "--text-field" in message


def test_a_line_that_is_not_json_names_the_line(bpe, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n{"text": "b",\n')
    assert "a.jsonl:2: not JSON" in prepare_error(bpe, [tmp_path / "a.jsonl"], tmp_path / "out")


def test_a_non_string_text_field_names_the_line(bpe, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n{"text": 5}\n')
    message = prepare_error(bpe, [tmp_path / "a.jsonl"], tmp_path / "out")
    assert "a.jsonl:2: field 'text' is a JSON int" in message


def test_a_parquet_null_names_the_row(bpe, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", None]}), tmp_path / "a.parquet")
    assert "a.parquet: row 2 (counting from 0): 'text' is null" in prepare_error(
        bpe, [tmp_path / "a.parquet"], tmp_path / "out"
    )


def test_a_bad_input_after_good_ones_writes_nothing(bpe, tmp_path):
    good = write_txt(tmp_path / "a.txt", DOCS)
    (tmp_path / "b.txt").write_bytes(b"fine\n\n\xfe\n")
    prepare_error(bpe, [good, tmp_path / "b.txt"], tmp_path / "out", shard_tokens=500)
    assert not (tmp_path / "out").exists()
