"""Best-fit packing (data.packing=best_fit): documents placed whole into windows of seq_len + 1 tokens where they fit.

Concatenation (data.packing=concat, datamodule.ShardWindows) reads windows at a fixed stride, so almost every
document longer than a few tokens is cut at a window edge and its second part is read without its beginning. Ding
et al. 2024 ("Fewer Truncations Improve Language Modeling", section 3) pack documents by best-fit-decreasing
instead, which cuts only the documents that cannot fit and the few needed to fill the rest; OLMo-core's packing
and nanochat's loader do the same over a bounded buffer.

Here, as in nanochat's loader: a buffer holds up to data.packing_buffer documents (pieces) in corpus order. Each
window is filled in turn: the longest buffered piece that fits the space left goes in whole (best fit, longest
first) and its slot refills from the corpus; when none fits, the longest piece is cut to fill the window exactly and
its remainder stays in the buffer, starting at the cut piece's last token (so, as with concat's windows that share
a token, every next-token target of the document is trained once). So no window holds padding: every position is a
real token and a target of the loss, `tokens_seen` keeps counting windows × seq_len, and the loss path is
concatenation's. Documents longer than a window are cut as concatenation cuts them. The corpus tail that does not
fill a last window is not trained on (concatenation drops each shard's tail too).

The packing is a pure function of the split's documents, seq_len and the buffer: not of the seed, the layout or
the step, so the windows are the same on every rank and on every resume; the seeded shuffle permutes them after.
Documents are found by the end-of-document id, as document masking finds them.
"""

import bisect
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from lit_pretrain.data.shards import open_shard

_AGE_BITS = 40  # a buffer key: length << 40 | (2^40 - 1 - arrival), so equal lengths leave in arrival order


def best_fit(lengths: Sequence[int], capacity: int, buffer: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                           np.ndarray]:
    """Windows of `capacity` tokens packed from documents of `lengths` (module docstring).

    Returns (window_offsets, piece_document, piece_offset, piece_length): window w holds pieces
    window_offsets[w] .. window_offsets[w + 1] - 1 in that order, piece p being tokens piece_offset[p] ..
    piece_offset[p] + piece_length[p] - 1 of document piece_document[p]. Every window holds exactly `capacity`
    tokens."""
    if capacity < 2 or buffer < 1:
        raise ValueError(f"capacity {capacity} must be at least 2 and buffer {buffer} at least 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    keys: List[int] = []  # sorted buffer keys
    pieces: Dict[int, Tuple[int, int, int]] = {}  # key → (document, offset, length)
    age_max = (1 << _AGE_BITS) - 1
    next_doc = 0
    offsets, docs, starts, lens = [0], [], [], []

    def refill() -> None:
        nonlocal next_doc
        while len(keys) < buffer and next_doc < len(lengths):
            n = int(lengths[next_doc])
            if n > 0:
                key = (n << _AGE_BITS) | (age_max - next_doc)
                bisect.insort(keys, key)
                pieces[key] = (next_doc, 0, n)
            next_doc += 1

    refill()
    while keys:
        space, placed = capacity, len(docs)
        while space > 0 and keys:
            i = bisect.bisect_right(keys, (space << _AGE_BITS) | age_max) - 1
            if i >= 0:  # the longest piece that fits goes in whole
                key = keys.pop(i)
                doc, start, n = pieces.pop(key)
                refill()
            else:  # none fits: the longest is cut to fill the window; its remainder restarts at the cut's last token
                key = keys.pop()
                doc, start, n = pieces.pop(key)
                if space > 1:
                    rest = n - space + 1
                    new_key = (rest << _AGE_BITS) | (key & age_max)
                    bisect.insort(keys, new_key)
                    pieces[new_key] = (doc, start + space - 1, rest)
                else:  # one slot, a target only: the piece's first token fills it and the piece stays whole
                    bisect.insort(keys, key)
                    pieces[key] = (doc, start, n)
                n = space
            docs.append(doc)
            starts.append(start)
            lens.append(n)
            space -= n
        if space > 0:  # the corpus ran out: the partial last window is not trained on
            del docs[placed:], starts[placed:], lens[placed:]
            break
        offsets.append(len(docs))
    return (np.asarray(offsets, dtype=np.int64), np.asarray(docs, dtype=np.int64),
            np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64))


def document_spans(ids: np.ndarray, eod_id: int) -> Tuple[np.ndarray, np.ndarray]:
    """(start, length) of each document of one shard's ids: each ends at an end-of-document id (a tail without one,
    as a pretokenized file may end, is a document too)."""
    ends = np.flatnonzero(ids == eod_id) + 1
    if len(ids) and (len(ends) == 0 or ends[-1] != len(ids)):
        ends = np.append(ends, len(ids))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return starts, (ends - starts).astype(np.int64)


def packing_stats(lengths: np.ndarray, capacity: int, piece_document: np.ndarray, piece_length: np.ndarray,
                  window_offsets: np.ndarray) -> Dict[str, float]:
    """What a packing did to a split: documents, the share of them cut (their tokens in two or more windows; a
    document longer than a window always is), the share of window positions that are padding (none: module
    docstring) and the share of the split's tokens in no window (the tail)."""
    # Each further piece of a document shares one token with the piece before it (a cut piece's last token, or the
    # one-token filler of a window's last slot), so a document's tokens placed are its pieces' minus the shares.
    pieces = np.bincount(piece_document, minlength=len(lengths))
    real = np.bincount(piece_document[piece_length > 1], minlength=len(lengths))  # the one-token filler cuts nothing
    placed = int(piece_length.sum() - (pieces[pieces > 1] - 1).sum())
    total, documents = int(lengths.sum()), int((lengths > 0).sum())
    return {"documents": documents, "windows": len(window_offsets) - 1,
            "documents_cut": float((real > 1).sum() / max(1, documents)),
            "padding": 0.0, "tokens_dropped": float(max(0, total - placed) / max(1, total))}


def concat_stats(shard_lengths: Sequence[np.ndarray], seq_len: int) -> Dict[str, float]:
    """The same figures for concatenation (datamodule.ShardWindows: in each shard, windows of seq_len + 1 tokens at
    stride seq_len, the shard's tail dropped), from the document lengths of each shard. Window w covers tokens
    [w·seq_len, (w+1)·seq_len], sharing its last token with the next, so a document of tokens [s, e) is cut when an
    edge k·seq_len lies in [s + 1, e - 2] (an edge on its last token cuts no target from it); the shard's last
    window ends at token `last`, so a document begun before it and ending after it is cut too."""
    documents = cut = total = covered = windows = 0
    for lengths in shard_lengths:
        ends = np.cumsum(lengths)
        starts = ends - lengths
        tokens = int(ends[-1]) if len(ends) else 0
        count = max(0, (tokens - 1) // seq_len)
        last = count * seq_len  # the last token any window of the shard reads
        first_edge = (starts // seq_len + 1) * seq_len
        cut += int(((starts < last) & (first_edge <= ends - 2)).sum())
        documents += int((lengths > 0).sum())
        windows, total, covered = windows + count, total + tokens, covered + (last + 1 if count else 0)
    return {"documents": documents, "windows": windows, "documents_cut": cut / max(1, documents), "padding": 0.0,
            "tokens_dropped": (total - covered) / max(1, total)}


class PackedWindows(Dataset):
    """The packed windows of one split's shards: ShardWindows' interface (len, (x, y) of seq_len tokens each), the
    windows built at construction from the documents of every shard as one stream (a window may hold documents of
    two shards). `shards`: the manifest entries (a span of another format's file has "offset" and "dtype")."""

    def __init__(self, folder, shards: List[Dict], dtype: str, seq_len: int, eod_id: int, buffer: int):
        self.paths = [str(Path(folder) / s["file"]) for s in shards]
        self.spans = [(s.get("offset", 0), s["tokens"], s.get("dtype", dtype)) for s in shards]
        self.seq_len = seq_len
        spans = [document_spans(self._map(k), eod_id) for k in range(len(shards))]
        self._maps: Dict[int, np.ndarray] = {}  # opened again on first use in each process (pickles small)
        shard_of = np.concatenate([np.full(len(st), k) for k, (st, _) in enumerate(spans)] or [[]]).astype(np.int64)
        start_of = np.concatenate([st for st, _ in spans] or [[]]).astype(np.int64)
        self.shard_lengths = [n for _, n in spans]
        lengths = np.concatenate(self.shard_lengths or [[]]).astype(np.int64)
        offsets, doc, offset, length = best_fit(lengths, seq_len + 1, buffer)
        self.window_offsets, self.piece_length = offsets, length
        self.piece_shard, self.piece_start = shard_of[doc], start_of[doc] + offset
        self.stats = packing_stats(lengths, seq_len + 1, doc, length, offsets)

    def _map(self, k: int) -> np.ndarray:
        byte_offset, tokens, dtype = self.spans[k]
        return open_shard(self.paths[k], dtype, byte_offset, tokens)

    def __len__(self) -> int:
        return len(self.window_offsets) - 1

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        parts = []
        for p in range(self.window_offsets[index], self.window_offsets[index + 1]):
            k = int(self.piece_shard[p])
            if k not in self._maps:
                self._maps[k] = self._map(k)
            start = int(self.piece_start[p])
            parts.append(self._maps[k][start : start + int(self.piece_length[p])])
        window = torch.from_numpy(np.concatenate(parts).astype(np.int64))
        return window[:-1], window[1:]  # (T,) inputs, (T,) next-token targets

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}


def packing_report(windows: PackedWindows, buffer: int) -> str:
    """One line comparing concat's cuts with best_fit's on one train split (`lit-pretrain prepare`, train's start)."""
    concat, packed = concat_stats(windows.shard_lengths, windows.seq_len), windows.stats
    return (f"packing at model.seq_len={windows.seq_len} over {packed['documents']:,} train documents: concat cuts "
            f"{concat['documents_cut']:.1%} of them, best_fit (data.packing_buffer={buffer}) "
            f"{packed['documents_cut']:.1%}; padding 0% either way; tokens in no window: concat "
            f"{concat['tokens_dropped']:.2%}, best_fit {packed['tokens_dropped']:.2%} ({concat['windows']:,} and "
            f"{packed['windows']:,} windows)")


def prepare_report(folder, manifest: Dict, seq_len: int, buffer: int) -> str:
    """packing_report() for a prepared (or pretokenized) corpus's train split."""
    train, eod = manifest["splits"]["train"]["shards"], manifest["tokenizer"]["eod_id"]
    return packing_report(PackedWindows(folder, train, manifest["dtype"], seq_len, eod, buffer), buffer)
