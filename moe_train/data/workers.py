"""Worker processes of ``prepare``: input checks and tokenization, results in submission order.

``--workers N`` > 1 starts N spawned processes (not forked: the tokenizer libraries keep threads
that a fork would copy in a broken state), each loading the tokenizer once and encoding with one
thread. ``--workers 1`` runs everything in this process. Results are always consumed in the order
the tasks were submitted, so the output does not depend on N or on which worker finishes first.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import signal

import numpy as np

from moe_train.data import inputs as inputs_mod
from moe_train.data import tokenizer as tok_mod

_ENCODER: tok_mod.Encoder | None = None  # this worker process's tokenizer


def _init_worker(spec: tok_mod.TokenizerSpec, eos_id: int, dtype: str) -> None:
    global _ENCODER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    _ENCODER = tok_mod.Encoder(spec, eos_id, dtype, worker=True)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _ENCODER is not None, "set by _init_worker"
    return _ENCODER.encode(texts)


class Workers:
    """``n`` worker processes, or this process when ``n`` is 1."""

    def __init__(self, n: int, tok: tok_mod.TokenizerInfo):
        self.n = n
        self._pool = None
        self._encoder: tok_mod.Encoder | None = None
        if n > 1:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                n,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(tok.spec, tok.eos_id, tok.dtype.str),
            )
        else:
            self._encoder = tok_mod.Encoder(tok.spec, tok.eos_id, tok.dtype.str)

    def check(self, files: list[inputs_mod.Input], split_on: str, text_field: str):
        """``inputs.check`` of each file, yielded in input order (the first problem raises)."""
        if self._pool is None:
            return (inputs_mod.check(f, split_on, text_field) for f in files)
        n = len(files)
        return self._pool.map(inputs_mod.check, files, [split_on] * n, [text_field] * n)

    def encode(self, texts: list[str]) -> concurrent.futures.Future:
        """A future of ``Encoder.encode(texts)``: (flat ids with EOS, tokens per document)."""
        if self._pool is not None:
            return self._pool.submit(_encode, texts)
        future = concurrent.futures.Future()
        assert self._encoder is not None, "made when there is no pool"
        future.set_result(self._encoder.encode(texts))
        return future

    def close(self, *, terminate: bool = False) -> None:
        """Stop the workers; ``terminate``: at once (after a failure), dropping queued tasks."""
        if self._pool is None:
            return
        if terminate:
            stop = getattr(self._pool, "terminate_workers", None)  # Python >= 3.14
            if stop is not None:
                stop()
                return
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.terminate()
        self._pool.shutdown(wait=True, cancel_futures=True)
