"""Helpers shared by the method tests: configs from configs/, a run built as the loop builds it
(`build_run`), and one optimizer step of it (`train_step`, what the loop runs, minus logging/checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from revffn.data.tokenizer import load_tokenizer
from revffn.training.config import load_config
from revffn.training.setup import model_overrides
from revffn.training.step import Run, build_run, train_step

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def config(method: str, tmp: Path, *overrides: str, lr: float | None = None):
    """configs/tiny_{method}.yaml (fp32, CPU) with overrides; `lr`: a constant learning rate, no warmup."""
    fixed_lr = [f"learning_rate={lr}", "lr_scheduler_type=constant", "warmup_steps=0"] if lr else []
    return load_config(str(CONFIGS / f"tiny_{method}.yaml"),
                       [f"output_dir={tmp}", "dtype=float32", "device=cpu", *fixed_lr, *overrides])


def build(cfg) -> Run:
    """The run exactly as the loop builds it on CPU in fp32 (same seed => same weights)."""
    tok = load_tokenizer(cfg.tokenizer)
    return build_run(cfg, torch.device("cpu"), torch.float32, None, model_config=model_overrides(cfg, tok))


def batch(vocab: int = 500, n: int = 2, t: int = 24, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, t), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def step(run: Run, i: int, data: dict) -> float:
    """Optimizer step `i` on one batch, as the loop runs it; the batch's mean token loss."""
    result = train_step(run, i, [data])
    return float(result.loss_sum) / result.n_tokens


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(before: dict, model) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


def adapter_ranks(model) -> dict[str, int]:
    """Every peft adapter layer in `model` -> its rank (peft's own record, which a rank pattern would change)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n.replace(".base_layer", ""): mod.r["default"] for n, mod in model.named_modules()
            if isinstance(mod, BaseTunerLayer) and "default" in getattr(mod, "r", {})}


def unadapted_linears(model, names=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                   "down_proj")) -> list[str]:
    """The decoder layers' Linear modules of these names that peft left unwrapped (it wraps a Linear it adapts,
    as a module or through its `.weight`, which then sits at NAME.base_layer)."""
    return [n for n, m in model.named_modules()
            if type(m) is torch.nn.Linear and ".layers." in n and n.rsplit(".", 1)[-1] in names]
