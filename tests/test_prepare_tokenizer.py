"""The tokenizers of ``prepare`` (``moe_train.data.tokenizer``): where the EOS comes from, and the
token dtype by vocabulary size."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DOCS, prepare_error, prepare_run, train_bpe, write_txt

from moe_train.data import DataError, prepared, tokenizer


def test_eos_comes_from_tokenizer_config_json_next_to_the_tokenizer(tmp_path):
    folder = tmp_path / "tok"
    train_bpe(folder / "tokenizer.json", ["</s>", "<|endoftext|>"], vocab=300)
    (folder / "tokenizer_config.json").write_text('{"eos_token": {"content": "<|endoftext|>"}}')
    info = tokenizer.load(str(folder))  # the directory form
    assert (info.eos_token, info.eos_source) == ("<|endoftext|>", "tokenizer_config.json eos_token")


def test_a_tokenizer_without_eos_exits_2_offering_eos_id(tmp_path):
    tok = train_bpe(tmp_path / "tokenizer.json", [], vocab=300)
    message = prepare_error(tok, [write_txt(tmp_path / "a.txt", DOCS[:2])], tmp_path / "out")
    assert "no EOS token found" in message and "--eos-id" in message


def test_eos_id_flag_sets_the_eos(tmp_path):
    tok = train_bpe(tmp_path / "tokenizer.json", [], vocab=300)
    prepare_run(tok, [write_txt(tmp_path / "a.txt", DOCS[:2])], tmp_path / "out", eos_id=7)
    s = prepared.open_split(tmp_path / "out")
    assert s.eos_id == 7 and s.document(0)[-1] == 7


def test_sentencepiece_eos_is_its_eos_id(spm_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    assert tokenizer.load(str(spm_model)).eos_id == sp.eos_id()


def test_small_vocabulary_is_stored_as_uint16(bpe, tmp_path):
    prepare_run(bpe, [write_txt(tmp_path / "a.txt", DOCS[:3])], tmp_path / "out")
    assert json.loads((tmp_path / "out/manifest.json").read_text())["dtype"] == "uint16"


def test_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(" ".join(DOCS[:5]).split()))
    vocab = {"[UNK]": 0, "</s>": 1} | {f"filler{i}": i for i in range(2, 65_600)}
    vocab |= {w: 65_600 + i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    prepare_run(tmp_path / "tokenizer.json", [write_txt(tmp_path / "a.txt", DOCS[:5])], tmp_path / "out")
    s = prepared.open_split(tmp_path / "out")
    want = tok.encode(DOCS[0], add_special_tokens=False).ids + [1]
    assert s.dtype == np.dtype("<u4") and s.document(0).tolist() == want and max(want) > 65_535


def test_token_dtype_by_vocabulary_size():
    assert tokenizer.token_dtype(65_536) == np.uint16 and tokenizer.token_dtype(65_537) == np.uint32
    with pytest.raises(DataError, match="does not fit uint32"):
        tokenizer.token_dtype(2**32 + 1)
