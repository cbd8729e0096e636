"""``prepare --train-tokenizer N``: a byte-level BPE tokenizer of N tokens trained on the inputs.

For a corpus that comes without a tokenizer. Hugging Face ``tokenizers`` trains it
(``BpeTrainer``) on the documents ``prepare`` itself reads (every input, in order, with the
same ``--split-on`` and ``--text-field``). Byte-level, so every text encodes losslessly; its one
special token is the EOS ``<|endoftext|>`` (id 0); a small corpus may run out of merges
before N, and the vocabulary is then what it reached (the summary and the manifest say).

It is saved beside the corpus as ``DIR/tokenizer.json`` and is from then on the run's
tokenizer, recorded in ``prepare.json`` and ``manifest.json`` as a ``--tokenizer`` would be
(``python -m moe_train.data prepare --tokenizer DIR/tokenizer.json`` prepares more text with
it). Nothing is written before training succeeded: a bad input stops it with the same one
line as the input check. A rerun of the same command finds ``DIR/prepare.json`` naming the
same size and reuses ``DIR/tokenizer.json`` instead of training again; ``--out`` holding
another job, or other files, is refused before training.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from moe_train.base.exits import OutputError
from moe_train.data import DataError, shards
from moe_train.data import inputs as inputs_mod

FILE = "tokenizer.json"  # in --out, beside prepare.json and manifest.json
EOS = "<|endoftext|>"
MIN_VOCAB = 257  # the 256 byte symbols and EOS
JOB_KEY = "trained_tokenizer"  # in prepare.json: the size asked for


def check_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"--train-tokenizer {vocab_size}: at least {MIN_VOCAB} (256 bytes and "
            f"EOS), e.g. --train-tokenizer 8192"
        )


def _reusable(out: Path, vocab_size: int) -> bool:
    """Whether ``out`` is this job's earlier run (its tokenizer is reused); DataError when
    ``out`` holds anything the training must not overwrite."""
    if out.exists() and not out.is_dir():
        raise DataError(
            f"--out {out} is a file; expected a directory (new, empty, or an earlier run of the same prepare)"
        )
    job_path = out / "prepare.json"
    if job_path.is_file():
        try:
            asked = json.loads(job_path.read_text(encoding="utf-8")).get(JOB_KEY)
        except (OSError, ValueError, AttributeError):
            asked = None
        if asked != vocab_size or not (out / FILE).is_file():
            raise DataError(
                f"--out {out} holds a prepare of other inputs or options "
                f"({JOB_KEY} differs: {asked} there); use another --out, or delete "
                f"it to start over"
            )
        return True
    others = sorted(p.name for p in out.iterdir() if p.name != FILE) if out.is_dir() else []
    if others:
        raise DataError(
            f"--out {out} is not empty and has no prepare.json ({', '.join(others[:3])}"
            f"); use a new or empty directory"
        )
    return False


def _documents(files: list[inputs_mod.Input], split_on: str, text_field: str) -> Iterator[str]:
    for inp in files:
        yield from inputs_mod.Reader(inp, split_on=split_on, text_field=text_field).documents()


def ensure(
    out: Path,
    files: list[inputs_mod.Input],
    vocab_size: int,
    *,
    split_on: str,
    text_field: str,
    log: Callable[[str], None] = print,
) -> Path:
    """``out/tokenizer.json``: trained on ``files`` now, or this job's from an earlier run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_size(vocab_size)
    path = Path(out) / FILE
    if _reusable(Path(out), vocab_size):
        log(f"tokenizer: {path}, trained by an earlier run of this job (--train-tokenizer {vocab_size})")
        return path
    log(f"training a byte-level BPE tokenizer of {vocab_size:,} tokens on the inputs ...")
    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_documents(files, split_on, text_field), trainer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        shards.atomic_write(path, tok.to_str(pretty=True).encode("utf-8"))
    except OSError as err:
        raise OutputError(f"--out {out}: cannot write ({err.strerror or err})") from None
    log(
        f"trained the tokenizer in {time.perf_counter() - t0:.1f} s: {tok.get_vocab_size():,} "
        f"tokens, saved to {path}"
    )
    return path
