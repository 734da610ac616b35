"""Which keys a query may attend to, as data the planners read without torch: the FLOP counter
(`flops_per_token_formula`, model/config.py) and the memory planner (planning/memory.py) ask a `MaskSpec`, and the
network turns the same terms into what SDPA takes (model/mask.py). A new attention pattern (a sliding window, sinks)
is one more field here and one more mask term there, and both counts follow.

Terms: causal always (a decoder); `documents`: attention stays inside each document of a window (document masking,
data.document_masking); `window`: a sliding window of that many keys (model.sliding_window, on the layers
`GPTConfig.attention_window` names: Beltagy et al. 2020, Longformer; Gemma 2/3's local layers).
"""

from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class MaskSpec:
    """The mask of one layer's attention over a window of T. documents: document masking (a (B, 1, T, T) boolean
    mask per forward); window: a sliding window of that many keys, its query's own included (None: none)."""

    documents: bool = False
    window: Optional[int] = None

    def binds(self, seq_len: int) -> bool:
        """Whether the sliding window cuts any key out of a window of seq_len: the last query (position T-1) sees
        key 0 exactly when window >= T, and a window that cuts nothing is full attention (masked and counted as one)."""
        return self.window is not None and self.window < seq_len

    def scored_keys(self, seq_len: int) -> int:
        """Keys per query the FLOP counter counts: the whole row of T, as PaLM appendix B counts the T×T score matrix
        although the causal mask needs half of it (and document masking less). With a binding window, the window's
        `window` (the keys of every query past the first window - 1; `scored_pairs` counts those exactly)."""
        return self.window if self.binds(seq_len) else seq_len

    def scored_pairs(self, seq_len: int) -> int:
        """(query, key) score pairs the FLOP counter counts over a window of T. Full attention: T·T, PaLM's whole
        matrix. A binding sliding window w: exactly the pairs the mask keeps, the query at position p (from 1) seeing
        min(w, p) keys, so sum_p min(w, p) = w(w+1)/2 + (T-w)·w: never more than the layer computes, so MFU
        over windowed layers is never above the truth (the overcount torchtitan's FLOP counter had, counting them
        as full layers). Its mean per query is below `scored_keys` only by the first w-1 queries' shortfall."""
        if not self.binds(seq_len):
            return seq_len * seq_len
        w = self.window
        return w * (w + 1) // 2 + (seq_len - w) * w

    def mask_bytes(self, seq_len: int, micro_batch: int = 1, context_parallel: int = 1,
                   bytes_per_element: float = 4.0, cuda: bool = False) -> float:
        """Bytes of the mask one forward builds and every layer reads (model/mask.py `sdpa_mask`):
        - plain causal, one process: none (SDPA's is_causal);
        - plain causal under context parallelism: on CUDA none (PyTorch's CausalBias), elsewhere one additive mask
          of the activation's dtype shared by both of a rank's chunks, T/(2c) queries over T keys;
        - documents: a boolean (B, 1, T/c, T) mask, 1 byte an element (c = 1: one process);
        - a binding sliding window without documents: a boolean (T/c, T) mask on every device (no fused kernel
          takes a window), made once and read by every window layer (model/mask.py caches it);
        - a binding sliding window with documents: the documents' mask with the window's term, (B, 1, T/c, T) again,
          made once per forward for the window layers beside the full layers' own."""
        c = context_parallel
        if self.documents:
            return float(micro_batch * (seq_len // c) * seq_len)
        if self.binds(seq_len):
            return float(seq_len // c * seq_len)
        if c == 1 or cuda:
            return 0.0
        return bytes_per_element * seq_len // (2 * c) * seq_len


def layers_mask_bytes(specs: Iterable[MaskSpec], seq_len: int, micro_batch: int = 1, context_parallel: int = 1,
                      bytes_per_element: float = 4.0, cuda: bool = False) -> float:
    """Bytes of the masks one forward holds for layers of these masks (`GPTConfig.mask_specs`): one per distinct
    mask (layers of one mask read one tensor), a window that cuts nothing being the full layers' mask."""
    distinct = {MaskSpec(s.documents, s.window if s.binds(seq_len) else None) for s in specs}
    return sum(s.mask_bytes(seq_len, micro_batch, context_parallel, bytes_per_element, cuda) for s in distinct)


CAUSAL = MaskSpec()
