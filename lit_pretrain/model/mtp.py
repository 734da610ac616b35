"""Multi-token prediction (DeepSeek-V3, DeepSeek-AI 2024, §2.2; Gloeckle et al. 2024 for parallel heads): D
sequential modules after the last block, the k-th (k = 1..D) predicting token t+1+k at every position t.

Module k (eq. 21-23): h'_t = M_k [RMSNorm(h^{k-1}_t); RMSNorm(Emb(x_{t+k}))], M_k of shape (d, 2d), h^0 the last
block's output; h^k = TRM_k(h') one transformer block (causal, under the same document mask and RoPE positions as
the main blocks); logits = OutHead(RMSNorm_k(h^k)) with the model's own embedding and head (shared, not copied).
The loss (eq. 24-25): λ/D Σ_k CE_k, each CE_k the mean over the targets module k predicts. The modules are trained
only: generation and HF export use the main head, and the next-token loss stays what train/loss reports.

Kept apart from model/gpt.py (which builds them from the table, `GPTConfig.mtp_modules`): the module and the
targets of each depth are here; the loss path (parallel/batch_losses.py) adds their losses.
"""

from typing import Optional, Tuple

import torch
from torch import nn

from lit_pretrain.model.losses import IGNORE_INDEX


class MTPModule(nn.Module):
    """One depth: hnorm, enorm, proj, block, norm (the table's names under `mtp.{k}.`)."""

    def __init__(self, hnorm: nn.Module, enorm: nn.Module, proj: nn.Module, block: nn.Module, norm: nn.Module):
        super().__init__()
        self.hnorm, self.enorm, self.proj, self.block, self.norm = hnorm, enorm, proj, block, norm

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """h^k (B, T, d_model) from h^{k-1} (B, T, d_model) and the embeddings of the tokens k ahead (B, T, d_model)."""
        x = self.proj(torch.cat([self.hnorm(h), self.enorm(emb)], dim=-1))  # (B, T, 2·d_model) -> (B, T, d_model)
        return self.block(x, cos, sin, mask)  # (B, T, d_model)


def mtp_tokens(x: Optional[torch.Tensor], y: torch.Tensor, k: int, eod_id: Optional[int] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of depth k >= 1, each (B, T), from a window's inputs x and next-token targets y (B, T),
    y before any masking (it may hold IGNORE_INDEX where nothing is to be predicted, padding); x is read only with
    eod_id (a pipeline's last stage, which has no document masking, has the targets alone).

    At position t the module reads token x_{t+k} = y_{t+k-1} and predicts x_{t+k+1} = y_{t+k}; past the window's end
    (t > T-1-k) there is no target (IGNORE_INDEX) and the input is token 0 (its prediction is never scored, and a
    causal block lets no earlier position read it). With document masking (eod_id) a target is kept only inside
    the document of position t: the tokens x_t .. x_{t+k+1} lie in one document (an EOD belongs to the document it
    ends, as model/losses.py `loss_targets` counts for k = 0), so nothing is predicted across a document end."""
    T = y.shape[1]
    inputs = torch.zeros_like(y)
    inputs[:, :T - k + 1] = y[:, k - 1:]  # (B, T): x_{t+k} where it exists
    inputs = inputs.masked_fill(inputs == IGNORE_INDEX, 0)
    targets = torch.full_like(y, IGNORE_INDEX)
    targets[:, :T - k] = y[:, k:]  # (B, T): x_{t+k+1} where it exists
    if eod_id is not None:
        ends = (torch.cat([x, y[:, -1:]], dim=1) == eod_id).long()  # (B, T+1): x_0 .. x_T
        docs = ends.cumsum(1) - ends  # (B, T+1): model/gpt.py document_ids' numbering, an EOD in the one it ends
        inside = docs[:, k + 1:] == docs[:, :T - k]  # (B, T-k): x_{t+k+1} in the document of x_t
        targets[:, :T - k] = targets[:, :T - k].masked_fill(~inside, IGNORE_INDEX)
    return inputs, targets
