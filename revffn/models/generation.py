"""Greedy generation from any model with the `CausalLM` forward contract (a converted or a plain one).

    model = revffn.load("runs/quickstart/final")
    tok = load_tokenizer("runs/quickstart/final")
    print(generate_texts(model, tok, chat_prompts(["Put commas between: rope ink tea"], tok))[0])

Batches are left-padded; positions follow the attention mask, so a batched prompt decodes exactly
as it would alone.
"""

from __future__ import annotations

import torch

END_TOKENS = ("<|end|>", "<|endoftext|>", "<|im_end|>", "</s>")


def stop_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    return ids | {vocab[t] for t in END_TOKENS if t in vocab}


@torch.no_grad()
def generate_ids(model, prompts: list[list[int]], max_new_tokens: int, stop: set[int], pad_id: int,
                 device="cpu") -> list[list[int]]:
    """Greedy decoding for a batch of token-id prompts (left-padded; positions follow the mask)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in prompts]
    stop_t = torch.tensor(sorted(stop), device=device)
    for _ in range(max_new_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask, position_ids=pos, logits_to_keep=1).logits[:, -1]
        nxt = logits.argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
        done |= torch.isin(nxt, stop_t)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
        if bool(done.all()):
            break
    return [[t for t in seq if t not in stop] for seq in out]


def generate_texts(model, tokenizer, texts: list[str], max_new_tokens: int = 64, batch_size: int = 16,
                   device=None) -> list[str]:
    """Greedy completions of already-rendered prompt `texts` (see `data.templates.chat_prompts`), decoded
    without the stop tokens."""
    device = device if device is not None else next(model.parameters()).device
    stop, results = stop_ids(tokenizer), []
    for i in range(0, len(texts), batch_size):
        chunk = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[i : i + batch_size]]
        for seq in generate_ids(model, chunk, max_new_tokens, stop, tokenizer.pad_token_id, device):
            results.append(tokenizer.decode(seq, skip_special_tokens=True))
    return results
