"""Local tokenizers for ``python -m moe_train.data prepare``: Hugging Face or SentencePiece.

``--tokenizer TOK`` is read from disk only (never from a hub):

* a Hugging Face ``tokenizer.json``, or a directory holding one (``tokenizers.Tokenizer``);
* a SentencePiece ``.model`` file, or a directory holding ``tokenizer.model`` and no
  ``tokenizer.json`` (``sentencepiece.SentencePieceProcessor``).

Documents are encoded without the tokenizer's own special tokens (no BOS or post-processor
template): the ids are those of the text alone, and ``prepare`` appends the EOS id after each.

The EOS id, in order of preference: ``--eos-id N``; for Hugging Face the ``eos_token`` of a
``tokenizer_config.json`` next to ``tokenizer.json``, else the first of :data:`EOS_CANDIDATES`
in the vocabulary; for SentencePiece the model's ``eos_id()``, else the same candidates. No EOS
is a :class:`DataError` that offers ``--eos-id``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from moe_train.data import DataError

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|eos|>")
MAX_VOCAB = 2**32


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What a worker process needs to load the tokenizer again (picklable)."""

    kind: str  # "huggingface" | "sentencepiece"
    path: str


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """A loaded tokenizer's identity, for the manifest and the rerun check."""

    spec: TokenizerSpec
    shown: str  # --tokenizer as given
    sha256: str  # of the tokenizer file
    config_path: str | None  # tokenizer_config.json that named the EOS, if one was read
    config_sha256: str | None
    library: str  # e.g. "tokenizers 0.23.3"
    eos_id: int
    eos_token: str | None
    eos_source: str
    vocab_size: int  # highest id + 1

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian ``uint16`` when every id fits (vocab <= 65536), else ``uint32``."""
    if vocab_size > MAX_VOCAB:
        raise DataError(
            f"vocabulary of {vocab_size:,} tokens does not fit uint32 token ids (at most {MAX_VOCAB:,})"
        )
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]


def locate(tok: str) -> TokenizerSpec:
    """The tokenizer file ``tok`` names (a file or a directory holding one) and its kind."""
    p = Path(tok).expanduser()
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            p = p / "tokenizer.json"
        elif (p / "tokenizer.model").is_file():
            p = p / "tokenizer.model"
        else:
            raise DataError(
                f"--tokenizer {tok}: directory holds no tokenizer.json or "
                f"tokenizer.model; expected a Hugging Face tokenizer.json, a "
                f"directory holding one, or a SentencePiece .model"
            )
    elif not p.exists():
        raise DataError(
            f"--tokenizer {tok}: not found; expected a Hugging Face tokenizer.json, "
            f"a directory holding one, or a SentencePiece .model"
        )
    kind = "sentencepiece" if p.suffix == ".model" else "huggingface"
    return TokenizerSpec(kind, str(p.resolve()))


def load_backend(spec: TokenizerSpec) -> Any:
    """The library object for ``spec`` (raises the library's own errors): a SentencePiece
    processor or a Hugging Face ``Tokenizer``, as ``spec.kind`` says."""
    if spec.kind == "sentencepiece":
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=spec.path)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(spec.path)


def load(tok: str, eos_id: int | None = None) -> TokenizerInfo:
    """Load ``--tokenizer tok``; find its EOS id and vocabulary size (one-line errors)."""
    spec = locate(tok)
    what = "SentencePiece .model" if spec.kind == "sentencepiece" else "Hugging Face tokenizer.json"
    try:
        backend = load_backend(spec)
    except Exception as err:  # the libraries raise bare Exception / RuntimeError / OSError
        raise DataError(f"--tokenizer {tok}: cannot load it as a {what} ({_first_line(err)})") from None
    if spec.kind == "sentencepiece":
        vocab = int(backend.get_piece_size())
        library = f"sentencepiece {metadata.version('sentencepiece')}"
    else:
        vocab = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        library = f"tokenizers {metadata.version('tokenizers')}"
    if eos_id is not None:
        found = (eos_id, None, "--eos-id", None)
    elif spec.kind == "sentencepiece":
        found = _spm_eos(backend)
    else:
        found = _hf_eos(backend, Path(spec.path).parent)
    if found is None:
        raise DataError(
            f"--tokenizer {tok}: no EOS token found (no tokenizer_config.json "
            f"eos_token, none of {', '.join(EOS_CANDIDATES)}); pass --eos-id N"
        )
    eid, token, source, config = found
    if not 0 <= eid < vocab:
        raise DataError(f"--eos-id {eid} is not a token id of {tok} (0..{vocab - 1})")
    token_dtype(vocab)
    return TokenizerInfo(
        spec=spec,
        shown=tok,
        sha256=sha256_file(Path(spec.path)),
        config_path=str(config) if config else None,
        config_sha256=sha256_file(config) if config else None,
        library=library,
        eos_id=eid,
        eos_token=token,
        eos_source=source,
        vocab_size=vocab,
    )


def _spm_eos(sp):
    """(id, piece, source, None) of a SentencePiece model's EOS, or None."""
    if sp.eos_id() >= 0:
        return int(sp.eos_id()), sp.id_to_piece(sp.eos_id()), "SentencePiece eos_id()", None
    for piece in EOS_CANDIDATES:
        pid = sp.piece_to_id(piece)
        if pid != sp.unk_id() and sp.id_to_piece(pid) == piece:
            return int(pid), piece, f"the piece {piece}", None
    return None


def _hf_eos(tokenizer, folder: Path):
    """(id, token, source, config path or None) of a Hugging Face tokenizer's EOS, or None."""
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (OSError, ValueError, AttributeError) as err:
            raise DataError(f"{config}: not a readable tokenizer_config.json ({_first_line(err)})") from None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            tid = tokenizer.token_to_id(eos)
            if tid is None:
                raise DataError(
                    f"{config}: eos_token {eos!r} is not in the tokenizer's vocabulary; pass --eos-id N"
                )
            return int(tid), eos, "tokenizer_config.json eos_token", config
    for token in EOS_CANDIDATES:
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return int(tid), token, f"the token {token}", None
    return None


class Encoder:
    """Encodes lists of documents to one flat array of ids, EOS after each document."""

    def __init__(self, spec: TokenizerSpec, eos_id: int, dtype: str, *, worker: bool = False):
        if worker:  # one thread per worker process: --workers sets the parallelism
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.spec, self.eos_id, self.dtype = spec, eos_id, np.dtype(dtype)
        self._backend = load_backend(spec)

    def ids(self, texts: list[str]) -> list[list[int]]:
        if self.spec.kind == "sentencepiece":
            return self._backend.encode(texts, out_type=int)
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat ids with EOS after every document, tokens per document including its EOS)."""
        ids = self.ids(texts)
        lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
        ends = np.cumsum(lengths)
        flat = np.empty(int(ends[-1]) if len(ends) else 0, self.dtype)
        for doc, end in zip(ids, ends):
            flat[end - 1 - len(doc) : end - 1] = doc
        flat[ends - 1] = self.eos_id
        return flat, lengths
