"""Streaming readers: one file at a time, one document at a time, whatever the file's size.

Each reader yields `(id, raw)` pairs: `raw` is the document's bytes (decoded by corpus.py, which counts invalid
UTF-8) or, for Parquet, already a `str`. Nothing holds more than a read buffer (~1 MB) or a Parquet record batch
of the file. zstandard and pyarrow are imported only when a file needs them (`pip install lit-pretrain[data]`),
so the default stdlib corpus needs neither.

A compressed file that ends mid-stream is an error naming the file, never a silently shorter corpus: gzip raises
EOFError itself; zstandard's stream reader just stops, so frames are decoded here and an unfinished frame at the
end of the file is refused.
"""

import gzip
import json
import zlib
from pathlib import Path
from typing import Iterator, Tuple, Union

from lit_pretrain.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
_READ_BYTES = 1 << 20
_PARQUET_BATCH_ROWS = 1024  # a record batch of ~1k documents: a few MB of text at most for web-like documents


def _truncated(path: Path, err) -> DataError:
    return DataError(f"{path} is truncated or corrupted ({err}): re-download or re-compress it, or remove it from "
                     "data.paths")


def _missing_extra(path: Path, package: str) -> DataError:
    return DataError(f"{path} needs the {package} package, which is not installed: pip install "
                     f"'lit-pretrain[data]', or remove the file from data.paths")


def _zstd_chunks(path: Path) -> Iterator[bytes]:
    """Decompressed bytes of every frame of a .zst file; a DataError if the last frame is unfinished."""
    try:
        import zstandard
    except ImportError:
        raise _missing_extra(path, "zstandard") from None
    dctx = zstandard.ZstdDecompressor()
    with open(path, "rb") as f:
        obj, in_frame = dctx.decompressobj(), False
        try:
            while data := f.read(_READ_BYTES):
                while data:
                    in_frame = True
                    out = obj.decompress(data)
                    if out:
                        yield out
                    if obj.eof:  # a frame ended: the rest of the input starts the next one
                        data, obj, in_frame = obj.unused_data, dctx.decompressobj(), False
                    else:
                        data = b""
        except zstandard.ZstdError as err:
            raise _truncated(path, err) from None
    if in_frame:
        raise _truncated(path, "the last zstd frame ends early")


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    rest = b""
    for chunk in chunks:
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        yield from parts
    if rest:
        yield rest


def _raw_lines(path: Path) -> Iterator[bytes]:
    name = path.name
    if name.endswith(".zst"):
        yield from _lines(_zstd_chunks(path))
    elif name.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as f:
                yield from f
        except (EOFError, OSError, zlib.error) as err:
            raise _truncated(path, err) from None
    else:
        with open(path, "rb") as f:
            yield from f


def jsonl_records(path: Path, text_field: str, decode) -> Iterator[Tuple[int, str]]:
    """(line number, text) of each non-blank line of a .jsonl, .jsonl.gz or .jsonl.zst file; `decode` turns a
    line's bytes into str (corpus.decode_utf8, which counts replacements)."""
    for line_no, raw in enumerate(_raw_lines(path), start=1):
        where = f"{path}:{line_no}"
        line = decode(raw)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where} is not a JSON object ({e}): each line must be an object with the text under "
                f"data.text_field={text_field!r}; fix or remove the line"
            ) from None
        if not isinstance(record, dict):
            raise DataError(
                f"{where} is a JSON {type(record).__name__}, not an object: each line must be an object with the "
                f"text under data.text_field={text_field!r}; fix or remove the line"
            )
        if not isinstance(record.get(text_field), str):
            raise DataError(
                f"{where} has no string field data.text_field={text_field!r}: set data.text_field to the "
                "key that holds the text, or fix the line"
            )
        yield line_no, record[text_field]


def parquet_records(path: Path, text_field: str) -> Iterator[Tuple[int, Union[str, None]]]:
    """(row number, text) of each row of a Parquet file's `text_field` column, rows counted from 1, read one
    record batch at a time; a null is an empty document."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise _missing_extra(path, "pyarrow") from None
    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError) as err:
        raise _truncated(path, err) from None
    if text_field not in schema.names:
        raise DataError(
            f"{path} has no column data.text_field={text_field!r} (columns: {', '.join(schema.names)}): set "
            "data.text_field to the column that holds the text"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column data.text_field={text_field!r} holds {kind}, not strings: set "
                        "data.text_field to the column that holds the text")
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                row += 1
                yield row, text
    except (pa.ArrowException, OSError) as err:
        raise _truncated(path, err) from None
