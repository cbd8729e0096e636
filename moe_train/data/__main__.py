"""``python -m moe_train.data prepare``: tokenize a corpus into train/val token shards.

Exit codes (as for the trainer, ``moe_train.base.exits``): 0 done (or already complete), 1 a bug
(traceback) or a worker process that died, 2 bad input or options (one line on stderr naming
the file and the line or byte offset; nothing is written when the inputs are bad), 5 the output
directory cannot be written, 130/143 interrupted by Ctrl-C/SIGTERM (rerun the same command to
resume; complete shards are kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from moe_train.base import exits
from moe_train.config import ConfigError
from moe_train.data import prepare, train_tokenizer

POLICIES = """\
inputs (by suffix, each optionally .gz):
  .jsonl, .json   JSON lines; the document is the --text-field string of each object
  .parquet        the --text-field column (needs pyarrow)
  anything else   plain text, split by --split-on:
                    blank-lines  documents are separated by one or more blank lines (default)
                    file         each file is one document
  globs are expanded and sorted; files keep the order of the --input arguments.

policies:
  UTF-8 is strict: an invalid byte exits 2 naming the file, line and byte offset (of the
  decompressed stream for .gz). Nothing is replaced. All inputs are checked before anything
  is written. Documents with no non-whitespace character are skipped (counted in the manifest).
  EOS is appended after every document; the tokenizer's own special tokens are not added.
  Tokens are uint16 when the vocabulary has at most 65,536 ids, else uint32 (little-endian).
  Validation documents are chosen by a hash of (--seed, document index), not by position.

output DIR:
  prepare.json             the job (tokenizer and input sha256s, options); a rerun must match
  train/, val/             shard_00000.bin (token ids, whole documents) and shard_00000.idx.npy
                           (int64 document starts, then the shard's token count)
  manifest.json            written last: tokenizer, EOS, vocabulary, dtype, inputs, rules and
                           per-shard sha256; read it with moe_train.data.prepared.open_split
  A rerun of the same command keeps complete shards and does the rest; on a finished DIR it
  verifies every shard's sha256 and rebuilds the ones that fail; a rerun with other inputs or
  options exits 2. Readers verify each shard the first time they open it and record the
  result in DIR/verified.json (by size and mtime), so later opens pay a stat.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_train.data", description=(__doc__ or "").partition("\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    prep = sub.add_parser(
        "prepare",
        help="tokenize text into train/val token shards",
        description="Tokenize a text corpus into train/val token shards.",
        epilog=POLICIES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = prep.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--tokenizer",
        metavar="TOK",
        help="Hugging Face tokenizer.json, or a directory holding one (a "
        "Hugging Face checkpoint's), or a SentencePiece .model; read locally",
    )
    which.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="N",
        default=None,  # not 0: argparse counts a flag given its default as absent from the group
        help="no tokenizer yet: train a byte-level BPE of N tokens (e.g. 8192; at least "
        f"{train_tokenizer.MIN_VOCAB}) "
        "on the inputs with Hugging Face tokenizers, saved as "
        "DIR/tokenizer.json",
    )
    prep.add_argument(
        "--input",
        dest="inputs",
        required=True,
        nargs="+",
        action="extend",
        metavar="FILE_OR_GLOB",
        help="input files or globs (quote globs to keep them from the shell)",
    )
    prep.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="output directory: new, empty, or an earlier run of the same job",
    )
    prep.add_argument(
        "--text-field", default="text", help="JSON field / Parquet column holding the text (default: text)"
    )
    prep.add_argument(
        "--split-on",
        choices=("blank-lines", "file"),
        default="blank-lines",
        help="plain text: documents separated by blank lines (default), or one document per file",
    )
    val = prep.add_mutually_exclusive_group()
    val.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help=f"hold out about this fraction of documents for validation "
        f"(default: {prepare.DEFAULT_VAL_FRACTION}; 0 for none)",
    )
    val.add_argument("--val-docs", type=int, metavar="N", help="hold out exactly N documents")
    prep.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help=f"tokenizer processes (default: min(CPUs, 8) = "
        f"{prepare.default_workers()} here); the output does not depend on it",
    )
    prep.add_argument(
        "--shard-tokens",
        type=int,
        default=prepare.DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"tokens per shard at most, unless one document is longer "
        f"(default: 2**28 = {prepare.DEFAULT_SHARD_TOKENS:,})",
    )
    prep.add_argument("--seed", type=int, default=0, help="seed of the validation choice (default: 0)")
    prep.add_argument(
        "--eos-id", type=int, metavar="N", help="EOS token id, when the tokenizer does not name one"
    )
    return p


def options(args: argparse.Namespace) -> prepare.Options:
    """The job; DataError for a --train-tokenizer size too small (0 too: it was given)."""
    if args.train_tokenizer is not None:
        train_tokenizer.check_size(args.train_tokenizer)
    # every field of the job is the flag of its name; these three differ in type or absent value
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(prepare.Options)}
    differ = {
        "tokenizer": args.tokenizer or "",
        "inputs": tuple(args.inputs),
        "train_tokenizer": args.train_tokenizer or 0,
    }
    return prepare.Options(**(flags | differ))


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):
    raise _Terminated()


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past ulimit -f: an EFBIG error, exit 5
    try:
        prepare.run(options(args))
    except ConfigError as err:
        _error(str(err))
        return exits.EXIT_CONFIG
    except exits.OutputError as err:
        _error(str(err))
        return exits.EXIT_OUTPUT
    except BrokenProcessPool:
        _error(
            "a tokenizer worker process died (out of memory? killed?); rerun to resume, "
            "perhaps with fewer --workers"
        )
        return exits.EXIT_BUG
    except KeyboardInterrupt:
        _error("interrupted; complete shards are kept: rerun the same command to resume")
        return 130
    except _Terminated:
        _error("stopped by SIGTERM; complete shards are kept: rerun the same command to resume")
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    return exits.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
