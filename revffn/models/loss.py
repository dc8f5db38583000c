"""Causal-LM loss without materialising (tokens x vocab) fp32 logits.

The head and the cross-entropy run on chunks of `chunk_tokens` rows; each chunk is checkpointed,
so backward recomputes its logits instead of keeping them. Peak extra memory is one chunk's
logits, not the whole batch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # (n, V), fp32 only for this chunk
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def causal_lm_loss(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                   chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and the number of predicted tokens.

    Args:
        hidden: (B, T, d) final hidden states (after the final norm).
        head: the LM head.
        labels: (B, T) token ids, IGNORE_INDEX where no loss is taken; shifted here.
    Returns:
        (loss_sum, n_tokens): divide to get the mean; keep them apart for gradient accumulation.
    """
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1)
    n_tokens = (y != IGNORE_INDEX).sum()
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        hs, ys = h[start : start + chunk_tokens], y[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, hs, head.weight, head.bias, ys, use_reentrant=False)
        else:
            total = total + _chunk_loss(hs, head.weight, head.bias, ys)
    return total, n_tokens
