"""Planted near-duplicate corpora: base documents and edited copies whose true Jaccard similarity is measured by
brute force over the same shingles the deduplication stage uses."""

import random
import string
from dataclasses import dataclass
from typing import List

from lit_pretrain.data.preparation.corpus import Document
from lit_pretrain.data.preparation.minhash import normalize, shingles


@dataclass(frozen=True)
class PlantedPair:
    base: int
    """Index of the original in the corpus (it comes first)."""
    copy: int
    """Index of the edited copy."""
    jaccard: float
    """Exact Jaccard similarity of their shingle sets."""
    edit: str


def vocabulary(rng: random.Random, size: int = 20_000) -> List[str]:
    # Random 3-9 letter words: two unrelated 300-word documents share almost no 5-word shingle.
    return ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(size)]


def edit(words: List[str], rate: float, kind: str, rng: random.Random, vocab: List[str]) -> List[str]:
    """An edited copy: `substitute` replaces, `insert` adds and `reorder` moves blocks of words, at about `rate`
    edits per word (reordering moves rate * len / 4 blocks of 4-40 words)."""
    out = list(words)
    n_edits = max(1, round(rate * len(words)))
    if kind == "substitute":
        for i in rng.sample(range(len(out)), min(n_edits, len(out))):
            out[i] = rng.choice(vocab)
    elif kind == "insert":
        for _ in range(n_edits):
            out.insert(rng.randrange(len(out) + 1), rng.choice(vocab))
    elif kind == "reorder":
        for _ in range(max(1, n_edits // 4)):
            length = rng.randint(4, 40)
            start = rng.randrange(max(1, len(out) - length))
            block, out = out[start : start + length], out[:start] + out[start + length :]
            at = rng.randrange(len(out) + 1)
            out = out[:at] + block + out[at:]
    else:
        raise ValueError(kind)
    return out


def jaccard(a: str, b: str, kind: str = "word", size: int = 5) -> float:
    """Exact Jaccard similarity of two texts' shingle sets, after the stage's default normalization."""
    sa = shingles(normalize(a, False, True), kind, size)
    sb = shingles(normalize(b, False, True), kind, size)
    return len(sa & sb) / len(sa | sb)


def planted_corpus(n_pairs: int = 400, n_singles: int = 100, seed: int = 0, words: int = 300):
    """(documents, pairs): n_pairs originals each followed later by one edited copy at an edit rate drawn so that
    true similarities spread over about 0.3-1.0, plus n_singles unrelated documents, in a shuffled order."""
    rng = random.Random(seed)
    vocab = vocabulary(rng)
    kinds = ("substitute", "insert", "reorder")
    units = []  # (text of original, text of copy or None, edit kind)
    for k in range(n_pairs):
        base = [rng.choice(vocab) for _ in range(words)]
        kind = kinds[k % 3]
        # Edit rates per kind that span similarities from ~0.3 to ~1.0 (reordering changes few shingles per edit).
        rate = rng.uniform(0.0, 0.045) if kind != "reorder" else rng.uniform(0.0, 0.3)
        units.append((" ".join(base), " ".join(edit(base, rate, kind, rng, vocab)), kind))
    for _ in range(n_singles):
        units.append((" ".join(rng.choice(vocab) for _ in range(words)), None, "single"))
    rng.shuffle(units)
    texts: List[str] = []
    pairs: List[PlantedPair] = []
    pending = []  # copies are placed a few documents after their original
    for original, copy, kind in units:
        texts.append(original)
        if copy is not None:
            pending.append((len(texts) - 1, copy, kind))
        if pending and rng.random() < 0.5:
            base, text, kind = pending.pop(0)
            pairs.append(PlantedPair(base, len(texts), jaccard(texts[base], text), kind))
            texts.append(text)
    for base, text, kind in pending:
        pairs.append(PlantedPair(base, len(texts), jaccard(texts[base], text), kind))
        texts.append(text)
    docs = [Document(id=f"doc{i:05d}", text=t) for i, t in enumerate(texts)]
    return docs, pairs
