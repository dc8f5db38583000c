"""Load a fine-tuned `final/` directory and generate from it.

    model = revffn.load("runs/quickstart/final")
    tok = revffn.data.tokenizer.load_tokenizer("runs/quickstart/final")
    print(generate(model, tok, ["What is 3 + 4?"])[0])

`final/revffn.json` says how the directory was written: `format: hf` (a plain HF save_pretrained
directory: full, ckpt, hift, and LoRA/DoRA/ReFTA merged) or `format: revffn` (a converted model:
base HF config + the converted weights).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from revffn.errors import UserError

END_TOKENS = ("<|end|>", "<|endoftext|>", "<|im_end|>", "</s>")


def load(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A model from a `final/` (or any save_pretrained) directory, ready for eval and generation.

    Weights are cast to `dtype` (fp32 by default, whatever the dtype on disk)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from revffn.models.causal_lm import CausalLM
    from revffn.models.convert import convert

    root = Path(path)
    if not (root / "config.json").is_file():
        raise UserError(f"{path!r} is not a model directory (no config.json). Fix: point at a run's final/ "
                        "directory or an HF save_pretrained directory.")
    manifest = json.loads((root / "revffn.json").read_text()) if (root / "revffn.json").is_file() else {}
    if manifest.get("format") == "revffn":
        config = AutoConfig.from_pretrained(root, local_files_only=True)
        hf = AutoModelForCausalLM.from_config(config)
        stream = torch.float32 if manifest.get("stream_dtype", "float32") == "float32" else torch.bfloat16
        model = convert(hf, adapter_init=manifest.get("adapter_init", "coordinate"), stream_dtype=stream)
        load_model(model, str(root / "model.safetensors"))
    else:
        model = CausalLM(AutoModelForCausalLM.from_pretrained(root, local_files_only=True, dtype=dtype))
    return model.to(device=device, dtype=dtype).eval()


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


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, batch_size: int = 16,
             system: str | None = None) -> list[str]:
    """Greedy completions of user `prompts`, rendered with the tokenizer's chat template."""
    from revffn.data.templates import render_prompt

    device = next(model.parameters()).device
    texts = []
    for p in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
        texts.append(render_prompt(messages, tokenizer))
    return generate_from_texts(model, tokenizer, texts, max_new_tokens, batch_size, device)


def generate_from_texts(model, tokenizer, texts: list[str], max_new_tokens: int, batch_size: int,
                        device) -> list[str]:
    stop, results = stop_ids(tokenizer), []
    for i in range(0, len(texts), batch_size):
        chunk = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[i : i + batch_size]]
        for seq in generate_ids(model, chunk, max_new_tokens, stop, tokenizer.pad_token_id, device):
            results.append(tokenizer.decode(seq, skip_special_tokens=True))
    return results
