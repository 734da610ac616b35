"""`lit-pretrain export-data --to megatron|numpy PREPARED_DIR OUT`: a prepared folder's shards in another pipeline's
format (data/pretokenized.py describes both), one file (pair) per split, plus the tokenizer:

  megatron  OUT/train.bin + OUT/train.idx, OUT/val.bin + OUT/val.idx: one sequence per document (each ending in the
            EOD id, as in the shards); uint16 ids stay uint16 (code 8), uint32 ids become int32 (code 4: Megatron
            has no uint32, and its own builder picks int32 past 65,500 ids)
  numpy     OUT/train.npy + OUT/train.csv.gz, OUT/val.npy + OUT/val.csv.gz: the ids as they are, no header (OLMo-core
            / Dolma's layout), and `start,end` token offsets of each document
  OUT/tokenizer.json in both, for data.tokenizer_path.

Shards are read through a memmap in chunks and written as streams: memory holds a chunk and the documents' lengths.
"""

import gzip
import shutil
import struct
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import numpy as np

from lit_pretrain.data.pretokenized import MEGATRON_MAGIC, SCAN_TOKENS
from lit_pretrain.data.shards import SPLITS, load_manifest, open_shard, verify_shards
from lit_pretrain.errors import DataError

FORMATS = ("megatron", "numpy")
MEGATRON_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def _chunks(folder: Path, manifest: Dict, split: str) -> Iterator[np.ndarray]:
    for shard in manifest["splits"][split]["shards"]:
        ids = open_shard(folder / shard["file"], manifest["dtype"])
        for start in range(0, len(ids), SCAN_TOKENS):
            yield np.asarray(ids[start: start + SCAN_TOKENS])


def _write_ids(folder: Path, manifest: Dict, split: str, path: Path, dtype: np.dtype) -> Tuple[int, np.ndarray]:
    """Write the split's ids to `path` as `dtype`; return (tokens, end offset of each document)."""
    eod, tokens, ends = manifest["tokenizer"]["eod_id"], 0, []
    with open(path, "xb") as f:
        for chunk in _chunks(folder, manifest, split):
            chunk.astype(dtype, copy=False).tofile(f)
            ends.append(np.flatnonzero(chunk == eod) + tokens + 1)
            tokens += len(chunk)
    ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    if tokens and (not len(ends) or ends[-1] != tokens):  # ids after the last EOD: one more (unended) document
        ends = np.append(ends, tokens)
    return tokens, ends.astype(np.int64)


def write_megatron_index(path: Path, dtype: np.dtype, doc_lengths: np.ndarray) -> None:
    """A Megatron .idx of one sequence per document (pretokenized.read_megatron's layout)."""
    lengths = doc_lengths.astype("<i4")
    pointers = (np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]) * dtype.itemsize).astype("<i8")
    with open(path, "xb") as f:
        f.write(MEGATRON_MAGIC + struct.pack("<QBQQ", 1, MEGATRON_CODES[dtype], len(lengths), len(lengths) + 1))
        f.write(lengths.tobytes())
        f.write(pointers[: len(lengths)].tobytes())
        f.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())


def export_data(prepared_dir, out, to: str) -> List[Path]:
    """Write PREPARED_DIR's splits into the folder OUT (new or empty) in format `to`; the files written."""
    if to not in FORMATS:
        raise DataError(f"export-data --to {to}: expected one of {', '.join(FORMATS)}")
    folder, out = Path(prepared_dir), Path(out)
    manifest = load_manifest(folder)
    verify_shards(folder, manifest)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} exists and is not an empty folder: give export-data a new folder")
    out.mkdir(parents=True, exist_ok=True)
    ours = np.dtype(manifest["dtype"])
    written = []
    for split in SPLITS:
        if to == "megatron":
            dtype = ours if ours == np.uint16 else np.dtype(np.int32)
            tokens, ends = _write_ids(folder, manifest, split, out / f"{split}.bin", dtype)
            write_megatron_index(out / f"{split}.idx", dtype, np.diff(ends, prepend=0))
            written += [out / f"{split}.bin", out / f"{split}.idx"]
        else:
            tokens, ends = _write_ids(folder, manifest, split, out / f"{split}.npy", ours)
            with gzip.open(out / f"{split}.csv.gz", "xt") as f:
                f.writelines(f"{s},{e}\n" for s, e in zip(np.concatenate([[0], ends[:-1]]).tolist(), ends.tolist()))
            written += [out / f"{split}.npy", out / f"{split}.csv.gz"]
    shutil.copyfile(folder / manifest["tokenizer"]["file"], out / "tokenizer.json")
    return [*written, out / "tokenizer.json"]
