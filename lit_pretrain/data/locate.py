"""Where a config's corpus lies, checked when the config loads (config.load), so `show` refuses what `prepare` and
`train` would, before seconds of start-up: a corpus kind that reads no paths given some, and data.paths or
data.val_paths entries that are not there. For the single corpus and for each mixture source (data.sources), whose
null corpus/paths/val_paths stand for data.<same key>, as datamodule.source_configs resolves them.

Only the entries themselves are looked at (a file, a folder, a glob with a match, a Megatron prefix with its .bin
or .idx): walking a folder of a million files belongs to `prepare`, which says what it holds.
"""

import glob
import os
from typing import Iterator, List, NamedTuple

from lit_pretrain.errors import ConfigError

# data=<preset> (experiments/data/) of each corpus kind that reads data.paths; each preset has its own prepared_dir.
_PRESETS = ("data=text (plain-text files, one document per file), data=jsonl or data=parquet (or data=megatron, "
            "data=numpy or data=nanogpt for ids tokenized elsewhere)")


class Corpus(NamedTuple):
    section: str
    """data, or data.sources[i]"""
    corpus_key: str
    corpus: str
    paths_key: str
    paths: List[str]
    val_paths_key: str
    val_paths: List[str]


def corpora(data) -> Iterator[Corpus]:
    """The data section's corpus, or each source's, with the key each value came from."""
    if not data.sources:
        yield Corpus("data", "data.corpus", data.corpus, "data.paths", list(data.paths), "data.val_paths",
                     list(data.val_paths))
        return
    for i, src in enumerate(data.sources):
        own = f"data.sources[{i}]"
        (ck, corpus), (pk, paths), (vk, val_paths) = (
            (f"{own}.{name}", getattr(src, name)) if getattr(src, name) is not None
            else (f"data.{name}", getattr(data, name)) for name in ("corpus", "paths", "val_paths"))
        yield Corpus(own, ck, corpus, pk, list(paths), vk, list(val_paths))


def check_corpus_reads_paths(data) -> None:
    """A ConfigError when paths are given to data.corpus=stdlib, which reads the standard library and ignores them.
    Said first: otherwise the first complaint is that the stdlib prepared folder does not match the config."""
    for c in corpora(data):
        if c.corpus == "stdlib" and c.paths:
            fix = f"choose the preset of your files: {_PRESETS}" if c.section == "data" else \
                f"set {c.section}.corpus to the kind of your files (text, jsonl, parquet, megatron, numpy, nanogpt)"
            raise ConfigError(f"{c.paths_key}={c.paths} is set but {c.corpus_key}=stdlib reads the Python standard "
                              f"library and ignores paths: {fix}; or remove {c.paths_key}")


def check_paths_exist(data) -> None:
    """A ConfigError naming the key and the first entry of data.paths / data.val_paths that is not there."""
    for c in corpora(data):
        if c.corpus == "stdlib":
            continue
        for key, entries in ((c.paths_key, c.paths), (c.val_paths_key, c.val_paths)):
            for entry in map(str, entries):
                if glob.has_magic(entry):
                    if not glob.glob(entry, recursive=True):
                        raise ConfigError(f"{key} entry {entry!r} matches no file{_relative(entry)}: fix the "
                                          f"pattern or remove it")
                elif not _present(c.corpus, entry):
                    what = "no such file or folder" if c.corpus != "megatron" else \
                        "no file, folder or Megatron prefix of PREFIX.bin and PREFIX.idx by that name"
                    raise ConfigError(f"{key} entry {entry!r} does not exist ({what}{_relative(entry)}): fix the "
                                      "path or remove it")


def _present(corpus: str, entry: str) -> bool:
    if os.path.exists(entry):
        return True
    # a Megatron entry may name the prefix of PREFIX.bin + PREFIX.idx (data/pretokenized.py)
    return corpus == "megatron" and any(os.path.exists(entry + suffix) for suffix in (".bin", ".idx"))


def _relative(entry: str) -> str:
    return "" if os.path.isabs(entry) else f", looked for from the working directory {os.getcwd()}"
