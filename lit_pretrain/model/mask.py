"""The one place attention masks are made: a `Mask` says which keys each query may see, `sdpa_mask` turns it into
what `F.scaled_dot_product_attention` takes. Every attention path asks it: the GPT's training forward, the KV
cache's decoding, context parallelism's chunks (parallel/context.py) and the pipeline stages (which call the blocks).

The terms are mask functions of (query position, key position), composed with `and_masks` as torchtitan composes
its `mask_mod`s (models/common/attention.py): `causal`, `same_document`, `sliding_window` (a query sees its own and
the window - 1 keys before it: Beltagy et al. 2020, Longformer §3.1; Mistral 7B; Gemma 2/3's local layers). The
planners read the same terms as data, without torch (model/mask_spec.py).

What SDPA gets, cheapest first:
- plain causal with as many queries as keys, aligned at the top left: no mask, `is_causal=True` (the fused kernel's
  own triangle: the training forward's speed);
- one query after every key (a decoding step): no mask at all;
- causal with fewer queries than keys, ending at the last key (the KV cache's chunks, context parallelism's
  chunks): on CUDA PyTorch's `causal_lower_right` bias, which the flash and memory-efficient kernels apply without a
  mask in memory; elsewhere a boolean mask, or, with `shared_width`, an additive mask cut from one made once for the
  window (every layer and both of a context-parallel rank's chunks read it, as `MaskSpec.mask_bytes` counts);
- anything else (documents, scattered query positions, a window shorter than the keys a query could see): the
  composed boolean mask, (B, 1, Tq, S) or (Tq, S); a window's without documents is made once and cached, so every
  window layer of a forward, and the next forward, read the same tensor (`MaskSpec.mask_bytes`).
Boolean and additive masks give bitwise the same SDPA outputs and gradients on CPU (SDPA turns a boolean mask into
the additive one).
"""

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import torch

MaskFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (queries (Tq, 1), keys (1, S)) -> allowed


@dataclass(frozen=True)
class Mask:
    """Which keys each query may attend to: causal, and

    documents: (B, S) the document of every key position (`document_ids`), or None: one sequence per row.
    queries: where the queries sit among the keys: an offset (queries at offset .. offset + Tq - 1; 0 in training,
    the cached length in decoding) or (Tq,) their positions (context parallelism's chunks of a window).
    window: a sliding window of that many keys (the query's own included, as transformers' sliding_window counts),
    or None: every key before the query (model.sliding_window, on the layers `GPTConfig.attention_window` names)."""

    documents: Optional[torch.Tensor] = None
    queries: Union[int, torch.Tensor] = 0
    window: Optional[int] = None


CAUSAL = Mask()


class SdpaMask(NamedTuple):
    """The `attn_mask` and `is_causal` arguments of one SDPA call."""

    attn_mask: Optional[torch.Tensor]
    is_causal: bool


def causal(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A query sees its own position and the ones before it."""
    return k <= q


def same_document(documents: torch.Tensor, queries: torch.Tensor) -> MaskFn:
    """A query sees the keys of its own document; documents (B, S), queries (Tq,) the queries' positions."""
    rows = documents[:, queries]  # (B, Tq)

    def fn(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return rows[:, :, None] == documents[:, None, :]  # (B, Tq, S)

    return fn


def sliding_window(window: int) -> MaskFn:
    """A query sees the `window` most recent keys, its own included: q - window < k (with `causal`, k <= q)."""

    def fn(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q - k < window

    return fn


def and_masks(*fns: MaskFn) -> MaskFn:
    """Allowed where every term allows."""

    def fn(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        out = fns[0](q, k)
        for f in fns[1:]:
            out = out & f(q, k)
        return out

    return fn


def sdpa_mask(mask: Mask, n_queries: int, n_keys: int, like: torch.Tensor,
              shared_width: Optional[int] = None) -> SdpaMask:
    """What SDPA takes for `mask` over n_queries queries and n_keys keys, on `like`'s device (and, for an additive
    mask, in its dtype). shared_width: the keys of the whole window when several calls read masks of one window
    (context parallelism): off CUDA their additive masks are cut from one of that width (see the module's notes)."""
    device = like.device
    offset = mask.queries if isinstance(mask.queries, int) else None
    window = mask.window
    if window is not None and offset is not None and window >= offset + n_queries:
        window = None  # the last query, at offset + Tq - 1, sees key 0 already: the window cuts nothing
    if mask.documents is None and offset is not None and offset + n_queries == n_keys and window is None:
        if offset == 0:
            return SdpaMask(None, True)  # top-left and bottom-right alignments coincide
        if n_queries == 1:
            return SdpaMask(None, False)  # the last query sees every key
        if device.type == "cuda":
            from torch.nn.attention.bias import causal_lower_right

            return SdpaMask(causal_lower_right(n_queries, n_keys), False)
        if shared_width is not None:
            whole = _lower_right_additive(n_queries, shared_width, like.dtype, device)  # (Tq, width)
            return SdpaMask(whole[:, shared_width - n_keys:], False)  # its last n_keys columns: (Tq, S)
    if mask.documents is None and offset is not None and window is not None:
        return SdpaMask(_window_boolean(offset, n_queries, n_keys, window, device), False)  # (Tq, S), cached
    queries = torch.arange(offset, offset + n_queries, device=device) if offset is not None else mask.queries
    return SdpaMask(_composed(mask.documents, queries, n_keys, window), False)


def _composed(documents: Optional[torch.Tensor], queries: torch.Tensor, n_keys: int,
              window: Optional[int]) -> torch.Tensor:
    """The boolean mask of the terms: (Tq, S), or (B, 1, Tq, S) with documents (broadcast over heads)."""
    keys = torch.arange(n_keys, device=queries.device)
    terms = [causal] if documents is None else [causal, same_document(documents, queries)]
    if window is not None:
        terms.append(sliding_window(window))
    allowed = and_masks(*terms)(queries[:, None], keys[None, :])  # (Tq, S) or (B, Tq, S)
    return allowed if documents is None else allowed[:, None]


@functools.lru_cache(maxsize=8)
def _window_boolean(offset: int, n_queries: int, n_keys: int, window: int, device: torch.device) -> torch.Tensor:
    """The causal sliding-window mask of queries offset .. offset + Tq - 1 over n_keys keys, (Tq, S) bool, made once:
    every window layer and every step read this one tensor. Read-only: SDPA only reads it."""
    with torch.inference_mode(False):  # kept across steps: one made under validation's inference mode must train
        queries = torch.arange(offset, offset + n_queries, device=device)
        return _composed(None, queries, n_keys, window)


@functools.lru_cache(maxsize=4)
def _lower_right_additive(n_queries: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 where query i of n_queries ending at key `width` may look (key j <= width - n_queries + i), -inf elsewhere:
    (n_queries, width). Its last S columns are the same mask for keys ending at S. Read-only: SDPA only reads it."""
    with torch.inference_mode(False):  # kept across steps: one made under validation's inference mode must train
        allowed = torch.ones(n_queries, width, dtype=torch.bool, device=device).tril(width - n_queries)
        return torch.zeros(n_queries, width, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def with_sinks(sdpa: SdpaMask, sinks: torch.Tensor, n_queries: int, n_keys: int, like: torch.Tensor) -> torch.Tensor:
    """model.attention_sinks: the additive mask (B or 1, H, Tq, S + 1) of `sdpa` (any of the forms above) with one
    more key column whose score is each head's sink logit (sinks (H,): this rank's heads). The caller appends a
    zero key and a zero value as key S (`attend`): q·0 = 0, so that key's logit is the mask's entry alone, and it
    adds exp(sink) to every query's softmax denominator and nothing to its output, as GPT-OSS's eager attention
    concatenates the sink to the scores. Every query row sits in one SDPA call over all the keys it may see (also
    under context parallelism, whose ranks gather the whole window's keys), so the sink joins each softmax once.
    The mask is floating point and per head, and its gradient flows to the sinks: SDPA takes its math path (no
    fused kernel on CPU), which the step cost and the memory planner count (docs/model.md, "Attention sinks")."""
    mask, device = sdpa.attn_mask, like.device
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        additive = mask  # (Tq, S): context parallelism's shared lower-right mask
    else:
        if mask is None:  # is_causal: the top-left triangle; else every key
            allowed = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
            allowed = allowed.tril() if sdpa.is_causal else allowed
        elif isinstance(mask, torch.Tensor):
            allowed = mask  # (Tq, S) or (B, 1, Tq, S) bool
        else:  # CUDA's causal_lower_right bias: the triangle aligned to the last key
            allowed = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(n_keys - n_queries)
        additive = torch.zeros(allowed.shape, dtype=like.dtype, device=device).masked_fill_(~allowed, float("-inf"))
    additive = additive.reshape((1,) * (4 - additive.dim()) + tuple(additive.shape))  # (B or 1, 1, Tq, S)
    rows, heads = additive.shape[0], sinks.shape[0]
    sink = sinks.to(like.dtype).view(1, heads, 1, 1).expand(rows, heads, n_queries, 1)  # (B or 1, H, Tq, 1)
    return torch.cat([additive.expand(rows, heads, n_queries, n_keys), sink], dim=-1)  # (B or 1, H, Tq, S + 1)
