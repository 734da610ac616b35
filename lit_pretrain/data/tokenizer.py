"""Byte-level BPE (GPT-2's scheme, Radford et al. 2019, section 2.2) trained with `tokenizers`.

Every byte is in the initial alphabet, so any UTF-8 text encodes without unknown tokens and decodes back exactly.
The end-of-document token (data.eos_token, EOD by default) ends every document in the token shards; an optional
beginning-of-document token (data.bos_token) starts each. Any Hugging Face tokenizer.json can be loaded instead
(data.tokenizer_path), as long as it holds the tokens named.
"""

import hashlib
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lit_pretrain.errors import DataError

EOD = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = (EOD,)) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens (fewer when the texts have fewer merges to learn);
    the special tokens take the first ids."""
    texts = list(texts)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    _treat_special_tokens_as_text(tokenizer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path) -> None:
    tokenizer.save(str(path))


def load_tokenizer(path, eos_token: Optional[str] = EOD, bos_token: Optional[str] = None) -> Tokenizer:
    """A tokenizer.json that holds `eos_token` (data.eos_token) and `bos_token` (data.bos_token) where given."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist: fix data.tokenizer_path, or unset it to train one")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"{path} is not a tokenizers tokenizer.json ({e}): point data.tokenizer_path at one") from None
    for key, token, what in (("data.eos_token", eos_token, "end-of-document"),
                             ("data.bos_token", bos_token, "beginning-of-document")):
        if token is not None and tokenizer.token_to_id(token) is None:
            raise DataError(
                f"{path} has no {what} token {key}={token!r}: set {key} to a token of its vocabulary (e.g. "
                "<|end_of_text|> for Llama 3), use a tokenizer that has it, or unset data.tokenizer_path to train one"
            )
    _treat_special_tokens_as_text(tokenizer)
    return tokenizer


def tokenizer_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def eod_id(tokenizer: Tokenizer, eos_token: str = EOD) -> int:
    return tokenizer.token_to_id(eos_token)


def batch_encoder(tokenizer: Tokenizer) -> Callable:
    """The tokenizer's fastest batch encoding that gives the ids: `encode_batch_fast` where the installed tokenizers
    has it (it skips the character offsets, which we never read: encode_batch ran at 0.74 of its speed),
    else `encode_batch`. Same ids either way; call it with add_special_tokens=False."""
    return getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch


def encode_texts(tokenizer: Tokenizer, texts: List[str]) -> List[List[int]]:
    """Ids of each text, no special tokens added; the batch is encoded on all cores (Rust threads)."""
    return [enc.ids for enc in batch_encoder(tokenizer)(texts, add_special_tokens=False)]


def token_byte_lengths(tokenizer: Tokenizer) -> Optional[np.ndarray]:
    """UTF-8 bytes of text each token id stands for, indexed by id (int64); None for a tokenizer that is not byte-level.

    In a byte-level BPE every vocabulary entry is a string over GPT-2's 256-character byte alphabet, one character per
    byte, so a token's byte count is its length, and the bytes of any id sequence are the sum over its ids. This is
    exact where decoding is not: a window cut inside a multi-byte character decodes to U+FFFD (3 bytes). Special
    tokens (EOD) stand for no text: 0 bytes. Another kind of tokenizer (data.tokenizer_path) gives None.
    """
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    added = tokenizer.get_added_tokens_decoder()  # id -> AddedToken, written as plain text, not byte characters
    out = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if index in added:
            out[index] = 0 if added[index].special else len(added[index].content.encode("utf-8"))
        elif alphabet.issuperset(token):
            out[index] = len(token)
        else:
            return None
    return out


def _treat_special_tokens_as_text(tokenizer: Tokenizer) -> None:
    # A document that contains the literal string "<|endoftext|>" must not produce an EOD id: EOD ids are where
    # documents end in the shards. The flag is not saved in tokenizer.json, so it is set on every load.
    tokenizer.encode_special_tokens = True
