"""The unconverted model inside a converted one: the teacher of calibration and heal.

Every `HFRevBlock` keeps its HF decoder layer as `block.base_layer`, so the pretrained model in its
original wiring is still there, weight for weight, with no copy:

    h_0 = embed(input_ids);   h_{l+1} = base_layer_l(h_l);   logits = head(norm(h_L))

run at full width d on the model's own masks and rotary embeddings (`model._context`). While the
backbone is frozen (calibration, heal, stage 1) this *is* the unconverted model; once it trains,
the teacher drifts with it. `teacher_hidden` reproduces the unconverted HF model's logits to float
rounding (tests/conversion/test_heal.py). `sample_self` draws text from it at temperature 1 with a KV
cache: data-free calibration and heal text.
"""

from __future__ import annotations

import contextlib

import torch

from revffn.archs.layout import cache_kwarg
from revffn.archs.spec import get_path
from revffn.conversion.loss import head_logits
from revffn.progress import progress


def _layer_output(out):
    return out[0] if isinstance(out, tuple) else out  # older decoder layers return (hidden, ...)


def _embed(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The embeddings as the unconverted model's own forward scales them (granite's embedding_multiplier)."""
    embeds = get_path(model.hf, model.spec.embed)(input_ids)
    return embeds * model.embed_scale if model.embed_scale != 1.0 else embeds


def teacher_context(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None):
    """(embeds (B, T, d), position_ids, the model's StackContext: masks and rotary) for a teacher run."""
    embeds = _embed(model, input_ids)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    return embeds, position_ids, model._context(embeds, attention_mask, position_ids)


def teacher_layer(block, h: torch.Tensor, sctx, position_ids: torch.Tensor) -> torch.Tensor:
    """h_{l+1} = the HF decoder layer of `block`, run as before conversion on the full-width h_l."""
    return _layer_output(block.base_layer(h, attention_mask=sctx.masks[block.mask_key], position_ids=position_ids,
                                          position_embeddings=sctx.position_embeddings))


@torch.no_grad()
def teacher_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, d) final hidden states (after the final norm) of the unconverted model, under no_grad."""
    h, position_ids, sctx = teacher_context(model, input_ids, attention_mask, position_ids)
    for block in model.blocks:
        h = teacher_layer(block, h, sctx, position_ids)
    return get_path(model.hf, model.spec.final_norm)(h)


@torch.no_grad()
def teacher_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, V) logits of the unconverted model (tests and small checks: the heal never holds these)."""
    return head_logits(teacher_hidden(model, input_ids, attention_mask), get_path(model.hf, model.spec.head),
                       model.logits_scale, model.logits_softcap)


@contextlib.contextmanager
def student_hidden(model):
    """Capture the converted model's final hidden states (after the final norm) during its forward:
    ``with student_hidden(model) as box: model(ids, return_logits=False)``; then ``box[0]`` (B, T, d)."""
    box: list[torch.Tensor] = []
    handle = get_path(model.hf, model.spec.final_norm).register_forward_hook(lambda m, a, out: box.append(out))
    try:
        yield box
    finally:
        handle.remove()


@torch.no_grad()
def sample_self(model, n_sequences: int, length: int, start_id: int, temperature: float = 1.0, seed: int = 0,
                batch_size: int = 64) -> torch.Tensor:
    """(n_sequences, length) token ids sampled from the unconverted model, each row starting with `start_id`.

    Incremental decoding through the HF layers with a `DynamicCache` (one new token per step; its
    query sees every cached key, so no mask is needed; a sliding window is not applied, which only
    matters for `length` above the window). Deterministic for a given `seed`.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    head, norm = get_path(model.hf, model.spec.head), get_path(model.hf, model.spec.final_norm)
    rotary = get_path(model.hf, model.spec.rotary)
    blocks = list(model.blocks)
    key = cache_kwarg(blocks[0].base_layer) or "cache"
    gen = torch.Generator(device="cpu").manual_seed(seed)
    was_training = model.training
    model.eval()
    rows = []
    with progress("sampling self text", "token") as bar:  # minutes on a real model on CPU
        for start in range(0, n_sequences, batch_size):
            b = min(batch_size, n_sequences - start)
            ids = torch.full((b, 1), start_id, dtype=torch.long, device=device)
            cache = DynamicCache(config=model.config)
            out = [ids]
            for t in range(length - 1):
                h = _embed(model, ids)
                pos = torch.full((1, 1), t, dtype=torch.long, device=device)
                pe = rotary(h, pos)
                for block in blocks:
                    h = _layer_output(block.base_layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe,
                                                       use_cache=True, **{key: cache}))
                logits = head(norm(h[:, -1])).float() / temperature
                probs = torch.softmax(logits, dim=-1).cpu()
                ids = torch.multinomial(probs, 1, generator=gen).to(device)
                out.append(ids)
                bar(start * length + b * (t + 2), n_sequences * length)
            rows.append(torch.cat(out, dim=1))
    model.train(was_training)
    return torch.cat(rows)[:, :length]
