"""Helpers shared by the method tests: configs from configs/, a model prepared by a method, a
hand-driven step through the Method protocol (what the loop does, minus logging/checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from revffn.data.tokenizer import load_tokenizer
from revffn.methods import METHODS
from revffn.models.loading import load_hf
from revffn.training.config import load_config
from revffn.training.setup import model_overrides

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def config(method: str, tmp: Path, *overrides: str):
    """configs/tiny_{method}.yaml (fp32, CPU) with overrides."""
    return load_config(str(CONFIGS / f"tiny_{method}.yaml"),
                       [f"output_dir={tmp}", "dtype=float32", "device=cpu", *overrides])


def build(cfg):
    """(method, model) exactly as the loop builds them (same seed => same weights)."""
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(cfg.tokenizer)
    hf = load_hf(cfg.model, dtype=torch.float32, seed=cfg.seed, **model_overrides(cfg, tok))
    method = METHODS[cfg.method](cfg)
    model = method.prepare(hf)
    model.train()
    return method, model


def batch(vocab: int = 500, n: int = 2, t: int = 24, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, t), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def optimizer_for(method, model, lr: float = 1e-2):
    return torch.optim.AdamW(method.optimizer_parameters(model), lr=lr, weight_decay=0.0)


def step(method, model, optimizer, i: int, data: dict) -> float:
    """One optimizer step through the Method protocol, as the loop runs it."""
    method.set_trainable(model, i, optimizer)
    out = model(**data, return_logits=False)
    loss = out.loss_sum / out.n_tokens
    if out.aux_loss is not None and out.aux_loss.requires_grad:
        loss = loss + model.aux_loss_coef * out.aux_loss
    loss.backward()
    loss = loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    method.after_step(i, model, optimizer)
    return loss.item()


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(before: dict, model) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
