"""``python -m moe_train.data prepare``: tokenize a text corpus into sharded token files.

The run, in order:

1. Load the tokenizer (``moe_train.data.tokenizer``) and expand ``--input`` (``.inputs``).
2. Check every input end to end, in parallel: strict UTF-8, JSON lines, the text field, and
   count the documents and hash the files (sha256). A bad input stops here, before anything is
   written, with one line naming the file and the line or byte offset.
3. Claim ``--out DIR``: write ``DIR/prepare.json`` (everything that decides the output bytes:
   tokenizer hash, EOS, input hashes, options). A rerun with the same job resumes; any
   difference is refused, so outputs of two jobs never mix.
4. Tokenize (``moe_train.data.tokenize_pass``): documents are read in input order, routed to
   ``train`` or ``val`` by their index (``moe_train.data.split``), encoded by ``--workers``
   processes in batches whose results are consumed in submission order, and appended with an
   EOS to the split's shards (``moe_train.data.shards``). Shards already complete from an
   earlier run are kept untouched and their documents are not tokenized again.
5. Write ``DIR/manifest.json`` last, atomically: its presence means the directory is complete.

A finished directory (its manifest present) is verified instead: every shard's sha256 is
recomputed against the manifest (``moe_train.data.verify``, which records the result for the
runs that open it). All match: nothing to do. A shard that fails (changed in place, truncated,
missing) is rebuilt from its own documents, which the manifest counts, and verified again; the
other shards are not touched.

The output depends only on the inputs and the options that ``prepare.json`` records, never on
``--workers``, timing, or whether the run was interrupted and resumed: the same job gives the
same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

from moe_train.base.exits import OutputError
from moe_train.data import (
    DataError,
    shards,
    train_tokenizer,
    verify,
)
from moe_train.data import (
    inputs as inputs_mod,
)
from moe_train.data import (
    split as split_mod,
)
from moe_train.data import (
    tokenizer as tok_mod,
)
from moe_train.data.prepared import FORMAT, FORMAT_VERSION
from moe_train.data.progress import Progress
from moe_train.data.tokenize_pass import SPLITS, tokenize
from moe_train.data.workers import Workers

# 2**28 tokens: 512 MiB per uint16 shard (1 GiB at uint32). A trillion-token corpus is a few
# thousand files, while an interrupted run loses under a minute of tokenizing per split at
# typical multi-worker rates; a shard still fits easily in page cache and on any filesystem.
DEFAULT_SHARD_TOKENS = 1 << 28
# Hold out 1% by default: an evaluation set that was never trained on costs little, and
# choosing it later means preparing again. --val-fraction 0 trains on everything.
DEFAULT_VAL_FRACTION = 0.01
JOB_FILE, MANIFEST = "prepare.json", "manifest.json"
REBUILD_LIMIT = 1 << 62  # a rebuilt shard is one shard, whatever it holds (never split)


def default_workers() -> int:
    """min(usable CPUs, 8)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, 8))


@dataclasses.dataclass(frozen=True)
class Options:
    """The arguments of ``prepare`` (see ``python -m moe_train.data prepare --help``)."""

    tokenizer: str
    inputs: tuple[str, ...]
    out: Path
    text_field: str = "text"
    split_on: str = "blank-lines"
    val_fraction: float | None = None  # None: DEFAULT_VAL_FRACTION unless val_docs is set
    val_docs: int | None = None
    workers: int = 0  # 0: default_workers()
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    seed: int = 0
    eos_id: int | None = None
    train_tokenizer: int = 0  # > 0: train a BPE of this size into out/tokenizer.json

    def checked(self) -> Options:
        """These options with defaults filled in; a :class:`DataError` for a bad value."""
        if self.split_on not in inputs_mod.SPLIT_ON:
            raise DataError(f"--split-on {self.split_on!r}: choose one of {', '.join(inputs_mod.SPLIT_ON)}")
        if self.val_fraction is not None and self.val_docs is not None:
            raise DataError("--val-fraction and --val-docs exclude each other; give one")
        fraction = self.val_fraction
        if fraction is None and self.val_docs is None:
            fraction = DEFAULT_VAL_FRACTION
        if fraction is not None and not 0.0 <= fraction < 1.0:
            raise DataError(f"--val-fraction {fraction} is not in [0, 1)")
        for flag, value, low in (
            ("--val-docs", self.val_docs, 0),
            ("--workers", self.workers, 0),
            ("--shard-tokens", self.shard_tokens, 1),
            ("--seed", self.seed, 0),
            ("--eos-id", self.eos_id, 0),
        ):
            if value is not None and value < low:
                raise DataError(f"{flag} {value} must be at least {low}")
        if self.train_tokenizer:
            train_tokenizer.check_size(self.train_tokenizer)
        if not self.text_field:
            raise DataError("--text-field is empty; name the field that holds the text")
        return dataclasses.replace(
            self,
            val_fraction=fraction,
            out=Path(self.out),
            workers=self.workers or default_workers(),
            inputs=tuple(self.inputs),
        )

    def val_rule(self) -> split_mod.ValRule:
        if self.val_docs is not None:
            return split_mod.ValRule(seed=self.seed, docs=self.val_docs)
        return split_mod.ValRule(seed=self.seed, fraction=self.val_fraction)


@dataclasses.dataclass
class SplitCounts:
    documents: int = 0
    tokens: int = 0
    shards: int = 0
    kept_shards: int = 0  # complete from an earlier run, not rewritten


@dataclasses.dataclass
class Summary:
    """What a run produced (``lines()`` is the report printed at the end)."""

    out: Path
    splits: dict[str, SplitCounts]
    dtype: str
    vocab_size: int = 0  # the tokenizer's (highest id + 1): model.vocab_size of a run on it
    tokenizer: str = ""
    seconds: float = 0.0
    tokenized: int = 0  # tokens encoded by this run
    already: bool = False  # the directory was complete and every shard verified: nothing to do
    repaired: list[str] = dataclasses.field(default_factory=list)  # shard files rebuilt, why

    def lines(self) -> list[str]:
        rate = self.tokenized / self.seconds if self.seconds > 0 else 0.0
        done = "repaired" if self.repaired else "prepared"
        head = (
            f"{self.out}: already prepared, every shard verified"
            if self.already
            else f"{done} {self.out} in {self.seconds:.1f} s ({rate:,.0f} tokens/s)"
        )
        rows = [head] + [f"  rebuilt {r}" for r in self.repaired]
        for name, c in self.splits.items():
            kept = f", {c.kept_shards} kept from an earlier run" if c.kept_shards else ""
            rows.append(
                f"  {name}: {c.documents:,} documents, {c.tokens:,} tokens "
                f"({self.dtype}), {c.shards} shard{'s' * (c.shards != 1)}{kept}"
            )
        rows.append(
            f"  vocabulary: {self.vocab_size:,} tokens ({self.tokenizer}); a run with "
            f"--set data.source=prepared --set data.path={self.out} takes "
            f"model.vocab_size={self.vocab_size} from its {MANIFEST}"
        )
        return rows


# ---------------------------------------------------------------------------------------------
# The job and the output directory


def job_record(opts: Options, tok: tok_mod.TokenizerInfo, files, checked, rule) -> dict:
    """Everything that decides the output bytes; a rerun must match it exactly."""
    trained = {train_tokenizer.JOB_KEY: opts.train_tokenizer} if opts.train_tokenizer else {}
    return {
        **trained,
        "format_version": FORMAT_VERSION,
        "tokenizer": {
            "kind": tok.spec.kind,
            "sha256": tok.sha256,
            "config_sha256": tok.config_sha256,
            "library": tok.library,
            "eos_id": tok.eos_id,
            "vocab_size": tok.vocab_size,
        },
        "dtype": tok.dtype.name,
        "inputs": [
            {"sha256": c.sha256, "size": f.size, "format": f.format, "gzip": f.gzip}
            for f, c in zip(files, checked)
        ],
        "text_field": opts.text_field,
        "split_on": opts.split_on,
        "val": rule.describe(),
        "shard_tokens": opts.shard_tokens,
    }


def _dump(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")


def claim(out: Path, job: dict, allowed: tuple[str, ...] = ()) -> None:
    """Make ``out`` this job's directory, or refuse one that holds another job's output
    (files named in ``allowed``, e.g. the tokenizer this job trained there, may be in it)."""
    if out.exists() and not out.is_dir():
        raise DataError(
            f"--out {out} is a file; expected a directory (new, empty, or an earlier run of the same prepare)"
        )
    job_path = out / JOB_FILE
    if job_path.is_file():
        try:
            old = json.loads(job_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise DataError(f"{job_path}: unreadable ({err}); delete --out {out} to start over") from None
        if old != job:
            keys = [k for k in job if not isinstance(old, dict) or old.get(k) != job[k]]
            raise DataError(
                f"--out {out} holds a prepare of other inputs or options "
                f"({', '.join(keys) or 'format'} differ); use another --out, or "
                f"delete it to start over"
            )
        return
    if out.is_dir() and any(p.name not in allowed for p in out.iterdir()):
        raise DataError(f"--out {out} is not empty and has no {JOB_FILE}; use a new or empty directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        shards.atomic_write(job_path, _dump(job))
    except OSError as err:
        raise OutputError(f"--out {out}: cannot write ({err.strerror or err})") from None


def _verified(out: Path) -> tuple[dict, list[verify.Bad]] | None:
    """(the manifest of a finished directory, its shard files that fail verification: every
    sha256 recomputed), or None when there is no manifest. One that cannot be read is removed,
    so that nothing claims completeness while shards are rewritten. Called after
    :func:`claim`, so a manifest found here was written by this same job."""
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        return manifest, verify.check(out, manifest, SPLITS, trust_cache=False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        path.unlink()
        return None


# ---------------------------------------------------------------------------------------------
# The passes


def _check_all(workers: Workers, files, opts: Options, stream) -> list[inputs_mod.Checked]:
    """Pass 1: every input read and validated (in parallel), in input order."""
    progress = Progress("check inputs", sum(f.size for f in files), stream)
    checked: list[inputs_mod.Checked] = []
    done = 0
    try:
        for f, c in zip(files, workers.check(files, opts.split_on, opts.text_field)):
            checked.append(c)
            done += f.size
            progress.update(sum(x.documents for x in checked), 0, done)
    finally:
        progress.close()
    return checked


def manifest(
    opts: Options,
    tok: tok_mod.TokenizerInfo,
    files,
    checked,
    rule,
    records: dict[str, list[shards.ShardRecord]],
) -> dict:
    """``DIR/manifest.json``: what the directory holds and how it was made."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": {
            "path": tok.spec.path,
            "kind": tok.spec.kind,
            "sha256": tok.sha256,
            "config": tok.config_path,
            "config_sha256": tok.config_sha256,
            "library": tok.library,
            "eos_token": tok.eos_token,
            "eos_source": tok.eos_source,
        },
        "eos_id": tok.eos_id,
        "vocab_size": tok.vocab_size,
        "dtype": tok.dtype.name,
        "byte_order": "little",
        "policy": {
            "split_on": opts.split_on,
            "text_field": opts.text_field,
            "plain_text": (
                "one document per file"
                if opts.split_on == "file"
                else "documents separated by one or more blank lines"
            ),
            "utf8": "strict (an invalid byte is an error)",
            "empty": "documents with no non-whitespace character are skipped",
            "eos": "appended after every document",
            "special_tokens": "none added",
        },
        "inputs": [
            {
                "path": str(f.path),
                "format": f.format,
                "gzip": f.gzip,
                "size": f.size,
                "sha256": c.sha256,
                "documents": c.documents,
                "empty": c.empty,
            }
            for f, c in zip(files, checked)
        ],
        "val": rule.describe(),
        "shard_tokens": opts.shard_tokens,
        "splits": {
            name: {
                "documents": sum(r.documents for r in rs),
                "tokens": sum(r.tokens for r in rs),
                "shards": len(rs),
                "files": [r.to_json(name) for r in rs],
            }
            for name, rs in records.items()
        },
    }


def _summary(out: Path, man: dict, **kw) -> Summary:
    splits = {
        name: SplitCounts(s["documents"], s["tokens"], s["shards"]) for name, s in man["splits"].items()
    }
    return Summary(
        out, splits, man["dtype"], vocab_size=man["vocab_size"], tokenizer=man["tokenizer"]["path"], **kw
    )


def run(opts: Options, *, log: Callable[[str], None] = print, stream=None) -> Summary:
    """Prepare ``opts.out``; print the summary through ``log`` and return it. Problems with
    the inputs or options are :class:`DataError`; unwritable output is :class:`OutputError`."""
    opts = opts.checked()
    files = inputs_mod.expand(opts.inputs)
    if opts.train_tokenizer:
        path = train_tokenizer.ensure(
            opts.out, files, opts.train_tokenizer, log=log, split_on=opts.split_on, text_field=opts.text_field
        )
        opts = dataclasses.replace(opts, tokenizer=str(path))
    tok = tok_mod.load(opts.tokenizer, opts.eos_id)
    workers = Workers(opts.workers, tok)
    failed = True
    try:
        summary = _run(opts, tok, files, workers, stream)
        failed = False
    except OSError as err:
        where = err.filename or opts.out
        raise OutputError(f"{where}: cannot write ({err.strerror or err})") from None
    finally:
        workers.close(terminate=failed)
    for row in summary.lines():
        log(row)
    return summary


def _run(opts: Options, tok: tok_mod.TokenizerInfo, files, workers: Workers, stream) -> Summary:
    checked = _check_all(workers, files, opts, stream)
    rule = opts.val_rule().with_count(sum(c.documents for c in checked))
    claim(
        opts.out,
        job_record(opts, tok, files, checked, rule),
        allowed=(train_tokenizer.FILE,) if opts.train_tokenizer else (),
    )
    found = _verified(opts.out)
    if found is not None:
        if not found[1]:
            return _summary(opts.out, found[0], already=True)
        return _repair(opts, tok, (files, checked, rule), workers, *found, stream)
    kept = {name: shards.finished(opts.out / name, tok.dtype) for name in SPLITS}
    writers = {
        name: shards.ShardWriter(opts.out / name, tok.dtype, opts.shard_tokens, first=len(kept[name]))
        for name in SPLITS
    }
    targets = {name: [(sum(r.documents for r in kept[name]), math.inf, writers[name])] for name in SPLITS}
    job, seconds = tokenize(opts, (files, checked, rule), workers, targets, stream)
    records = {name: kept[name] + writers[name].records for name in SPLITS}
    man = manifest(opts, tok, files, checked, rule, records)
    shards.atomic_write(opts.out / MANIFEST, _dump(man))
    summary = _summary(opts.out, man, seconds=seconds, tokenized=job.tokens)
    for name in SPLITS:
        summary.splits[name].kept_shards = len(kept[name])
    return summary


def _repair(
    opts: Options,
    tok: tok_mod.TokenizerInfo,
    inputs: tuple,
    workers: Workers,
    man: dict,
    bad: list[verify.Bad],
    stream,
) -> Summary:
    """Rebuild the shards of a finished directory that failed verification, each from its own
    documents (the manifest counts them), and verify them against the manifest again."""
    targets: dict[str, list] = {name: [] for name in SPLITS}
    for name, k in sorted({(b.split, b.shard) for b in bad}):
        entries = man["splits"][name]["files"]
        first = sum(e["documents"] for e in entries[:k])
        writer = shards.ShardWriter(opts.out / name, tok.dtype, REBUILD_LIMIT, first=k)
        targets[name].append((first, first + entries[k]["documents"], writer))
    job, seconds = tokenize(opts, inputs, workers, targets, stream)
    still = verify.check(opts.out, man, SPLITS)
    if still:
        raise DataError(
            f"{verify.describe(still)} after rebuilding it (another tokenizer "
            f"library version?); prepare into a new --out"
        )
    summary = _summary(opts.out, man, seconds=seconds, tokenized=job.tokens)
    summary.repaired = [f"{b.path.relative_to(opts.out)}: {b.why}" for b in bad]
    return summary
