"""Greedy generation from any model with the `CausalLM` forward contract (a converted or a plain one).

    model = revffn.load("runs/quickstart/final")
    tok = load_tokenizer("runs/quickstart/final")
    print(generate_texts(model, tok, chat_prompts(["Put commas between: rope ink tea"], tok))[0])

Batches are left-padded; positions follow the attention mask, so a batched prompt decodes exactly
as it would alone. A KV cache holds the keys and values of every token seen (`use_cache`, the
default): each step feeds only the new token, not the whole prefix again (`scripts/generate_speed.py`
measures the difference); the tokens are the same.
"""

from __future__ import annotations

from pathlib import Path

import torch

from revffn.errors import UserError

END_TOKENS = ("<|end|>", "<|endoftext|>", "<|im_end|>", "</s>")


def stop_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    return ids | {vocab[t] for t in END_TOKENS if t in vocab}


@torch.no_grad()
def generate_ids(model, prompts: list[list[int]], max_new_tokens: int, stop: set[int], pad_id: int,
                 device="cpu", use_cache: bool = True, context: int | None = None) -> list[list[int]]:
    """Greedy decoding for a batch of token-id prompts (left-padded; positions follow the mask).

    With `use_cache` the model keeps its KV cache (`out.cache`) and each step feeds the tokens it has
    not seen; a model that returns none (a converted model whose token mixers take no cache) gets the
    whole sequence every step, as without it. A finished sequence is padded, masked out. With `context`
    (`positions`), a sequence also ends where it fills the model's positions, as it would alone."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    budget = [max_new_tokens if context is None else min(max_new_tokens, context - len(p)) for p in prompts]
    done = torch.tensor([b <= 0 for b in budget], device=device)
    out: list[list[int]] = [[] for _ in prompts]
    stop_t = torch.tensor(sorted(stop), device=device)
    cache, seen = None, 0  # seen: the tokens of `ids` the cache holds
    for _ in range(max(budget)):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        step = model(ids[:, seen:], attention_mask=mask, position_ids=pos[:, seen:], logits_to_keep=1,
                     cache=cache, use_cache=use_cache)
        cache = step.cache
        seen = ids.shape[1] if cache is not None else 0
        nxt = step.logits[:, -1].argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
        done |= torch.isin(nxt, stop_t) | torch.tensor([len(o) >= b for o, b in zip(out, budget)], device=device)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
        if bool(done.all()):
            break
    return [[t for t in seq if t not in stop] for seq in out]


def save_generation_config(out_dir: Path, tokenizer) -> None:
    """generation_config.json in a model directory: transformers' `generate()` stops where
    `revffn generate` stops (`stop_ids`) and pads with the tokenizer's pad token."""
    from transformers import GenerationConfig

    path = Path(out_dir)
    saved = (path / "generation_config.json").is_file()  # save_pretrained writes one for a plain HF model
    config = GenerationConfig.from_pretrained(path) if saved else GenerationConfig()
    config.eos_token_id, config.pad_token_id = sorted(stop_ids(tokenizer)), tokenizer.pad_token_id
    config.save_pretrained(path)


def positions(config) -> int | None:
    """The positions a model with this HF `config` decodes at: its `max_position_embeddings`, times the factor of a
    RoPE scaling that extends it (linear, YaRN, ...), as vLLM derives `max_model_len`; None where the config sets no
    such limit or scales without one (dynamic NTK)."""
    try:
        context = getattr(config, "max_position_embeddings", None)
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    except Exception:  # a config whose global attributes raise (per-layer ones)
        return None
    if not isinstance(context, int) or isinstance(context, bool):
        return None
    scalings = [rope] if isinstance(rope, dict) and ("rope_type" in rope or "type" in rope) else \
        [v for v in rope.values() if isinstance(v, dict)] if isinstance(rope, dict) else []  # per layer type
    factor = 1.0
    for scaling in scalings:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "dynamic":
            return None
        if kind not in (None, "default") and isinstance(f := scaling.get("factor"), int | float) and f > factor:
            factor = float(f)
    return int(context * factor)


def check_context(context: int | None, prompt_lengths: list[int], max_new_tokens: int, key: str,
                  names: list[str] | None = None) -> None:
    """UserError (naming `key`, and the longest prompt by its entry in `names`) when the longest prompt plus
    `max_new_tokens` runs past the model's `context` positions (`positions`), as vLLM refuses `max_tokens` beyond
    `max_model_len`: past them RoPE models decode on at untrained positions, and a large value runs for hours before
    it says so. No check where `context` is None."""
    longest = max(prompt_lengths, default=0)
    if context is not None and longest + max_new_tokens > context:
        room = context - longest
        which = f" ({names[prompt_lengths.index(longest)]})" if names else ""
        fix = f"give {key} {room} or less" if room > 0 else "shorten that prompt"
        raise UserError(f"{key} {max_new_tokens}: the longest prompt{which} is {longest} tokens and the model has "
                        f"{context} positions (max_position_embeddings, times any RoPE scaling factor), so at most "
                        f"{max(room, 0)} new tokens fit. Fix: {fix}.")


def check_new_tokens(context: int | None, max_new_tokens: int, key: str) -> None:
    """For generation over a data set (eval): UserError naming `key` when `max_new_tokens` alone leaves no position
    for a prompt (`context` from `positions`); below that each example's generation ends where it fills the
    positions (`generate_ids`), so one long prompt does not refuse the rest."""
    if context is not None and max_new_tokens >= context:
        raise UserError(f"{key} {max_new_tokens}: the model has {context} positions (max_position_embeddings, times "
                        f"any RoPE scaling factor), prompt included. Fix: {key} {context - 1} or less (e.g. 48).")


def generate_texts(model, tokenizer, texts: list[str], max_new_tokens: int = 64, batch_size: int = 16,
                   device=None, use_cache: bool = True, progress=None) -> list[str]:
    """Greedy completions of already-rendered prompt `texts` (see `data.templates.chat_prompts`), decoded
    without the stop tokens, each ending where it fills the model's positions (`positions`) at the latest;
    `progress(completions done)` after each batch."""
    device = device if device is not None else next(model.parameters()).device
    stop, results = stop_ids(tokenizer), []
    for i in range(0, len(texts), batch_size):
        chunk = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[i : i + batch_size]]
        for seq in generate_ids(model, chunk, max_new_tokens, stop, tokenizer.pad_token_id, device, use_cache,
                                positions(getattr(model, "config", None))):
            results.append(tokenizer.decode(seq, skip_special_tokens=True))
        if progress is not None:
            progress(len(results))
    return results
