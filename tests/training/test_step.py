"""`train_step`: gradient accumulation is one big batch; the LR follows the method's schedule."""

from __future__ import annotations

import math

import pytest
import torch

from revffn.data.collate import collate
from revffn.training.config import load_config
from revffn.training.schedule import lr_at
from revffn.training.step import build_run, train_step

# router_aux_loss_coef 0: the load-balancing loss is a statistic of the whole batch (fraction routed x
# mean probability per expert), so it does not split over micro-batches; everything else must.
TINY = "model_config={num_hidden_layers: 2, hidden_size: 64, router_aux_loss_coef: 0.0, vocab_size: 2048}"


def _config(method: str, *overrides: str):
    return load_config(None, ["model=tiny-qwen2-moe", TINY, f"method={method}", "dtype=float32", "device=cpu",
                              "learning_rate=1e-3", "warmup_steps=0",
                              "max_grad_norm=0", *overrides])


def _items(n: int = 4, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """n examples of different lengths, the first 3 tokens a prompt (label -100), as tokenize_dataset makes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in (10, 16, 7, 13, 9, 12)[:n]:
        ids = torch.randint(3, 2048, (length,), generator=g).tolist()
        out.append((ids, [-100] * 3 + ids[3:]))
    return out


def _steps(method: str, splits: list[list[int]], steps: int = 2):
    """Weights and first-step gradients after `steps` optimizer steps, each over the micro-batches `splits`.

    adam_epsilon 1e-4: AdamW's first steps are ~lr * sign(grad), so a gradient that is 0 in exact arithmetic
    (e.g. the key bias under softmax) turns float noise into a full-size update; a larger epsilon damps that.
    """
    run = build_run(_config(method, "adam_epsilon=1e-4"), torch.device("cpu"))
    grads = {}

    def keep_grads():
        if not grads:
            grads.update({n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None})

    for step in range(steps):
        items = _items(seed=step)
        micro = [collate([items[i] for i in split], pad_id=0) for split in splits]
        train_step(run, step, micro, after_backward=keep_grads)
    return {n: p.detach().clone() for n, p in run.model.named_parameters()}, grads


@pytest.mark.parametrize("method", ["full", "revffn"])
def test_two_micro_batches_equal_one_batch_of_four(method):
    w_accum, g_accum = _steps(method, [[0, 1], [2, 3]])  # accumulation 2, padded to 16 and 13 tokens
    w_one, g_one = _steps(method, [[0, 1, 2, 3]])  # one batch of 4, padded to 16
    w_start, _ = _steps(method, [], steps=0)
    assert g_accum.keys() == g_one.keys() and len(g_one) > 10
    for name, g in g_one.items():  # the loss is normalised by the tokens of all micro-batches
        assert torch.allclose(g_accum[name], g, rtol=1e-4, atol=1e-8), (name, (g_accum[name] - g).abs().max())
    for name, w in w_one.items():
        assert (w_accum[name] - w).abs().max() <= 1e-6, (name, (w_accum[name] - w).abs().max())
    assert sum(not torch.equal(w, w_start[n]) for n, w in w_one.items()) > 10  # the steps did move the weights


def test_per_micro_batch_means_would_differ():
    """The check above can fail: averaging each micro-batch's mean loss weights tokens unequally."""
    run = build_run(_config("full"), torch.device("cpu"))
    items = _items()
    micro = [collate(items[:2], 0), collate(items[2:], 0)]
    with torch.no_grad():
        whole = run.model(**collate(items, 0), return_logits=False)
        parts = [run.model(**m, return_logits=False) for m in micro]
    assert sum(p.n_tokens for p in parts) == whole.n_tokens
    assert torch.allclose(sum(p.loss_sum for p in parts) / whole.n_tokens, whole.loss_sum / whole.n_tokens)
    assert abs(float(sum(p.loss_sum / p.n_tokens for p in parts) / 2 - whole.loss_sum / whole.n_tokens)) > 1e-4


@pytest.mark.parametrize("method,length", [("full", 8), ("hift", math.ceil(8 / 4))])
def test_lr_follows_the_methods_schedule(method, length):
    cfg = _config(method, "max_steps=8", "warmup_steps=0", "lr_scheduler_type=cosine", "min_lr_ratio=0.1")
    run = build_run(cfg, torch.device("cpu"))
    batch = collate(_items(2), 0)
    lrs = [train_step(run, step, [batch]).lr for step in range(8)]
    position = [run.method.schedule_position(s) for s in range(8)]
    assert lrs == [lr_at(p, length, 1e-3, 0, "cosine", 0.1) for p in position]
    assert lrs[0] == 1e-3 and lrs[-1] < lrs[0]
    if method == "hift":  # 4 groups (embed, 2 layers, head): the LR moves once per cycle
        assert lrs[:4] == [1e-3] * 4 and len(set(lrs[4:])) == 1
    assert all(g["lr"] == lrs[-1] for g in run.optimizer.param_groups)
