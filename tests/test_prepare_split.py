"""The validation split of ``prepare`` (``moe_train.data.split``): disjoint, deterministic,
scattered, held out by hash."""

from __future__ import annotations

from helpers import decoded_docs, paragraphs, prepare_run, write_jsonl

from moe_train.data import split


def _distinct_docs(n: int) -> list[str]:
    return [f"document {i}: {d}" for i, d in enumerate(paragraphs(n))]


def test_val_split_is_disjoint_from_train_and_together_they_hold_every_document(bpe, tmp_path):
    docs = _distinct_docs(200)
    prepare_run(bpe, [write_jsonl(tmp_path / "a.jsonl", docs)], tmp_path / "out", val_fraction=0.2)
    train, val = decoded_docs(bpe, tmp_path / "out"), decoded_docs(bpe, tmp_path / "out", "val")
    assert val and not set(train) & set(val) and sorted(train + val) == sorted(docs)


def test_val_split_is_the_same_for_the_same_seed_and_differs_for_another(bpe, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", _distinct_docs(200))
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        prepare_run(bpe, [data], tmp_path / name, val_fraction=0.2, seed=seed)
    val = {n: decoded_docs(bpe, tmp_path / n, "val") for n in "abc"}
    assert val["a"] == val["b"] != val["c"]


def test_val_documents_are_scattered_not_a_block_at_either_end(bpe, tmp_path):
    docs = _distinct_docs(200)
    prepare_run(bpe, [write_jsonl(tmp_path / "a.jsonl", docs)], tmp_path / "out", val_fraction=0.2)
    where = sorted(docs.index(d) for d in decoded_docs(bpe, tmp_path / "out", "val"))
    assert where != list(range(where[0], where[0] + len(where)))


def test_val_docs_holds_out_exactly_n_documents_chosen_by_hash(bpe, tmp_path):
    docs = _distinct_docs(200)
    prepare_run(
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
