"""Tokenize-to-shards: documents in corpus order → chunks of ~4 MB → ids (this process and worker processes) →
shard writers, in chunk order.

The shards are byte-identical for any number of processes: the chunks are cut from the document sequence alone,
each chunk's ids depend only on its texts and the tokenizer file, and results are written strictly in chunk order
(a result that arrives early waits, at most 2 per worker plus one). Workers are
lit_pretrain/data/preparation/workers.py's: fresh interpreters that load the tokenizer file once and never import the
caller's main module.

This module imports neither torch nor Lightning: it is what each worker loads.
"""

from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
from tokenizers import Tokenizer

from lit_pretrain.data.preparation.workers import WorkerPool
from lit_pretrain.data.shards import SPLITS, ShardWriter
from lit_pretrain.data.tokenizer import batch_encoder

# A batch encoding (encode_batch_fast, tokenizer.batch_encoder) parallelizes across the texts of one call (Rust
# threads); ~4 MB a chunk keeps the cores busy while holding only that chunk's ids in memory.
ENCODE_CHUNK_BYTES = 4 << 20
# One library call per chunk: cutting a 4 MB chunk into calls of 1 MB cost 3-15% of the encoding (each call ends
# with a tail where one thread waits for the other), while the Encoding objects of a whole chunk peak at ~90 MB
# (measured: 82 bytes a token with encode_batch_fast, 113 with encode_batch), freed before the next call.
_ENCODE_CALL_CHARS = ENCODE_CHUNK_BYTES
# A 4 MB chunk encodes in about a second; a worker silent for this long is gone.
_CHUNK_TIMEOUT_S = 600
_FIX = "set data.tokenize_workers=1 to tokenize in this process, or lower it if workers run out of memory"
TRAIN, VAL, COUNT = 0, 1, 2  # where a document's ids go: the train shards, the val shards, or only counted

_TOKENIZERS: Dict[str, Tokenizer] = {}  # per process: file -> tokenizer, loaded once


def _tokenizer(path: str) -> Tokenizer:
    if path not in _TOKENIZERS:
        tokenizer = Tokenizer.from_file(path)
        tokenizer.encode_special_tokens = True  # as tokenizer.load_tokenizer: a document's text never makes an EOD id
        _TOKENIZERS[path] = tokenizer
    return _TOKENIZERS[path]


def remember_tokenizer(path: str, tokenizer: Tokenizer) -> None:
    """Use this already loaded tokenizer for `path` in this process (it was loaded from that file)."""
    _TOKENIZERS[path] = tokenizer


def encode_chunk(task: Tuple[str, List[str], bytes, Optional[int], int, str]) -> Tuple[np.ndarray, np.ndarray]:
    """The unit of work: (tokenizer file, texts, their destinations, bos id or None, eos id, dtype) → (the ids of the
    texts not only counted, each as [bos] ids eos, concatenated; the length of every text so wrapped)."""
    path, texts, where, bos, eos, dtype = task
    encode = batch_encoder(_tokenizer(path))
    head = np.array([] if bos is None else [bos], dtype=dtype)
    tail = np.array([eos], dtype=dtype)
    parts: List[np.ndarray] = []
    lengths = np.empty(len(texts), dtype=np.int64)
    start = 0
    while start < len(texts):
        # Encoding objects take ~80-110 bytes a token (token strings, offsets, masks): a call of at most
        # _ENCODE_CALL_CHARS bounds them, and each call still spreads over the cores.
        end, size = start, 0
        while end < len(texts) and (size < _ENCODE_CALL_CHARS or end == start):
            size += len(texts[end])
            end += 1
        for k, enc in enumerate(encode(texts[start:end], add_special_tokens=False), start):
            ids = np.array(enc.ids, dtype=dtype)
            lengths[k] = len(ids) + len(head) + 1
            if where[k] != COUNT:
                parts += (head, ids, tail)
        start = end
    return (np.concatenate(parts) if parts else np.empty(0, dtype=dtype)), lengths


def chunks(docs: Iterable[Tuple[int, str, str]], max_bytes: Optional[int] = None
           ) -> Iterator[Tuple[List[str], bytes, str]]:
    """(texts, destinations, first id) of consecutive (destination, text, id) triples, about max_bytes characters a
    chunk (default ENCODE_CHUNK_BYTES)."""
    max_bytes = max_bytes if max_bytes is not None else ENCODE_CHUNK_BYTES
    texts: List[str] = []
    where = bytearray()
    size, first = 0, ""
    for dest, text, doc_id in docs:
        if not texts:
            first = doc_id
        texts.append(text)
        where.append(dest)
        size += len(text)
        if size >= max_bytes:
            yield texts, bytes(where), first
            texts, where, size = [], bytearray(), 0
    if texts:
        yield texts, bytes(where), first


def encode_in_order(pieces: Iterable[Tuple[List[str], bytes, str]], tokenizer_file: str, bos: Optional[int], eos: int,
                    dtype: str, processes: int) -> Iterator[Tuple[bytes, np.ndarray, np.ndarray]]:
    """(destinations, ids, lengths) of each chunk, in input order, encoded by this process and `processes` - 1
    workers."""
    if processes <= 1:
        for texts, where, _ in pieces:
            yield (where, *encode_chunk((tokenizer_file, texts, where, bos, eos, dtype)))
        return
    workers = processes - 1
    done: Dict[int, Tuple] = {}
    next_out = 0
    with WorkerPool("lit_pretrain.data.preparation.tokenize_stage:encode_chunk", workers, "tokenizer", _FIX,
                    timeout_s=_CHUNK_TIMEOUT_S) as pool:
        for index, (texts, where, first) in enumerate(pieces):
            task = (tokenizer_file, texts, where, bos, eos, dtype)
            if pool.pending < 2 * workers:
                pool.submit(index, task, repr(first))
                done[index] = (where, None)
            else:
                done[index] = (where, encode_chunk(task))
            for key, value in pool.ready():
                done[key] = (done[key][0], value)
            while next_out in done and done[next_out][1] is not None:
                where_out, (ids, lengths) = done.pop(next_out)
                yield where_out, ids, lengths
                next_out += 1
        for key, value in pool.drain():
            done[key] = (done[key][0], value)
        while next_out in done:
            where_out, (ids, lengths) = done.pop(next_out)
            yield where_out, ids, lengths
            next_out += 1


def write_encoded(cfg, tok_info: Dict, folder: Path, encoded: Iterable[Tuple[bytes, np.ndarray, np.ndarray]]):
    """Write (destinations, ids, lengths) of consecutive chunks of documents (tokenize_stage.encode_chunk's output,
    with the destinations), in order, into `folder`'s shards: write_shards' second half, shared with the Ray engine
    so that both write the same bytes from the same ids."""
    dtype = np.dtype(tok_info["dtype"])
    writers = [ShardWriter(folder, split, cfg.shard_tokens, dtype, tok_info["vocab_size"]) for split in SPLITS]
    removed_tokens = 0
    for where, flat, lengths in encoded:
        dest = np.frombuffer(where, dtype=np.uint8)
        removed_tokens += int(lengths[dest == COUNT].sum())
        kept = lengths[dest != COUNT]
        pieces = np.split(flat, np.cumsum(kept)[:-1]) if len(kept) else []
        kept_dest = dest[dest != COUNT]
        for split in (TRAIN, VAL):
            writers[split].write([p for p, d in zip(pieces, kept_dest) if d == split])
    splits = {split: writers[k].close() for k, split in enumerate(SPLITS)}
    return splits, writers[TRAIN].counts, removed_tokens
