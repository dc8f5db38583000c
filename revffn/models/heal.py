"""Heal a converted model by self-distillation: train the adapters so that the converted model's
next-token distributions match the unconverted model's.

    loss = KL(teacher ‖ student) per predicted position     (models.loss.distill_kl, chunked)

The teacher is the same pretrained weights in their original wiring (`models.teacher.teacher_hidden`:
each block's HF decoder layer at full width, under no_grad). Only the adapters train, so the
backbone the teacher runs is frozen and nothing is copied. With `train_norms` the RMSNorm weights
the converted blocks use train too; the teacher then runs on a copy of the original norm weights
(2·L·d values), swapped in for its forward. The student runs reversibly (the training path), so the
heal's activation memory is RevFFN's, plus one teacher forward under no_grad.

    report = heal(model, batches, steps=400, lr=1e-3)
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch

from revffn.models.loss import distill_kl
from revffn.models.spec import get_path
from revffn.models.teacher import student_hidden, teacher_context, teacher_hidden, teacher_layer


def norm_parameters(model) -> list[torch.nn.Parameter]:
    """The pre-attention and pre-MoE norm weights of every block (what `train_norms` adds)."""
    spec = model.spec
    return [p for b in model.blocks for name in (spec.attn_norm, spec.mlp_norm)
            for p in getattr(b.base_layer, name).parameters()]


@contextlib.contextmanager
def _original_norms(params: list[torch.nn.Parameter], originals: list[torch.Tensor]):
    """Swap the original norm weights in (the teacher's view), and the trained ones back after."""
    trained = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, o in zip(params, originals):
            p.copy_(o)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, t in zip(params, trained):
                p.copy_(t)


def heal_lr(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first tenth of the steps (AdamW's first steps are sign-like, as large as
    lr on every weight, and undo the calibration), then cosine from `lr` to lr/10."""
    warmup = max(steps // 10, 1)
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1))))


@torch.no_grad()
def _teacher_states(model, input_ids, attention_mask) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The teacher's final hidden states and, per layer, what calibration makes Y_1 and Y_2 track:
    `model.stream_targets(a_l, h_{l+1})`, a_l = h_l + attention output (see `models.calibrate`)."""
    h, position_ids, sctx = teacher_context(model, input_ids, attention_mask)
    states, seen = [], {}
    for block in model.blocks:
        attn = getattr(block.base_layer, model.spec.attn)
        handle = attn.register_forward_hook(lambda m, a, out: seen.__setitem__("attn", out[0]))
        h_next = teacher_layer(block, h, sctx, position_ids)
        handle.remove()
        states.append(model.stream_targets(h + seen["attn"], h_next))
        h = h_next
    return get_path(model.hf, model.spec.final_norm)(h), states


@contextlib.contextmanager
def _block_outputs(model):
    """Every block's (Y_1, Y_2), with their graph (the plain twin: model.reversible is False)."""
    outs: list = []
    handles = [b.register_forward_hook(lambda m, a, out: outs.append(out)) for b in model.blocks]
    try:
        yield outs
    finally:
        for h in handles:
            h.remove()


def _hidden_mse(outs, states) -> torch.Tensor:
    """Mean over layers of ‖(Y_1, Y_2) − targets‖² / ‖targets‖²."""
    terms = [((Y_1 - t_1).pow(2).sum() + (Y_2 - t_2).pow(2).sum()) / (t_1.pow(2).sum() + t_2.pow(2).sum())
             for (Y_1, Y_2), (t_1, t_2) in zip(outs, states)]
    return torch.stack(terms).mean()


def heal(model, batches: Iterator[tuple[torch.Tensor, torch.Tensor | None]], steps: int, lr: float = 1e-3,
         train_norms: bool = False, hidden_coef: float = 0.0, max_grad_norm: float = 1.0,
         log: Callable[[str], None] | None = None, log_every: int = 50,
         progress: Callable[[int, int], None] | None = None) -> dict:
    """Train the adapters (and the norms if `train_norms`) of `model` for `steps` AdamW steps of
    KL(teacher ‖ student) at `heal_lr`. `batches` yields (input_ids, attention_mask).

    `hidden_coef` > 0 adds that times the per-layer hidden-state MSE (relative, to the targets of the
    calibration); it needs every layer's graph, so the student then runs as the plain twin.

    `progress(steps done, steps)` is called after every step (a progress bar's feed).

    Returns {"steps", "lr", "train_norms", "kl_first", "kl_last" (mean of the last 10 steps), "tokens", "wall_s"}.
    """
    params = list(model.adapter_parameters())
    norms = norm_parameters(model) if train_norms else []
    originals = [p.detach().clone() for p in norms]
    trainable = {id(p) for p in params + norms}
    was = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    optimizer = torch.optim.AdamW(params + norms, lr=lr, weight_decay=0.0)
    head = get_path(model.hf, model.spec.head)
    was_training, was_reversible = model.training, model.reversible
    model.train()
    model.reversible = model.reversible and not hidden_coef
    t0, tokens, kls = time.perf_counter(), 0, []
    try:
        for step in range(steps):
            input_ids, attention_mask = next(batches)
            for group in optimizer.param_groups:
                group["lr"] = heal_lr(step, steps, lr)
            with _original_norms(norms, originals) if norms else contextlib.nullcontext():
                if hidden_coef:
                    target, states = _teacher_states(model, input_ids, attention_mask)
                else:
                    target = teacher_hidden(model, input_ids, attention_mask)
            keep_layers = _block_outputs(model) if hidden_coef else contextlib.nullcontext([])
            with student_hidden(model) as box, keep_layers as outs:
                model(input_ids, attention_mask=attention_mask, return_logits=False)
            kl_sum, n = distill_kl(box[0], target, head, attention_mask, model.chunk_tokens)
            loss = kl_sum / n.clamp(min=1)
            (loss + hidden_coef * _hidden_mse(outs, states) if hidden_coef else loss).backward()
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params + norms, max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            kls.append(loss.item())
            tokens += int(n)
            if progress is not None:
                progress(step + 1, steps)
            if log is not None and (step + 1) % log_every == 0:
                log(f"heal step {step + 1}/{steps}: KL {sum(kls[-log_every:]) / len(kls[-log_every:]):.4f}")
    finally:
        for p in model.parameters():
            p.requires_grad_(was[id(p)])
        model.train(was_training)
        model.reversible = was_reversible
    tail = kls[-10:]
    return {"steps": steps, "lr": lr, "train_norms": train_norms, "hidden_coef": hidden_coef,
            "kl_first": kls[0] if kls else None, "kl_last": sum(tail) / len(tail) if tail else None, "tokens": tokens,
            "wall_s": round(time.perf_counter() - t0, 2)}
