"""`decay_groups` / `build_optimizer`: no weight decay on 1-D parameters, every parameter exactly once."""

from __future__ import annotations

import torch
from torch import nn

from revffn.training.config import load_config
from revffn.training.optim import build_optimizer, decay_groups


def _params() -> list[nn.Parameter]:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4, bias=False))
    experts = nn.Parameter(torch.zeros(2, 8, 8))  # fused 3-D experts decay too
    return [*model.parameters(), experts]


def test_one_d_parameters_get_no_decay():
    params = _params()
    decay, no_decay = decay_groups(params, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [tuple(p.shape) for p in decay["params"]] == [(10, 8), (8, 8), (4, 8), (2, 8, 8)]
    assert [tuple(p.shape) for p in no_decay["params"]] == [(8,), (8,), (8,)]  # Linear bias, LayerNorm w and b
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in params)  # every parameter exactly once


def test_build_optimizer_takes_the_config():
    cfg = load_config(None, ["learning_rate=3e-4", "weight_decay=0.05", "adam_beta1=0.8", "adam_beta2=0.95",
                             "adam_epsilon=1e-6"])
    opt = build_optimizer(cfg, _params())
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    for g in opt.param_groups:
        assert g["lr"] == 3e-4 and g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6
