"""Reading a prepared corpus (``moe_train.data.prepared.open_split``): tokens across shards,
damaged shards refused, sizes-only checks."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import DOCS, flip_byte, prepare_run, write_txt

from moe_train.data import DataError, prepared


def test_open_split_tokens_span_shards_like_one_array(bpe, tmp_path):
    prepare_run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=1500)
    s = prepared.open_split(tmp_path / "out", "train", verify=True)
    bins = sorted((tmp_path / "out/train").glob("*.bin"))
    whole = np.concatenate([np.fromfile(p, "<u2") for p in bins])
    assert len(s.shards) > 2 and len(s.tokens) == len(whole) == s.doc_starts[-1]
    np.testing.assert_array_equal(s.tokens[1000:4000], whole[1000:4000])
    assert s.tokens[-1] == whole[-1] == s.eos_id and s.vocab_size == 500


def test_open_split_refuses_a_truncated_shard(bpe, tmp_path):
    prepare_run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out", shard_tokens=1500)
    path = tmp_path / "out/train/shard_00001.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(DataError, match="shard_00001.bin: does not match the manifest"):
        prepared.open_split(tmp_path / "out")


def test_open_split_verify_false_checks_sizes_only(bpe, tmp_path):
    prepare_run(bpe, [write_txt(tmp_path / "a.txt", DOCS)], tmp_path / "out")
    flip_byte(tmp_path / "out/train/shard_00000.bin")
    assert len(prepared.open_split(tmp_path / "out", verify=False)) == len(DOCS)
