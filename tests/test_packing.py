"""Packed documents and in-run evaluation: one property per test.

Model properties use random token ids with explicit segment ids; data properties use real
prepared corpora, built here with a small byte-level BPE trained on the shipped corpus
(tests/helpers.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import QUIET, paragraphs, prepare_run, records, run_module, sets, tiny, train_bpe, write_jsonl

from moe_train import config
from moe_train import eval as evaluate_mod
from moe_train.base.exits import EXIT_CONFIG, EXIT_OK
from moe_train.checkpoints import checkpoint
from moe_train.config import ConfigError, DataConfig
from moe_train.data import make_source, packing
from moe_train.data.heldout import DEFAULT_SEQUENCES, eval_batches
from moe_train.data.packed import PreparedSource
from moe_train.data.prefetch import Prefetcher
from moe_train.data.prepared import open_split
from moe_train.model import mtp
from moe_train.model.settings import model_settings
from moe_train.model.transformer import Transformer
from moe_train.parallel import sharding
from moe_train.train import loop as run_mod
from moe_train.train import step as train

VOCAB = 320  # the model's vocabulary: the test tokenizer has 300
DOCS = (7, 9, 8)  # document lengths of the model tests' rows (S = 24)


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """Prepared corpora: "val" (a fifth of 120 documents held out) and "no_val" (none)."""
    root = tmp_path_factory.mktemp("packing")
    tok = train_bpe(root / "tok/tokenizer.json", ["<unk>", "</s>"], vocab=300)
    data = write_jsonl(root / "docs.jsonl", [f"document {i}: {d}" for i, d in enumerate(paragraphs(120))])
    prepare_run(tok, [data], root / "val", val_fraction=0.2)
    prepare_run(tok, [data], root / "no_val", val_fraction=0.0)
    return {"val": root / "val", "no_val": root / "no_val"}


def source(path: Path, *, seed: int = 0, packing_on: bool = True, batch_size: int = 8) -> PreparedSource:
    src = make_source(
        DataConfig(source="prepared", path=str(path), seed=seed, packing=packing_on),
        vocab_size=VOCAB,
        seq_len=32,
        batch_size=batch_size,
    )
    assert isinstance(src, PreparedSource)
    return src


def run_cfg(path: Path, *overrides: str, steps: int = 4) -> config.Config:
    return tiny(
        "data.source=prepared",
        f"data.path={path}",
        f"model.vocab_size={VOCAB}",
        "train.seq_len=32",
        "train.async_checkpoint=false",
        "train.telemetry_interval_s=0",
        "train.skip_selftest=true",
        *overrides,
        steps=steps,
    )


def model_cfg(kind: str, attention: str = "xla", *extra: str) -> config.Config:
    preset = "deepseek-v3-tiny" if kind == "mla" else "tiny"
    return config.build(
        preset, [f"model.attention={attention}", "model.attention_block=8", "train.seq_len=24", *extra]
    )


def segments_of(lengths=DOCS) -> np.ndarray:
    return np.repeat(np.arange(1, len(lengths) + 1), lengths).astype(np.int32)


def random_ids(seed: int, shape) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, shape), jnp.int32)


def init(cfg, tokens_BS):
    return jax.jit(Transformer(model_settings(cfg)).init)(jax.random.key(0), tokens_BS)


def logits_of(cfg, variables, tokens_BS, segments_BS=None):
    fn = jax.jit(lambda v, t, s: Transformer(model_settings(cfg)).apply(v, t, segment_ids_BS=s)[0])
    return np.asarray(fn(variables, tokens_BS, None if segments_BS is None else jnp.asarray(segments_BS)))


KINDS = [("gqa", "xla"), ("gqa", "chunked"), ("mla", "xla"), ("mla", "chunked")]


# ------------------------------------------------------------------------- the model


@pytest.mark.parametrize("kind,attention", KINDS, ids=[f"{k}-{a}" for k, a in KINDS])
def test_changing_one_document_leaves_the_other_documents_logits_unchanged(kind, attention):
    cfg = model_cfg(kind, attention)
    seg_BS = np.tile(segments_of(), (2, 1))
    tokens = random_ids(0, seg_BS.shape)
    other = jnp.where(jnp.asarray(seg_BS) == 2, random_ids(1, seg_BS.shape), tokens)
    variables = init(cfg, tokens)
    a, b = (logits_of(cfg, variables, t, seg_BS) for t in (tokens, other))
    outside = seg_BS != 2
    np.testing.assert_allclose(a[outside], b[outside], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[~outside], b[~outside], atol=1e-3)


@pytest.mark.parametrize("kind,attention", KINDS, ids=[f"{k}-{a}" for k, a in KINDS])
def test_a_documents_logits_equal_those_of_it_alone_at_the_start_of_a_row(kind, attention):
    cfg = model_cfg(kind, attention)
    packed_seg = segments_of()[None]
    alone_seg = segments_of((DOCS[1], 24 - DOCS[1]))[None]  # the document, then padding
    packed = random_ids(0, (1, 24))
    doc = packed[:, DOCS[0] : DOCS[0] + DOCS[1]]
    alone = jnp.concatenate([doc, random_ids(2, (1, 24 - DOCS[1]))], axis=1)
    variables = init(cfg, packed)
    got = logits_of(cfg, variables, packed, packed_seg)[0, DOCS[0] : DOCS[0] + DOCS[1]]
    want = logits_of(cfg, variables, alone, alone_seg)[0, : DOCS[1]]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_one_segment_per_row_is_the_unpacked_model():
    cfg = model_cfg("gqa")
    tokens = random_ids(0, (2, 24))
    variables = init(cfg, tokens)
    np.testing.assert_allclose(
        logits_of(cfg, variables, tokens, np.ones((2, 24), np.int32)),
        logits_of(cfg, variables, tokens),
        rtol=1e-6,
        atol=1e-6,
    )


def test_positions_restart_at_every_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3], [4, 4, 4, 4, 4, 4]])
    assert packing.positions(seg).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_labels_of_a_documents_first_token_are_minus_one():
    tokens = jnp.asarray([[10, 11, 12, 20, 21, 30]])
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3]])
    assert packing.next_token_labels(tokens, seg).tolist() == [[11, 12, -1, 21, -1]]


def test_the_loss_ignores_the_first_token_of_each_document():
    cfg = model_cfg("gqa")
    seg_BS1 = np.tile(segments_of((7, 9, 9)), (2, 1))  # S + 1 = 25
    tokens = random_ids(0, seg_BS1.shape)
    variables = init(cfg, tokens[:, :-1])
    params, moe_state = nn.unbox(variables["params"]), variables["moe_state"]
    got = jax.jit(
        lambda p, b: train._loss_fn(p, {}, moe_state, b, Transformer(model_settings(cfg)), cfg)[1]["ce"]
    )(params, packing.make(tokens, jnp.asarray(seg_BS1)))
    logits = logits_of(cfg, variables, tokens[:, :-1], seg_BS1[:, :-1])
    targets = np.asarray(tokens)[:, 1:, None]
    nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), targets, -1)[..., 0]
    same = seg_BS1[:, 1:] == seg_BS1[:, :-1]
    assert (~same).sum() == 2 * 2  # two document starts per row
    np.testing.assert_allclose(got, nll[same].mean(), rtol=1e-5)


def test_mtp_labels_and_ids_never_cross_a_document():
    tokens = jnp.asarray([[10, 11, 12, 20, 21, 30, 31]])
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 3]])
    ids, labels = mtp.shifted(tokens, 1, seg)
    assert ids.tolist() == [[[11, 12, 0, 21, 0, 31]]]  # token i+1, 0 where another document
    assert labels.tolist() == [[[12, -1, -1, -1, -1, -1]]]  # token i+2 of i's document


def test_mtp_states_of_a_document_do_not_depend_on_the_others():
    cfg = model_cfg("mla")
    seg_BS1 = segments_of((7, 9, 9))[None]
    tokens = random_ids(0, (1, 25))
    other = jnp.where(jnp.asarray(seg_BS1) == 2, random_ids(1, (1, 25)), tokens)
    variables = init(cfg, tokens[:, :-1])

    @jax.jit
    def states(t):
        ids, _ = mtp.shifted(t, 1, jnp.asarray(seg_BS1))
        head, _ = Transformer(model_settings(cfg)).apply(
            variables, t[:, :-1], logits=False, mtp_ids_LBS=ids, segment_ids_BS=jnp.asarray(seg_BS1[:, :-1])
        )
        return head.mtp_LBSH[0, 0]

    outside = seg_BS1[0, :-1] != 2
    a, b = np.asarray(states(tokens)), np.asarray(states(other))
    np.testing.assert_allclose(a[outside], b[outside], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[~outside], b[~outside], atol=1e-3)


# ------------------------------------------------------------------------- the batches


def test_rows_are_pieces_of_documents_numbered_from_one(corpora):
    src = source(corpora["val"])
    batch = src.batch(3)
    docs = [src.split.document(d).tolist() for d in range(len(src.split))]
    text = [",".join(map(str, d)) for d in docs]
    for tokens, seg in zip(batch["tokens"], batch["segments"]):
        assert seg[0] == 1 and set(np.diff(seg)) <= {0, 1}
        pieces = [tokens[seg == s].tolist() for s in np.unique(seg)]
        for i, piece in enumerate(pieces):
            joined = ",".join(map(str, piece))
            if 0 < i < len(pieces) - 1:
                assert piece in docs  # a document inside the row is whole
            assert any(joined in t for t in text)


def test_one_epoch_predicts_every_token_of_its_stream_once(corpora):
    src = source(corpora["val"])
    R, S = src.rows_per_epoch, src.seq_len
    rows = np.concatenate([src.batch(s)["tokens"] for s in range(-(-R // 8))])[:R]
    stream, _ = src.epoch(0)
    flat = np.concatenate([src.split.document(int(d)) for d in stream.order])
    np.testing.assert_array_equal(
        np.bincount(rows[:, 1:].ravel(), minlength=VOCAB), np.bincount(flat[1 : R * S + 1], minlength=VOCAB)
    )


def test_batches_depend_on_seed_and_step_only_so_a_resume_sees_the_same(corpora):
    first = source(corpora["val"])
    seen = [first.batch(s) for s in range(6)]
    resumed = source(corpora["val"])
    for s in (4, 5, 2):
        for key in ("tokens", "segments"):
            np.testing.assert_array_equal(resumed.batch(s)[key], seen[s][key])
    assert not np.array_equal(source(corpora["val"], seed=1).batch(4)["tokens"], seen[4]["tokens"])


@pytest.mark.parametrize("count", [2, 4])
def test_process_shares_concatenate_to_the_global_batch(corpora, count):
    src = source(corpora["val"])
    whole = src.batch(7)
    parts = [src.batch(7, process_index=p, process_count=count) for p in range(count)]
    for key in ("tokens", "segments"):
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_packing_off_gives_the_same_tokens_as_one_plain_array(corpora):
    plain = source(corpora["val"], packing_on=False).batch(2)
    assert isinstance(plain, np.ndarray) and plain.dtype == np.int32
    np.testing.assert_array_equal(plain, source(corpora["val"]).batch(2)["tokens"])


def test_prefetch_computes_the_next_steps_on_its_own_thread():
    calls = []

    def fn(step, key):
        calls.append((step, threading.current_thread().name))
        return step * 10

    pre = Prefetcher(fn, depth=2)
    assert pre.get(0, "k") == 0
    deadline = time.time() + 10
    while len(calls) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert pre.get(1, "k") == 10 and pre.get(2, "k") == 20
    assert pre.get(9, "k") == 90  # out of order: computed on the spot, the queue moves on
    pre.close()
    ahead = [name for step, name in calls if step in (1, 2)]
    assert ahead and all(name.startswith("moe_train-prefetch") for name in ahead)
    assert (9, threading.current_thread().name) in calls


def test_prefetch_raises_the_error_of_the_batch_it_returns():
    def fn(step):
        if step == 1:
            raise ValueError("bad step 1")
        return step

    pre = Prefetcher(fn)
    assert pre.get(0) == 0
    with pytest.raises(ValueError, match="bad step 1"):
        pre.get(1)
    pre.close()


# ------------------------------------------------------------------------- config errors


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_prepared_without_a_path_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        config.build("tiny", ["data.source=prepared", "data.path="])
    assert "data.path" in one_line(err)


def test_a_corpus_vocabulary_above_the_models_is_a_config_error(corpora, tmp_path):
    with pytest.raises(ConfigError) as err:
        run_mod.run(run_cfg(corpora["val"], "model.vocab_size=256"), tmp_path / "out", **QUIET)
    assert "model.vocab_size >= 300" in one_line(err)
    assert not (tmp_path / "out").exists()


def test_eval_without_a_val_split_is_a_config_error(corpora, tmp_path):
    with pytest.raises(ConfigError) as err:
        run_mod.run(run_cfg(corpora["no_val"], "train.eval_every=2"), tmp_path / "out", **QUIET)
    assert "no val split" in one_line(err)
    assert not (tmp_path / "out").exists()


def test_eval_on_a_flat_file_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        config.build("tiny", ["train.eval_every=5"])
    assert "train.eval_every" in one_line(err)


def test_te_attention_with_packed_documents_is_a_config_error(corpora):
    with pytest.raises(ConfigError) as err:
        run_cfg(corpora["val"], "model.attention=te")
    assert "segment ids" in one_line(err)


def test_the_cli_exits_2_with_one_line_for_a_too_small_vocabulary(corpora, tmp_path):
    proc = run_module(
        "moe_train",
        "--out",
        tmp_path / "out",
        "--devices",
        "1",
        # model.vocab_size set below the corpus's (unset: taken from it)
        *sets("data.source=prepared", f"data.path={corpora['val']}", "model.vocab_size=256"),
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == EXIT_CONFIG and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "model.vocab_size" in lines[0]


# ------------------------------------------------------------------------- evaluation


def test_eval_batches_are_the_val_split_from_its_start_the_same_every_time(corpora):
    cfg = run_cfg(corpora["val"], "train.eval_every=2")
    (a, _), (b, _) = eval_batches(cfg), eval_batches(cfg)
    assert len(a) == DEFAULT_SEQUENCES // 8 and all(
        np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in ("tokens", "segments")
    )
    val = open_split(corpora["val"], "val")
    np.testing.assert_array_equal(a[0]["tokens"][0], val.tokens[0:33])  # document order


def test_a_short_val_split_is_used_whole_and_its_padding_never_scored(corpora):
    batches, _ = eval_batches(run_cfg(corpora["val"], "train.eval_every=2", "train.eval_tokens=1000000"))
    tokens = np.concatenate([b["tokens"] for b in batches])
    val = open_split(corpora["val"], "val")
    real = tokens[tokens != packing.PAD]
    assert (tokens[-1] == packing.PAD).any() and len(real) - len(tokens) + 1 <= val.num_tokens
    labels = np.concatenate([packing.next_token_labels(b["tokens"], b["segments"]) for b in batches])
    assert not ((labels >= 0) & (np.roll(tokens, -1, axis=1)[:, :-1] == packing.PAD)).any()


def test_synthetic_eval_walks_are_fixed_and_not_training_batches():
    cfg = config.build("tiny", ["data.source=synthetic", "train.eval_every=2"])
    (a, _), (b, _) = eval_batches(cfg), eval_batches(cfg)
    assert len(a) == DEFAULT_SEQUENCES // 8 and all(np.array_equal(x, y) for x, y in zip(a, b))
    src = make_source(cfg.data, vocab_size=256, seq_len=64, batch_size=8)
    assert not any(np.array_equal(a[0], src.batch(s)) for s in range(20))


@pytest.fixture(scope="module")
def state_and_batch(corpora):
    cfg = run_cfg(corpora["val"], "parallel.devices=2", "train.eval_every=2")
    mesh = sharding.make_mesh(jax.devices()[:2])
    return cfg, mesh, train.init_state(cfg, mesh), source(corpora["val"]).batch(0)


def test_evaluate_repeats_exactly_and_leaves_the_state_as_it_was(state_and_batch):
    cfg, mesh, state, _ = state_and_batch
    batches, _ = eval_batches(cfg)
    before = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]
    first = evaluate_mod.evaluate(cfg, mesh, state.params, state.moe_state, batches)
    again = evaluate_mod.evaluate(cfg, mesh, state.params, state.moe_state, batches)
    assert first == again and first["eval_tokens"] > 0
    assert np.isclose(first["eval_ppl"], np.exp(first["eval_loss"]))
    after = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


def test_evaluate_on_a_training_batch_is_its_training_loss(state_and_batch):
    cfg, mesh, state, batch = state_and_batch
    got = evaluate_mod.evaluate(cfg, mesh, state.params, state.moe_state, [batch])
    params, moe_state = jax.device_get((state.params, state.moe_state))
    want = jax.jit(
        lambda p, m, b: train._loss_fn(p, {}, m, b, Transformer(model_settings(cfg)), cfg)[1]["ce"]
    )(params, moe_state, batch)
    np.testing.assert_allclose(got["eval_loss"], want, rtol=1e-5)


def test_evaluating_in_micro_batches_equals_whole_batches(state_and_batch):
    cfg, mesh, state, _ = state_and_batch
    batches, _ = eval_batches(cfg)
    split = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batches=2))
    whole, parts = (
        evaluate_mod.evaluate(c, mesh, state.params, state.moe_state, batches) for c in (cfg, split)
    )
    assert whole["eval_tokens"] == parts["eval_tokens"]
    np.testing.assert_allclose(parts["eval_loss"], whole["eval_loss"], rtol=1e-6)


def test_the_report_plots_eval_loss_in_the_loss_panel(tmp_path, monkeypatch):
    from moe_train.report import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, *args: figures.append(fig))
    plots.training(
        [
            {"step": 1, "loss": 2.0, "aux_loss": 1.0},
            {"step": 2, "loss": 1.9, "aux_loss": 1.0, "eval_loss": 2.1},
            {"step": 3, "loss": 1.8, "aux_loss": 1.0},
        ],
        tmp_path,
    )
    lines = {line.get_label(): line.get_xdata().tolist() for line in figures[0].axes[0].lines}
    plots.plt.close(figures[0])
    assert lines["eval_loss"] == [2] and lines["loss"] == [1, 2, 3]


@pytest.fixture(scope="module")
def runs(corpora, tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    """5-step runs on packed prepared data: evaluating every 2 steps, and not evaluating."""
    out = {}
    for name, extra in (("eval", ["train.eval_every=2"]), ("plain", [])):
        lines: list[str] = []
        where = tmp_path_factory.mktemp(name)
        assert run_mod.run(run_cfg(corpora["val"], *extra, steps=5), where, log=lines.append) == EXIT_OK
        out[name] = (where, lines)
    return out


@pytest.mark.slow
def test_eval_loss_is_in_the_records_of_eval_steps_and_the_last_step(runs):
    out, lines = runs["eval"]
    assert [r["step"] for r in records(out) if "eval_loss" in r] == [2, 4, 5]
    assert all(np.isfinite(r["eval_loss"]) and r["eval_tokens"] > 0 for r in records(out) if "eval_loss" in r)
    assert sum("| eval " in line for line in lines) == 3


@pytest.mark.slow
def test_evaluating_does_not_change_the_training_run(runs):
    (a, _), (b, _) = runs["eval"], runs["plain"]
    assert [r["loss"] for r in records(a)] == [r["loss"] for r in records(b)]
    saved = [checkpoint.Checkpointer(d, keep=10, use_async=False).restore_saved(5) for d in (a, b)]
    assert all(np.array_equal(x, y) for x, y in zip(*(jax.tree.leaves(s) for s in saved)))
