"""Losses: the causal-LM loss without materialising (tokens x vocab) fp32 logits, and the router
load-balancing loss (`SwitchAux`).

The head and the cross-entropy run on chunks of `chunk_tokens` rows; each chunk is checkpointed,
so backward recomputes its logits instead of keeping them. Peak extra memory is one chunk's
logits, not the whole batch's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
CHUNK_TOKENS = 1024  # rows of (hidden -> logits -> loss) at a time; shared by every model wrapper


def head_logits(hidden: torch.Tensor, head: torch.nn.Linear, scale: float = 1.0,
                softcap: float | None = None) -> torch.Tensor:
    """The LM head's logits, scaled (granite's 1 / `logits_scaling`, cohere's `logit_scale`) and
    soft-capped (softcap * tanh(logits / softcap)) where the architecture does so."""
    logits = head(hidden)
    if scale != 1.0:
        logits = logits * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias, labels: torch.Tensor, scale: float = 1.0,
                softcap: float | None = None) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # (n, V), fp32 only for this chunk
    if scale != 1.0:
        logits = logits * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def causal_lm_loss(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                   chunk_tokens: int = CHUNK_TOKENS, scale: float = 1.0,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and the number of predicted tokens.

    Args:
        hidden: (B, T, d) final hidden states (after the final norm).
        head: the LM head.
        labels: (B, T) token ids, IGNORE_INDEX where no loss is taken; shifted here.
        scale, softcap: the architecture's logit scaling and soft-capping (see `head_logits`).
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
            total = total + checkpoint(_chunk_loss, hs, head.weight, head.bias, ys, scale, softcap,
                                       use_reentrant=False)
        else:
            total = total + _chunk_loss(hs, head.weight, head.bias, ys, scale, softcap)
    return total, n_tokens


@dataclass
class SwitchAux:
    """HF's `load_balancing_loss_func` (Switch Transformer), accumulated one layer at a time.

    aux = E * sum_e (T_e / R) * (P_e / R), with T_e the top-k assignments to expert e and P_e the
    summed router probabilities, both over all MoE layers and (unpadded) tokens, R the row count.
    T is not differentiable, so d aux / d probs_l[t, e] = E * T_e / R**2 * mask_t for every layer
    l: the reversible backward can apply it layer by layer (`surrogate`).
    """

    num_experts: int
    top_k: int
    row_mask: torch.Tensor | None = None  # (N,) float, 1 for real tokens
    tokens: torch.Tensor | None = field(default=None, repr=False)
    probs: torch.Tensor | None = field(default=None, repr=False)
    rows: torch.Tensor | float = 0.0
    differentiable: bool = True  # False: the router is frozen, the loss is only logged

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float(), dim=-1)

    def add(self, logits: torch.Tensor) -> None:
        probs = self._probs(logits)
        with torch.no_grad():
            chosen = torch.topk(probs, self.top_k, dim=-1).indices.reshape(-1)
            weights = None if self.row_mask is None else self.row_mask.repeat_interleave(self.top_k)
            counts = torch.zeros(self.num_experts, device=probs.device).index_add_(
                0, chosen, torch.ones_like(chosen, dtype=torch.float) if weights is None else weights
            )
        mass = probs if self.row_mask is None else probs * self.row_mask[:, None]
        mass = mass.sum(0)
        n = probs.shape[0] if self.row_mask is None else self.row_mask.sum()
        self.tokens = counts if self.tokens is None else self.tokens + counts
        self.probs = mass if self.probs is None else self.probs + mass
        self.rows = self.rows + n

    def tensors(self) -> list:
        rows = self.rows if isinstance(self.rows, torch.Tensor) else torch.tensor(float(self.rows))
        return [self.tokens, rows, self.row_mask]

    def with_tensors(self, tensors: list) -> SwitchAux:
        tokens, rows, row_mask = tensors
        return SwitchAux(self.num_experts, self.top_k, row_mask, tokens, None, rows, self.differentiable)

    def for_rows(self, rows: slice) -> SwitchAux:
        """This accumulator as a recomputation on the token rows `rows` alone sees it (the reversible
        backward's chunked G): the row mask sliced to them, the totals (`tokens`, `rows`) still the
        whole batch's, so `surrogate` on each chunk's logits adds up to the surrogate on the whole."""
        return replace(self, row_mask=None if self.row_mask is None else self.row_mask[rows])

    def value(self) -> torch.Tensor:
        if self.tokens is None:
            return torch.zeros(())
        return self.num_experts * torch.sum(self.tokens / self.rows * (self.probs / self.rows))

    def surrogate(self, logits: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """A scalar whose gradient w.r.t. `logits` equals grad * d aux / d logits for this layer."""
        weight = (grad * self.num_experts * self.tokens / self.rows**2).detach()  # (E,)
        probs = self._probs(logits)
        if self.row_mask is not None:
            probs = probs * self.row_mask[:, None]
        return (probs * weight).sum()


def _chunk_kl(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, bias,
              teacher_weight: torch.Tensor, teacher_bias) -> torch.Tensor:
    log_q = F.log_softmax(F.linear(student, weight, bias).float(), dim=-1)  # (n, V) student
    with torch.no_grad():
        log_p = F.log_softmax(F.linear(teacher, teacher_weight, teacher_bias).float(), dim=-1)  # (n, V) teacher
    return (log_p.exp() * (log_p - log_q)).sum()


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, head: torch.nn.Linear,
               attention_mask: torch.Tensor | None = None,
               chunk_tokens: int = CHUNK_TOKENS,
               teacher_head: torch.nn.Linear | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed KL(teacher ‖ student) of the next-token distributions, and the number of positions.

    Chunked like `causal_lm_loss`: one chunk's two (n, V) fp32 logits at a time, the student's
    recomputed in backward, so no (B, T, V) pair is ever held.

    Args:
        student, teacher: (B, T, d) final hidden states (after the final norm); the teacher's carry no grad.
        head: the LM head both share.
        attention_mask: (B, T), 0 on padding (those positions are left out); None: every position.
        teacher_head: the teacher's own head when it is not `head` (a frozen copy while the student's trains).
    """
    t_head = head if teacher_head is None else teacher_head
    d = student.shape[-1]
    rows = None if attention_mask is None else attention_mask.reshape(-1).bool()
    s, t = student.reshape(-1, d), teacher.detach().reshape(-1, d)
    if rows is not None:
        s, t = s[rows], t[rows]
    total = student.new_zeros((), dtype=torch.float32)
    for start in range(0, s.shape[0], chunk_tokens):
        ss, ts = s[start : start + chunk_tokens], t[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_kl, ss, ts, head.weight, head.bias, t_head.weight, t_head.bias,
                                       use_reentrant=False)
        else:
            total = total + _chunk_kl(ss, ts, head.weight, head.bias, t_head.weight, t_head.bias)
    return total, torch.tensor(s.shape[0], device=student.device)
