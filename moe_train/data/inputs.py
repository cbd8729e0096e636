"""Input files of ``python -m moe_train.data prepare``: expanding, checking and reading documents.

Formats, by suffix (after an optional ``.gz``, which is decompressed on the fly):

* ``.jsonl`` / ``.json``: JSON lines, one object per line; the document is the string in its
  ``--text-field`` (default ``text``). Whitespace-only lines are skipped. A line that is not a
  JSON object, lacks the field, or holds a non-string there is an error naming ``file:line``.
* ``.parquet``: the ``--text-field`` column (string or binary); needs ``pyarrow``. A null is an
  error naming the row (counting from 0).
* anything else: plain text. ``--split-on blank-lines`` (default): documents are runs of
  non-blank lines, separated by one or more blank lines (empty or only whitespace); a document is
  its lines joined by ``\\n`` (a ``\\r`` before the newline is dropped). ``--split-on file``: each
  file is one document, its text unchanged.

Patterns with ``*``, ``?`` or ``[`` are globs (``**`` recurses), expanded and sorted; the files of
all arguments keep the order of the arguments. A pattern that matches nothing, a missing file, a
directory or a file named twice is an error.

UTF-8 policy: strict. Every byte must be valid UTF-8 (checked before anything is written); the
first invalid byte is an error naming the file, the line and the byte offset (in the decompressed
stream for ``.gz``). Nothing is replaced or dropped. Documents with no non-whitespace character
are skipped and counted (``empty`` in the manifest); a file with no document is an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import gzip
import hashlib
import io
import json
import shutil
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from moe_train.data import DataError

SPLIT_ON = ("blank-lines", "file")
_BUFFER = 1 << 20


@dataclasses.dataclass(frozen=True)
class Input:
    """One input file: where it is, how it was named, its size, format and compression."""

    path: Path  # resolved
    shown: str  # as matched from --input, for messages
    size: int
    format: str  # "text" | "jsonl" | "parquet"
    gzip: bool


@dataclasses.dataclass(frozen=True)
class Checked:
    """An input after the check pass: its checksum and document counts."""

    sha256: str
    documents: int
    empty: int


def input_format(path: Path) -> tuple[str, bool]:
    """(format, gzipped) of ``path`` from its suffixes."""
    suffixes = [s.lower() for s in path.suffixes]
    gz = bool(suffixes) and suffixes[-1] == ".gz"
    last = (suffixes[:-1] if gz else suffixes)[-1:] or [""]
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(last[0], "text"), gz


def expand(patterns: Sequence[str]) -> list[Input]:
    """The input files ``patterns`` name, in order (globs sorted), each checked to exist."""
    if not patterns:
        raise DataError("no --input given; name at least one file or glob")
    found: dict[Path, str] = {}
    for pattern in patterns:
        names = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        files = [n for n in names if Path(n).is_file()]
        if not files:
            if glob.has_magic(pattern):
                raise DataError(f"--input {pattern}: matches no file")
            is_dir = Path(pattern).is_dir()
            raise DataError(
                f"--input {pattern}: {'a directory; name its files or a glob' if is_dir else 'not found'}"
            )
        for name in files:
            path = Path(name).resolve()
            if path in found:
                raise DataError(
                    f"--input {pattern}: {name} is already an input (as {found[path]}); name each file once"
                )
            found[path] = name
    return [Input(path, shown, path.stat().st_size, *input_format(path)) for path, shown in found.items()]


class _Counted(io.RawIOBase):
    """A raw file that counts (and optionally hashes) the bytes read through it."""

    def __init__(self, f, hasher=None):
        self._f, self.hasher, self.count = f, hasher, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._f.readinto(b)
        if n:
            self.count += n
            if self.hasher is not None:
                self.hasher.update(memoryview(b)[:n])
        return n

    def drain(self) -> None:
        """Read (and hash) the rest of the file."""
        buf = bytearray(_BUFFER)
        while self.readinto(buf):
            pass

    def close(self) -> None:
        self._f.close()
        super().close()


class Reader:
    """Reads the documents of one input; ``consumed`` is how many of its bytes are read."""

    def __init__(self, inp: Input, *, split_on: str = "blank-lines", text_field: str = "text", hasher=None):
        self.inp, self.split_on, self.text_field = inp, split_on, text_field
        self.empty = 0  # documents skipped as empty
        self._hasher = hasher
        self._raw: _Counted | None = None
        self._parquet_fraction = 0.0

    @property
    def consumed(self) -> int:
        if self.inp.format == "parquet":
            return int(self.inp.size * self._parquet_fraction)
        return self._raw.count if self._raw else 0

    def documents(self) -> Iterator[str]:
        """The input's non-empty documents, in file order (one-line :class:`DataError`)."""
        try:
            if self.inp.format == "parquet":
                docs = _parquet(self)
            else:
                docs = self._stream_documents()
            for doc in docs:
                if doc.strip():
                    yield doc
                else:
                    self.empty += 1
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:
            raise DataError(f"{self.inp.shown}: not a valid gzip file ({err})") from None
        except OSError as err:
            raise DataError(f"{self.inp.shown}: cannot read ({err.strerror or err})") from None
        finally:
            if self._raw is not None:
                self._raw.close()

    def _stream_documents(self) -> Iterator[str]:
        self._raw = _Counted(open(self.inp.path, "rb", buffering=0), self._hasher)
        stream = io.BufferedReader(self._raw, _BUFFER)
        if self.inp.gzip:
            stream = gzip.GzipFile(fileobj=stream, mode="rb")
        if self.inp.format == "jsonl":
            yield from _jsonl(stream, self.inp, self.text_field)
        elif self.split_on == "file":
            yield _whole(stream.read(), self.inp)
        else:
            yield from _paragraphs(stream, self.inp)
        self._raw.drain()


def _decode(raw: bytes, inp: Input, offset: int, lineno: int) -> str:
    """``raw`` (which starts at byte ``offset``, on line ``lineno``) as strict UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _utf8_error(inp, raw, err.start, offset, lineno) from None


def _utf8_error(inp: Input, raw: bytes, at: int, offset: int, lineno: int) -> DataError:
    where = " of the decompressed stream" if inp.gzip else ""
    return DataError(
        f"{inp.shown}:{lineno}: invalid UTF-8 at byte offset {offset + at}{where} "
        f"(byte 0x{raw[at]:02x}); inputs must be strict UTF-8 text"
    )


def _lines(stream, inp: Input) -> Iterator[tuple[int, bytes, str]]:
    """(line number from 1, raw bytes, text) of each line, decoded as strict UTF-8."""
    offset = 0
    for lineno, raw in enumerate(stream, 1):
        yield lineno, raw, _decode(raw, inp, offset, lineno)
        offset += len(raw)


def _paragraphs(stream, inp: Input) -> Iterator[str]:
    """Runs of non-blank lines, joined by newlines (``--split-on blank-lines``)."""
    lines: list[str] = []
    for _, _, line in _lines(stream, inp):
        line = line[:-1] if line.endswith("\n") else line
        line = line[:-1] if line.endswith("\r") else line
        if line.strip():
            lines.append(line)
        elif lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


def _whole(data: bytes, inp: Input) -> str:
    """The whole file as one document (``--split-on file``)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        lineno = data.count(b"\n", 0, err.start) + 1
        raise _utf8_error(inp, data, err.start, 0, lineno) from None


def _jsonl(stream, inp: Input, field: str) -> Iterator[str]:
    """The ``field`` string of each JSON line."""
    for lineno, raw, text in _lines(stream, inp):
        if not text.strip():
            continue
        obj = _json_object(text, inp, lineno)
        if field not in obj:
            have = ", ".join(list(obj)[:10]) or "none"
            raise DataError(
                f"{inp.shown}:{lineno}: no {field!r} field (fields: {have}); "
                f"choose the text field with --text-field"
            )
        value = obj[field]
        if not isinstance(value, str):
            raise DataError(
                f"{inp.shown}:{lineno}: field {field!r} is a JSON {type(value).__name__}, not a string"
            )
        if b"\\u" in raw or b"\\U" in raw:
            _no_surrogates(value, inp, lineno)
        yield value


def _json_object(text: str, inp: Input, lineno: int) -> dict:
    """Line ``lineno`` as a JSON object; DataError when it is not JSON or not an object."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{inp.shown}:{lineno}: not JSON ({err.msg} at column {err.colno}); "
            f"expected one JSON object per line"
        ) from None
    if not isinstance(obj, dict):
        raise DataError(
            f"{inp.shown}:{lineno}: a JSON {type(obj).__name__}, not an object; "
            f"expected one JSON object per line"
        )
    return obj


def _no_surrogates(value: str, inp: Input, lineno: int) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise DataError(
            f"{inp.shown}:{lineno}: the text has a lone surrogate "
            f"(\\u{ord(value[err.start]):04x}), which is not valid Unicode"
        ) from None


def _parquet_table(reader: Reader, stack):
    """The ``pyarrow.parquet.ParquetFile`` of the input (``.gz``: decompressed to a temp file)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{reader.inp.shown}: Parquet inputs need pyarrow, which is not installed; pip install pyarrow"
        ) from None
    source = reader.inp.path
    if reader.inp.gzip:
        source = stack.enter_context(tempfile.TemporaryFile())
        with gzip.open(reader.inp.path, "rb") as gz:
            shutil.copyfileobj(gz, source, _BUFFER)
        source.seek(0)
    try:
        return pq.ParquetFile(source)
    except Exception as err:  # pyarrow.ArrowInvalid and friends
        if isinstance(err, OSError) and err.errno is not None:
            raise
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{reader.inp.shown}: not a Parquet file ({why})") from None


def _parquet(reader: Reader) -> Iterator[str]:
    """The strings of the ``--text-field`` column, row by row."""
    import pyarrow as pa

    inp, field = reader.inp, reader.text_field
    with contextlib.ExitStack() as stack:
        pf = _parquet_table(reader, stack)
        schema = pf.schema_arrow
        if field not in schema.names:
            raise DataError(
                f"{inp.shown}: no column {field!r} (columns: "
                f"{', '.join(schema.names[:10]) or 'none'}); choose the text column "
                f"with --text-field"
            )
        kind = schema.field(field).type
        if not (
            pa.types.is_string(kind)
            or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)
        ):
            raise DataError(f"{inp.shown}: column {field!r} is {kind}, not text")
        total, row = max(pf.metadata.num_rows, 1), 0
        for batch in pf.iter_batches(batch_size=4096, columns=[field]):
            for value in batch.column(0).cast(pa.large_binary()).to_pylist():
                if value is None:
                    raise DataError(f"{inp.shown}: row {row} (counting from 0): {field!r} is null")
                try:
                    yield value.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"{inp.shown}: row {row} (counting from 0): invalid UTF-8 at "
                        f"byte offset {err.start} of {field!r}; inputs must be strict "
                        f"UTF-8 text"
                    ) from None
                row += 1
            reader._parquet_fraction = row / total


def check(inp: Input, split_on: str, text_field: str) -> Checked:
    """Read ``inp`` end to end: its sha256 and document counts, or the first problem."""
    hasher = hashlib.sha256()
    reader = Reader(inp, split_on=split_on, text_field=text_field, hasher=hasher)
    documents = sum(1 for _ in reader.documents())
    if inp.format == "parquet":  # hashed apart from reading (random access)
        with open(inp.path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    else:
        digest = hasher.hexdigest()
    if not documents:
        why = "empty file" if inp.size == 0 else f"{reader.empty:,} empty documents skipped"
        raise DataError(f"{inp.shown}: no documents ({why}); remove it from --input")
    return Checked(digest, documents, reader.empty)
