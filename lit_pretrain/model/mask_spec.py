"""Which keys a query may attend to, as data the planners read without torch: the FLOP counter
(`flops_per_token_formula`, model/config.py) and the memory planner (planning/memory.py) ask a `MaskSpec`, and the
network turns the same terms into what SDPA takes (model/mask.py). A new attention pattern (a sliding window, sinks)
is one more field here and one more mask term there, and both counts follow.

Terms: causal always (a decoder); `documents`: attention stays inside each document of a window (document masking,
data.document_masking).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class MaskSpec:
    """The mask of one window's attention. documents: document masking (a (B, 1, T, T) boolean mask per forward)."""

    documents: bool = False

    def scored_keys(self, seq_len: int) -> int:
        """Keys per query the FLOP counter counts: the whole row of T, as PaLM appendix B counts the T×T score matrix
        although the causal mask needs half of it (and document masking less)."""
        return seq_len

    def mask_bytes(self, seq_len: int, micro_batch: int = 1, context_parallel: int = 1,
                   bytes_per_element: float = 4.0, cuda: bool = False) -> float:
        """Bytes of the mask one forward builds and every layer reads (model/mask.py `sdpa_mask`):
        - plain causal, one process: none (SDPA's is_causal);
        - plain causal under context parallelism: on CUDA none (PyTorch's CausalBias), elsewhere one additive mask
          of the activation's dtype shared by both of a rank's chunks, T/(2c) queries over T keys;
        - documents: a boolean (B, 1, T/c, T) mask, 1 byte an element (c = 1: one process)."""
        c = context_parallel
        if self.documents:
            return float(micro_batch * (seq_len // c) * seq_len)
        if c == 1 or cuda:
            return 0.0
        return bytes_per_element * seq_len // (2 * c) * seq_len


CAUSAL = MaskSpec()
