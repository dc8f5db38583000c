"""`revffn eval`: loss, perplexity and exact-match accuracy of a model on a data file.

Exact match (`match="exact"`, the default) compares the greedy generation with the example's reference
answer (its final assistant message) after collapsing whitespace. When the reference ends with an
`Answer: X` line (mini-GSM), the final answers are compared instead, as GSM8K scoring does.
`match="contains"` counts a generation as correct when it contains the reference, both
whitespace-collapsed and lower-cased: "The capital of France is Paris." answers "Paris" (knowledge
probes such as `builtin:smollm2_probes`, whose answers come in a sentence).

    revffn eval runs/quickstart/final --data builtin:reversal_test --json
    revffn eval builtin:smollm2 --data builtin:smollm2_probes --match contains
"""

from __future__ import annotations

import contextlib
import math
import re

import torch

from revffn.progress import progress

_ANSWER = re.compile(r"Answer:\s*(.+?)\s*$", re.S)
MATCHES = ("exact", "contains")  # `revffn eval --match`


def normalize(text: str) -> str:
    return " ".join(text.split())


def is_match(prediction: str, reference: str, match: str = "exact") -> bool:
    """Whether `prediction` answers `reference` under `match` ("exact" or "contains"; see the module doc).

    Raises:
        ValueError: `match` is not one of `MATCHES`.
    """
    if match not in MATCHES:
        raise ValueError(f"match: expected one of {', '.join(MATCHES)}, got {match!r}")
    if match == "contains":
        ref, pred = normalize(reference).lower(), normalize(prediction).lower()
        return ref in pred if ref else not pred  # an empty reference is answered by an empty prediction only
    if normalize(prediction) == normalize(reference):
        return True
    ref = _ANSWER.search(reference)
    pred = _ANSWER.search(prediction)
    return bool(ref and pred and normalize(ref.group(1)) == normalize(pred.group(1)))


@torch.no_grad()
def eval_loss(model, dataset, batch_size: int, pad_id: int, device, autocast, progress=None) -> float:
    """Teacher-forced mean loss per predicted token over a tokenized dataset (used by train and eval);
    `progress(batches done)` after each batch."""
    from revffn.data.collate import collate

    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), torch.zeros((), device=device)
    for i in range(0, len(dataset.items), batch_size):
        batch = {k: v.to(device) for k, v in collate(dataset.items[i : i + batch_size], pad_id).items()}
        with autocast():
            out = model(**batch, return_logits=False)
        total += out.loss_sum.float()
        count += out.n_tokens
        if progress is not None:
            progress(i // batch_size + 1)
    model.train(was_training)
    return (total / count.clamp(min=1)).item()


def _asked(messages: list[dict]) -> str:
    """What a sample shows as its prompt: the last user turn (after a tool call, the turn before is the tool's)."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-2]["content"])


@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], max_seq_length: int = 512, batch_size: int = 16,
             max_new_tokens: int = 48, limit: int | None = None, match: str = "exact",
             key: str = "eval_max_new_tokens") -> dict:
    """Teacher-forced loss/perplexity over all examples; accuracy over the first `limit` with answers.

    `match` ("exact" or "contains", see `is_match`) decides when a greedy generation is correct; the
    report's `exact_match` is the fraction correct under it and `match` names it. A `max_new_tokens` that leaves no
    position for a prompt is refused (UserError naming `key`) before the loss pass.
    """
    from revffn.data.collate import tokenize_dataset
    from revffn.data.templates import render_prompt
    from revffn.models.generation import check_new_tokens, generate_texts, positions

    if match not in MATCHES:  # before the loss pass, not after it
        raise ValueError(f"match: expected one of {', '.join(MATCHES)}, got {match!r}")
    model.eval()
    device = next(model.parameters()).device
    data = tokenize_dataset(examples, tokenizer, max_seq_length, False, "data")
    scored = [e for e in examples if e.get("answer") is not None]
    if limit is not None:
        scored = scored[:limit]
    prompts = [render_prompt(e["messages"][:-1], tokenizer, e.get("tools")) for e in scored]
    if prompts:
        check_new_tokens(positions(getattr(model, "config", None)), max_new_tokens, key)
    n_loss, n_generate = -(-len(data.items) // batch_size), -(-len(prompts) // batch_size)
    with progress("eval loss", "batch", n_loss) as bar:  # two bars: a generation batch takes far longer
        loss = eval_loss(model, data, batch_size, tokenizer.pad_token_id, device, contextlib.nullcontext,
                         progress=lambda done: bar(done, n_loss))
    with progress("eval generate", "batch", n_generate) as bar:
        preds = generate_texts(model, tokenizer, prompts, max_new_tokens, batch_size, device,
                               progress=lambda done: bar(-(-done // batch_size), n_generate)) if scored else []
    hits = [is_match(p, e["answer"], match) for p, e in zip(preds, scored)]
    return {"loss": loss, "perplexity": math.exp(min(loss, 50)), "exact_match": sum(hits) / len(hits) if hits else None,
            "match": match, "n_scored": len(hits), "n_examples": len(examples),
            "samples": [{"prompt": _asked(e["messages"]), "reference": e["answer"], "prediction": p}
                        for e, p in list(zip(scored, preds))[:3]]}


RETENTION_SET = "builtin:retention_test"


def retention_loss(model, tokenizer, data: str = RETENTION_SET, max_seq_length: int = 256,
                   batch_size: int = 16, limit: int | None = None, label: str = "") -> float:
    """Mean loss per token on held-out pretraining text (the shipped base's held-out set by default).

    Measures what fine-tuning keeps of the pretraining distribution: the base's recorded value is in
    `revffn/assets/base/base.json`; a rise after fine-tuning is forgetting. `limit`: first N documents only.
    `label` names the model in the progress line (`convert` scores the base, then the converted model).
    """
    from revffn.data.collate import tokenize_dataset
    from revffn.data.formats import load_examples

    dataset = tokenize_dataset(load_examples(data, "retention data")[:limit], tokenizer, max_seq_length)
    device = next(model.parameters()).device
    total = -(-len(dataset.items) // batch_size)
    with progress(f"{label} loss on {data}" if label else f"loss on {data}", "batch", total) as bar:
        return eval_loss(model, dataset, batch_size, tokenizer.pad_token_id, device, contextlib.nullcontext,
                         progress=lambda done: bar(done, total))
