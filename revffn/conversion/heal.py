"""The heal's maths: stage 1 of the revffn method (`methods.revffn`), which `revffn train` runs and
`revffn convert --heal-steps` runs through the same loop (`training.step.train_step`).

    loss = KL(teacher ‖ student) per predicted position            (conversion.loss.distill_kl, chunked)
         + heal_hidden_coef · mean over layers of ‖(Y_1, Y_2) − targets‖² / ‖targets‖²

The teacher is the same pretrained weights in their original wiring (`conversion.teacher`: each block's
HF decoder layer at full width, under no_grad). Only the adapters train, so the backbone the teacher
runs is frozen and nothing is copied. With `heal_norms` the RMSNorm weights the converted blocks use
train too; the teacher then runs on a copy of the original norm weights (2·L·d values), swapped in
for its forward (`original_norms`). The per-layer targets are what calibration fits each block's
streams to (`model.stream_targets`); that term needs every layer's graph, so the student then runs
as the plain twin (model.reversible False) for the heal.
"""

from __future__ import annotations

import contextlib

import torch

from revffn.archs.spec import get_path
from revffn.conversion.teacher import teacher_context, teacher_layer


def norm_parameters(model) -> list[torch.nn.Parameter]:
    """The pre-attention and pre-MoE norm weights of every block (what `heal_norms` adds)."""
    spec = model.spec
    return [p for b in model.blocks for name in (spec.attn_norm, spec.mlp_norm)
            for p in getattr(b.base_layer, name).parameters()]


@contextlib.contextmanager
def original_norms(params: list[torch.nn.Parameter], originals: list[torch.Tensor]):
    """Swap the original norm weights in (the teacher's view), and the trained ones back after."""
    if not params:
        yield
        return
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


@torch.no_grad()
def teacher_states(model, input_ids, attention_mask) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The teacher's final hidden states and, per layer, what calibration makes Y_1 and Y_2 track:
    `model.stream_targets(a_l, h_{l+1})`, a_l = h_l + attention output (see `conversion.calibrate`)."""
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
def block_outputs(model):
    """Every block's (Y_1, Y_2), with their graph (the plain twin: model.reversible is False)."""
    outs: list = []
    handles = [b.register_forward_hook(lambda m, a, out: outs.append(out)) for b in model.blocks]
    try:
        yield outs
    finally:
        for h in handles:
            h.remove()


def hidden_mse(outs, states) -> torch.Tensor:
    """Mean over layers of ‖(Y_1, Y_2) − targets‖² / ‖targets‖²."""
    terms = [((Y_1 - t_1).pow(2).sum() + (Y_2 - t_2).pow(2).sum()) / (t_1.pow(2).sum() + t_2.pow(2).sum())
             for (Y_1, Y_2), (t_1, t_2) in zip(outs, states)]
    return torch.stack(terms).mean()
