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

from moe_train.base import exits
from moe_train.config import ConfigError
from moe_train.config.cli import add_options, options_file
from moe_train.data import prepare, train_tokenizer

OPTIONS = options_file(__file__)  # prepare's options (options.toml)

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
    add_options(prep, OPTIONS["prepare"], _help_values())
    # the defaults are the job's (prepare.Options'), but for --train-tokenizer's (None, not 0:
    # argparse counts a flag given its default as absent from its group)
    prep.set_defaults(**(_job_defaults() | {"train_tokenizer": None}))
    return p


def _help_values() -> dict[str, object]:
    """What the options' help shows: the job's limits and defaults."""
    return {
        "MIN_VOCAB": train_tokenizer.MIN_VOCAB,
        "DEFAULT_VAL_FRACTION": prepare.DEFAULT_VAL_FRACTION,
        "default_workers": prepare.default_workers(),
        "DEFAULT_SHARD_TOKENS": prepare.DEFAULT_SHARD_TOKENS,
    }


def _job_defaults() -> dict[str, object]:
    """The defaults of prepare.Options' fields that have one."""
    return {
        f.name: f.default for f in dataclasses.fields(prepare.Options) if f.default is not dataclasses.MISSING
    }


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
