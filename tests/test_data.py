"""Data layer: deterministic, sharded batches from synthetic, token-file and byte sources."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

import moe_train
from moe_train import data
from moe_train.config import ConfigError, DataConfig
from moe_train.data import DataError, corpus, make_source

CORPUS = "moe_train/assets/corpus.txt"
KIT_ROOT = Path(moe_train.__file__).resolve().parent.parent


def _tokens_file(tmp_path: Path, values, dtype: str = "uint16") -> str:
    path = tmp_path / f"tokens.{dtype}"
    np.asarray(values, dtype=dtype).tofile(path)
    return str(path)


def _source(kind: str, tmp_path: Path, *, batch_size: int = 8, seq_len: int = 16, seed: int = 0):
    if kind == "synthetic":
        cfg = DataConfig(source="synthetic", seed=seed)
    elif kind == "tokens":
        cfg = DataConfig(
            source="tokens",
            path=_tokens_file(tmp_path, np.arange(5000) % 300),
            token_dtype="uint16",
            seed=seed,
        )
    else:
        cfg = DataConfig(source="bytes", path=CORPUS, seed=seed)
    vocab = 300 if kind == "tokens" else 256
    return make_source(cfg, vocab_size=vocab, seq_len=seq_len, batch_size=batch_size)


KINDS = ["synthetic", "tokens", "bytes"]


@pytest.mark.parametrize("kind", KINDS)
def test_same_step_gives_same_batch_even_from_a_fresh_source(kind, tmp_path):
    a = _source(kind, tmp_path).batch(7)
    b = _source(kind, tmp_path).batch(7)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_different_steps_give_different_batches(kind, tmp_path):
    src = _source(kind, tmp_path)
    assert not np.array_equal(src.batch(0), src.batch(1))


@pytest.mark.parametrize("kind", KINDS)
def test_different_seeds_give_different_batches(kind, tmp_path):
    assert not np.array_equal(
        _source(kind, tmp_path, seed=0).batch(3), _source(kind, tmp_path, seed=1).batch(3)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_batch_shape_and_dtype(kind, tmp_path):
    b = _source(kind, tmp_path, batch_size=6, seq_len=32).batch(0)
    assert b.shape == (6, 33)
    assert b.dtype == np.int32
    assert b.flags.c_contiguous


def test_synthetic_tokens_in_range():
    src = make_source(DataConfig(), vocab_size=37, seq_len=200, batch_size=16)
    b = np.concatenate([src.batch(s) for s in range(5)])
    assert b.min() >= 0 and b.max() < 37
    assert len(np.unique(b)) == 37  # every token is reachable


@pytest.mark.parametrize("kind", KINDS)
def test_process_shards_concatenate_to_global_batch(kind, tmp_path):
    src = _source(kind, tmp_path, batch_size=8)
    whole = src.batch(5)
    for count in (2, 4, 8):
        parts = [src.batch(5, process_index=p, process_count=count) for p in range(count)]
        assert all(p.shape == (8 // count, 17) for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_batch_not_divisible_by_processes_is_a_data_error():
    src = make_source(DataConfig(), vocab_size=256, seq_len=8, batch_size=6)
    with pytest.raises(DataError, match=r"batch_size=6 is not divisible by the 4 processes"):
        src.batch(0, process_index=0, process_count=4)


def test_bad_process_index_is_a_data_error():
    src = make_source(DataConfig(), vocab_size=256, seq_len=8, batch_size=8)
    with pytest.raises(DataError, match="process_index=2"):
        src.batch(0, process_index=2, process_count=2)


@pytest.mark.parametrize("dtype,base", [("uint16", 1000), ("uint32", 70_000)])
def test_tokens_file_round_trip(dtype, base, tmp_path):
    n = 3000
    path = _tokens_file(tmp_path, base + np.arange(n), dtype)
    src = make_source(
        DataConfig(source="tokens", path=path, token_dtype=dtype),
        vocab_size=base + n,
        seq_len=31,
        batch_size=4,
    )
    assert f"({n:,} tokens)" in src.description
    b = src.batch(2)
    for row in b:  # every row is a contiguous window of the file
        start = row[0] - base
        assert 0 <= start <= n - 32
        np.testing.assert_array_equal(row, base + start + np.arange(32))


def test_bytes_source_rows_are_raw_windows_of_the_file(tmp_path):
    raw = KIT_ROOT.joinpath(CORPUS).read_bytes()
    src = make_source(DataConfig(source="bytes", path=CORPUS), vocab_size=256, seq_len=64, batch_size=4)
    for row in src.batch(11):
        assert raw.find(bytes(row.astype(np.uint8))) >= 0


def test_relative_path_falls_back_to_kit_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = make_source(DataConfig(source="bytes", path=CORPUS), vocab_size=256, seq_len=8, batch_size=2)
    assert isinstance(src, data.BytesSource) and src.path == (KIT_ROOT / CORPUS).resolve()


def test_relative_path_prefers_working_directory(tmp_path, monkeypatch):
    local = tmp_path / CORPUS
    local.parent.mkdir(parents=True)
    local.write_text("a local file, not the shipped corpus\n")
    monkeypatch.chdir(tmp_path)
    src = make_source(DataConfig(source="bytes", path=CORPUS), vocab_size=256, seq_len=8, batch_size=2)
    assert isinstance(src, data.BytesSource) and src.path.read_bytes() == local.read_bytes()
    assert src.description.startswith(f"bytes: {CORPUS} (")


def test_missing_file_names_both_places_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        make_source(
            DataConfig(source="bytes", path="nope/missing.txt"), vocab_size=256, seq_len=8, batch_size=2
        )
    msg = str(e.value)
    assert str(tmp_path / "nope/missing.txt") in msg
    assert str(KIT_ROOT / "nope/missing.txt") in msg
    assert "UTF-8 text file" in msg and "\n" not in msg


def test_data_error_is_a_config_error():
    assert issubclass(DataError, ConfigError)


def test_file_shorter_than_a_sequence_is_a_data_error(tmp_path):
    path = _tokens_file(tmp_path, np.arange(10))
    with pytest.raises(DataError, match=r"only 10 tokens, shorter than train.seq_len \+ 1 = 17"):
        make_source(DataConfig(source="tokens", path=path), vocab_size=256, seq_len=16, batch_size=2)


def test_tokens_file_size_must_match_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01" * 4001)
    with pytest.raises(DataError, match="not a whole number of uint16 tokens"):
        make_source(DataConfig(source="tokens", path=str(path)), vocab_size=256, seq_len=16, batch_size=2)


def test_large_batches_gather_the_same_windows(tmp_path):
    n, length = 100_000, 10_001  # 8 x 10,001 tokens takes the vectorised gather path
    path = _tokens_file(tmp_path, np.arange(n), "uint32")
    src = make_source(
        DataConfig(source="tokens", path=path, token_dtype="uint32"),
        vocab_size=n,
        seq_len=length - 1,
        batch_size=8,
    )
    b = src.batch(4)
    np.testing.assert_array_equal(b, b[:, :1] + np.arange(length))


@pytest.mark.parametrize("chunk", [8 << 20, 7])
def test_non_utf8_file_is_a_data_error(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(data, "_CHUNK", chunk)
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait, ".encode() * 50 + "naïve".encode("latin-1") + b" end" * 50)
    with pytest.raises(DataError) as e:
        make_source(DataConfig(source="bytes", path=str(path)), vocab_size=256, seq_len=16, batch_size=2)
    assert "not UTF-8" in str(e.value) and str(path) in str(e.value)
    assert f"near byte {len('café au lait, '.encode()) * 50 + 2:,}" in str(e.value)


def test_utf8_character_split_across_scan_chunks_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_CHUNK", 7)  # forces chunk boundaries inside 2-byte characters
    path = tmp_path / "accents.txt"
    path.write_text("Zoë and Søren met José at the café. " * 20, encoding="utf-8")
    src = make_source(DataConfig(source="bytes", path=str(path)), vocab_size=256, seq_len=16, batch_size=2)
    assert isinstance(src, data.BytesSource) and src.num_tokens == path.stat().st_size


def test_token_id_beyond_vocab_fails_at_open(tmp_path):
    path = _tokens_file(tmp_path, np.r_[np.arange(100), 500, np.arange(100)])
    with pytest.raises(DataError, match=r"token id 500 at token 100 is >= model.vocab_size=256"):
        make_source(DataConfig(source="tokens", path=path), vocab_size=256, seq_len=16, batch_size=2)


def test_token_id_beyond_vocab_fails_in_batch_for_large_files(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SCAN_LIMIT", 0)  # treat the file as too large to scan at open
    path = _tokens_file(tmp_path, np.full(1000, 999), "uint32")
    src = make_source(
        DataConfig(source="tokens", path=path, token_dtype="uint32"), vocab_size=256, seq_len=16, batch_size=2
    )
    with pytest.raises(DataError, match="token id 999"):
        src.batch(0)


def test_bytes_source_needs_a_byte_vocabulary():
    with pytest.raises(DataError, match="vocab_size >= 256"):
        make_source(DataConfig(source="bytes", path=CORPUS), vocab_size=100, seq_len=8, batch_size=2)


def _conditional_entropy(b: np.ndarray, vocab: int) -> float:
    x, y = b[:, :-1].ravel(), b[:, 1:].ravel()
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (x, y), 1)
    joint = counts / counts.sum()
    cond = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    nz = joint > 0
    return float(-(joint[nz] * np.log(cond[nz])).sum())


def test_synthetic_is_learnable():
    src = make_source(DataConfig(), vocab_size=128, seq_len=256, batch_size=32)
    assert isinstance(src, data.SyntheticSource)
    b = np.concatenate([src.batch(s) for s in range(4)])
    h = _conditional_entropy(b, 128)
    assert h < 0.4 * math.log(128)  # next token is far from uniform given the current one
    assert abs(h - src.entropy_rate()) < 0.3


def test_shipped_corpus_matches_generator():
    assert corpus.check(KIT_ROOT / CORPUS), "run: python -m moe_train.data.corpus"


def test_corpus_check_flags_a_modified_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(KIT_ROOT.joinpath(CORPUS).read_bytes() + b"extra\n")
    assert corpus.main(["--check", "--out", str(path)]) == 1


def test_shipped_corpus_is_varied_english_prose():
    text = KIT_ROOT.joinpath(CORPUS).read_text(encoding="utf-8")
    assert 300_000 <= len(text.encode()) <= 500_000
    sentences = [s for s in re.split(r"(?<=[.?!])\s+", text) if len(s) > 30]
    assert len(set(sentences)) > 0.8 * len(sentences) > 4000
    raw = np.frombuffer(text.encode(), np.uint8).astype(np.int64)
    assert _conditional_entropy(raw[None], 256) < 2.6  # bigram statistics alone: < ln(256)/2


def test_a_missing_relative_path_is_shown_once_per_place_looked(tmp_path, monkeypatch):
    from moe_train.data import KIT_ROOT, DataError, resolve_path

    monkeypatch.chdir(KIT_ROOT)
    with pytest.raises(DataError) as err:
        resolve_path("no/such/file.txt")
    assert str(err.value).count("no/such/file.txt") == 2  # as typed, and the one place looked


def test_a_missing_absolute_path_is_shown_once(tmp_path):
    from moe_train.data import DataError, resolve_path

    with pytest.raises(DataError) as err:
        resolve_path(str(tmp_path / "none.txt"))
    assert str(err.value).count("none.txt") == 1
