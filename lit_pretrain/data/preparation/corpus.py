"""Raw documents of a corpus, in one deterministic order, and a fingerprint of exactly which text was read.

Corpora (`data.corpus`):
  stdlib  every `*.py` under the running Python's standard library (no download), id = path relative to it
  text    one document per file of `data.paths`; a directory contributes every regular file ending in
          .txt, .md, .rst or .py beneath it; id = the file's name (below)
  jsonl   one document per line of each file of `data.paths` (a directory contributes its .jsonl, .jsonl.gz and
          .jsonl.zst files), text under `data.text_field`; id = `name:line`
  parquet one document per row of each file's `data.text_field` column (a directory contributes its .parquet
          files); id = `name:row`, rows counted from 1
A file's name is its path relative to the folder holding the `data.paths` entry that found it (for a glob, the
folder holding its last component without wildcards): `/data/web` finds `web/part-0.jsonl`, `/data/web/*.jsonl`
finds the same, `/data/web/a.txt` finds `a.txt`. The split hashes the id (`is_validation`), so it must not depend
on where the corpus lies: a corpus copied to another machine or folder splits the same way and fingerprints the
same. (Until 2026-12 ids were absolute paths; `absolute_ids=True` gives those back to check old manifests.)
Every kind is read as a stream (data/preparation/readers.py): one file, one line or one record batch at a time.
Order: `data.paths` in the order given; inside a directory or glob match, sorted by path. Empty or whitespace-only
documents are dropped; `data.max_documents` keeps the first N documents left. Bytes that are not UTF-8 are decoded
with replacement (U+FFFD) and counted, never skipped silently: the count reaches the manifest and the
deduplication report. Per source file, the characters kept, control characters and replacements are counted too,
for prepare's quality gate (data/preparation/quality.py).
"""

import glob
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from lit_pretrain.data.preparation.quality import SourceQuality, count_control
from lit_pretrain.data.preparation.readers import JSONL_SUFFIXES, PARQUET_SUFFIXES, jsonl_records, parquet_records
from lit_pretrain.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
CORPUS_KINDS = ("stdlib", "text", "jsonl", "parquet")
_SUFFIXES = {"text": TEXT_SUFFIXES, "jsonl": JSONL_SUFFIXES, "parquet": PARQUET_SUFFIXES}
# Third-party packages live inside the stdlib folder on most installs; they are not the standard library.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Document:
    id: str
    text: str


@dataclass
class CorpusStats:
    """What reading a corpus kept and dropped (filled in while documents are yielded)."""

    documents: int = 0
    bytes: int = 0
    """UTF-8 bytes of the documents kept."""
    invalid_utf8_documents: int = 0
    """Documents holding bytes that are not UTF-8 (decoded with replacement, kept)."""
    invalid_utf8_sequences: int = 0
    """Invalid byte sequences replaced by U+FFFD, over all documents."""
    empty: int = 0
    """Empty or whitespace-only documents dropped."""
    sources: Dict[str, SourceQuality] = field(default_factory=dict)
    """Per source file: characters of its kept documents, control characters, U+FFFD replacements."""

    def source(self, name: str) -> SourceQuality:
        return self.sources.setdefault(name, SourceQuality())


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_roots(cfg) -> List[str]:
    """What the corpus was read from, as recorded in the manifest."""
    return [str(stdlib_root())] if cfg.corpus == "stdlib" else [str(p) for p in cfg.paths]


def iter_documents(cfg, stats: Optional[CorpusStats] = None, absolute_ids: bool = False) -> Iterator[Document]:
    """Yield the corpus's non-empty documents in order, stopping after `data.max_documents`."""
    stats = stats if stats is not None else CorpusStats()
    source = read_files(cfg.corpus, corpus_files(cfg, absolute_ids), cfg.text_field, stats)
    for origin, doc in source:
        if not doc.text.strip():
            stats.empty += 1
            continue
        stats.documents += 1
        stats.bytes += len(doc.text.encode("utf-8"))
        quality = stats.source(origin)
        quality.characters += len(doc.text)
        quality.control += count_control(doc.text)
        yield doc
        if cfg.max_documents is not None and stats.documents >= cfg.max_documents:
            break
    if stats.documents == 0:
        raise DataError(
            f"the {cfg.corpus} corpus at data.paths={corpus_roots(cfg)} has no non-empty documents "
            f"({stats.empty} empty): point data.paths at files with text"
        )


def corpus_files(cfg, absolute_ids: bool = False) -> List[Tuple[str, str]]:
    """(name, path) of every file of the corpus, in corpus order: what `read_files` reads. The name (see the
    module docstring; for stdlib, the path relative to the standard library) is what the quality gate names and
    what each document's id starts with; `absolute_ids` names each file by its path, as before 2026-12."""
    if cfg.corpus == "stdlib":
        if len(cfg.paths):
            raise DataError(
                f"data.paths={list(cfg.paths)} is set but data.corpus is 'stdlib', which reads the standard "
                "library and ignores paths: set data.corpus to 'text', 'jsonl' or 'parquet', or remove data.paths"
            )
        root = stdlib_root()
        return [(rel, str(root / rel)) for rel in _stdlib_files(root)]
    if cfg.corpus in _SUFFIXES:
        return [(str(path) if absolute_ids else name, str(path))
                for name, path in _resolve_paths(cfg.paths, cfg.corpus)]
    raise DataError(f"data.corpus={cfg.corpus!r} is not a corpus kind: use one of {', '.join(CORPUS_KINDS)}")


def read_files(kind: str, files: List[Tuple[str, str]], text_field: str, stats: CorpusStats
               ) -> Iterator[Tuple[str, Document]]:
    """(source name, document) of each document of `files` (from `corpus_files`), empty ones included, in order.
    Any file is read the same way whichever process reads it (the Ray engine reads groups of files on workers).
    A file that cannot be read is a DataError naming it."""
    readers = {"stdlib": _stdlib_documents, "text": _text_documents, "jsonl": _jsonl_documents,
               "parquet": _parquet_documents}
    for name, path in files:
        try:
            yield from readers[kind](name, Path(path), text_field, stats)
        except OSError as err:
            raise DataError(f"cannot read {path} ({err.strerror or err}): check that every machine reading the "
                            "corpus sees this file (and may read it), or remove it from data.paths") from None


def read_documents(cfg, stats: Optional[CorpusStats] = None, absolute_ids: bool = False) -> List[Document]:
    return list(iter_documents(cfg, stats, absolute_ids))


def corpus_fingerprint(docs) -> str:
    """sha256 over (id, sha256(text)) of each document in order: two corpora share it only if they hold the same
    text under the same ids in the same order. Ids are length-prefixed so no two sequences encode alike."""
    fingerprint = Fingerprint()
    for doc in docs:
        fingerprint.add(doc)
    return fingerprint.hexdigest()


def text_digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


class Fingerprint:
    """corpus_fingerprint fed one document at a time (prepare's streaming passes)."""

    def __init__(self):
        self._h = hashlib.sha256()

    def add(self, doc: Document) -> None:
        self.add_digest(doc.id, text_digest(doc.text))

    def add_digest(self, doc_id: str, digest: bytes) -> None:
        """Add a document by its id and `text_digest` (the Ray engine's workers hash the texts)."""
        encoded = doc_id.encode("utf-8")
        self._h.update(len(encoded).to_bytes(8, "little"))
        self._h.update(encoded)
        self._h.update(digest)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


# The source generators yield (source file, document) of one file: the file is what the quality gate names.
def _stdlib_files(root: Path) -> List[str]:
    rel_paths = []
    # os.walk with pruning, not rglob: site-packages can hold hundreds of MB that we would otherwise list (30x slower).
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP_DIRS]
        rel = Path(folder).relative_to(root)
        rel_paths += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(rel_paths)


def _stdlib_documents(rel: str, path: Path, _field: str, stats: CorpusStats) -> Iterator[Tuple[str, Document]]:
    # A few test files are deliberately in other encodings: kept, with their odd bytes replaced and counted.
    yield rel, Document(id=rel, text=decode_utf8(path.read_bytes(), stats, rel))


def _resolve_paths(paths, kind: str) -> List[Tuple[str, Path]]:
    """Expand `data.paths` (files, directories, glob patterns) into (name, file), in order, each file once."""
    if not len(paths):
        raise DataError(f"data.paths is empty: the {kind} corpus needs files, directories or glob patterns to read")
    suffixes = _SUFFIXES[kind]
    files: Dict[Path, str] = {}
    for entry in paths:
        entry = str(entry)
        if glob.has_magic(entry):
            matches = [Path(m) for m in sorted(glob.glob(entry, recursive=True))]
            if not matches:
                raise DataError(f"data.paths entry {entry!r} matches no file: fix the pattern or remove it")
        else:
            if not os.path.exists(entry):
                raise DataError(f"data.paths entry {entry!r} does not exist: fix the path or remove it")
            matches = [Path(entry)]
        base = _names_base(entry)
        for match in matches:
            found = _files_under(match, suffixes) if match.is_dir() else [match]
            if not found:
                raise DataError(
                    f"data.paths entry {entry!r}: directory {str(match)!r} holds no {'/'.join(suffixes)} files"
                )
            for path in found:  # a file two entries find keeps its first name and place
                files.setdefault(path, Path(os.path.abspath(path)).relative_to(base).as_posix())
    return [(name, path) for path, name in files.items()]


def _names_base(entry: str) -> Path:
    """The folder the names of an entry's files are relative to: the one holding the entry, or for a glob, the
    one holding its last component without wildcards (`/data/web/*/a.jsonl` → `/data`)."""
    parts = Path(os.path.abspath(entry)).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    return Path(*parts[:max(fixed - 1, 1)])


def _files_under(folder: Path, suffixes) -> List[Path]:
    # endswith, not Path.suffix: ".jsonl.gz" is two suffixes.
    found = [p for p in folder.rglob("*") if p.name.endswith(suffixes) and p.is_file()]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


_REPLACEMENT_UTF8 = "\ufffd".encode("utf-8")


def decode_utf8(data: bytes, stats: CorpusStats, source: Optional[str] = None) -> str:
    """UTF-8 text of `data`, each invalid byte sequence replaced by U+FFFD and counted in `stats` (and against
    `source`, the file it came from)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        # A U+FFFD already present in the input (validly encoded) is text, not a replacement: leave it out.
        replaced = text.count("\ufffd") - data.count(_REPLACEMENT_UTF8)
        stats.invalid_utf8_sequences += replaced
        stats.invalid_utf8_documents += 1
        if source is not None:
            stats.source(source).replaced += replaced
        return text


def _text_documents(name: str, path: Path, _field: str, stats: CorpusStats) -> Iterator[Tuple[str, Document]]:
    yield name, Document(id=name, text=decode_utf8(path.read_bytes(), stats, name))


def _jsonl_documents(name: str, path: Path, text_field: str, stats: CorpusStats) -> Iterator[Tuple[str, Document]]:
    for line, text in jsonl_records(path, text_field, lambda raw: decode_utf8(raw, stats, name)):
        yield name, Document(id=f"{name}:{line}", text=text)


def _parquet_documents(name: str, path: Path, text_field: str, _stats) -> Iterator[Tuple[str, Document]]:
    # Parquet strings are UTF-8 already validated by pyarrow: nothing to replace or count.
    for row, text in parquet_records(path, text_field):
        yield name, Document(id=f"{name}:{row}", text=text or "")


def is_validation(doc_id: str, split_seed: int, val_fraction: float) -> bool:
    """A document's split depends only on its id and the seed: adding documents never moves existing ones."""
    digest = hashlib.sha256(f"{split_seed}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < val_fraction
