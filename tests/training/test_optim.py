"""`decay_groups` / `build_optimizer`: no weight decay on 1-D parameters, every parameter exactly once;
the optimizer choices and the in-backward step, through the real training step."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from revffn.cli import main
from revffn.training import optim
from revffn.training.config import load_config
from revffn.training.optim import InBackward, Offloaded, build_optimizer, clip_grads, decay_groups
from revffn.training.step import build_run, train_step


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


# -- optimizer_in_backward and the optimizer choices, through the real training step -----------------------
TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 3, hidden_size: 64, vocab_size: 500}",
        "dtype=float32", "device=cpu", "learning_rate=1e-3", "warmup_steps=0", "weight_decay=0.01",
]
# revffn with the additive coupling: its stage boundary at step 1
ADDITIVE = ["revffn.coupling=additive", "revffn.adapter_init=coordinate", "revffn.adapter_warmup_steps=1",
            "revffn.heal_data=task"]


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _weights_after(method: str, steps: int, *overrides: str):
    run = build_run(load_config(None, [*TINY, f"method={method}", *overrides]), torch.device("cpu"))
    norms = [float(train_step(run, s, [_batch(s)]).grad_norm) for s in range(steps)]
    return {n: p.detach().clone() for n, p in run.model.named_parameters()}, norms, run


@pytest.mark.parametrize("method,extra", [("full", []), ("ckpt", []), ("revffn", []),
                                          ("revffn", ["revffn.recompute_chunk_tokens=7"]), ("revffn", ADDITIVE),
                                          ("revffn", [*ADDITIVE, "revffn.recompute_chunk_tokens=7"])])
def test_in_backward_step_equals_the_ordinary_step(method, extra, one_thread):
    """fp32, AdamW, clipping off: stepping each parameter inside the backward gives the same weights
    (revffn: each block is stepped inside its own backward_pass, after the last chunk of a chunked recompute;
    the additive coupling across its stage boundary)."""
    ref, ref_norms, _ = _weights_after(method, 4, "max_grad_norm=0", *extra)
    got, norms, run = _weights_after(method, 4, "max_grad_norm=0", "optimizer_in_backward=true", *extra)
    if any("recompute_chunk_tokens" in e for e in extra):
        assert run.model.last_stack_stats.get("recompute_chunks")  # the chunked path ran
    assert isinstance(run.optimizer, InBackward)
    assert all(p.grad is None for p in run.model.parameters())  # every gradient freed in backward
    worst = max((got[n] - ref[n]).abs().max().item() for n in ref)
    assert worst <= 1e-6, worst
    assert any(not torch.equal(got[n], ref[n]) for n in ref) or worst == 0  # compared, not skipped
    assert norms == pytest.approx(ref_norms, rel=1e-5)  # the logged global norm, before any clipping


class _Moved:
    """A finished host transfer (torchao records a CUDA event)."""

    def synchronize(self) -> None:
        pass


class _HostOffload:
    """torchao's `CPUOffloadOptimizer(..., offload_gradients=True)` on the CPU (which it refuses: CUDA only), as
    torchao 0.18 writes it less the streams: a parameter of `minimal_size` elements or more gets a host copy, its
    own optimizer and a post-accumulate-grad hook that copies `.grad` into the host copy's gradient and frees it;
    the small ones stay with one optimizer on the device; `step` steps the queued host copies and copies them back."""

    def __init__(self, params, optimizer_class, *, offload_gradients: bool, minimal_size: int = 4096, **kwargs):
        assert offload_gradients
        self.param_d2h_map, self.optim_dict, self.queue, self.d_param_groups = {}, {}, {}, []
        for group in params:
            group, small = dict(group), []
            for p in group.pop("params"):
                if not p.requires_grad:
                    continue
                if p.numel() < minimal_size:
                    small.append(p)
                    continue
                host = p.detach().clone()
                host.grad = torch.empty_like(host)
                self.param_d2h_map[p] = host
                p.register_post_accumulate_grad_hook(self._moved)
                self.optim_dict[p] = optimizer_class([{"params": host, **group}], **kwargs)
            if small:
                self.d_param_groups.append({"params": small, **group})
        self.d_opt = optimizer_class(self.d_param_groups, **kwargs) if self.d_param_groups else None

    def _moved(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.param_d2h_map[p].grad.copy_(p.grad)
            self.queue.pop(p, None)
            self.queue[p] = _Moved()
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self.d_opt is not None:
            self.d_opt.step()
        for p in self.queue:
            self.optim_dict[p].step()
            p.copy_(self.param_d2h_map[p])
        self.queue.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_d2h_map:
            p.grad = None
        if self.d_opt is not None:
            self.d_opt.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        return sum((o.param_groups for o in self.optim_dict.values()), start=self.d_param_groups)

    def state_dict(self) -> dict:
        return {"offloaded": [o.state_dict() for o in self.optim_dict.values()],
                **({"on-device": self.d_opt.state_dict()} if self.d_opt is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        for o, s in zip(self.optim_dict.values(), state["offloaded"]):
            o.load_state_dict(s)
        if self.d_opt is not None:
            self.d_opt.load_state_dict(state["on-device"])


def test_clip_grads_equals_torch_clip_grad_norm():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g) * 10, torch.randn(2, 2, 2, generator=g)]
    ref = [x.clone() for x in grads]
    params = [nn.Parameter(torch.zeros_like(x)) for x in ref]
    for p, x in zip(params, ref):
        p.grad = x
    ref_norm = torch.nn.utils.clip_grad_norm_(params, 2.0)
    norm = clip_grads(grads, 2.0)
    assert norm == pytest.approx(ref_norm.item(), rel=1e-6) and norm > 2.0  # it clipped
    assert all(torch.allclose(x, p.grad, rtol=1e-6, atol=0) for x, p in zip(grads, params))
    assert clip_grads([x.clone() for x in grads], 0).item() == pytest.approx(2.0, rel=1e-5)  # 0: measured only


def _host_offload(monkeypatch) -> None:
    torchao_optim = type("torchao_optim", (), {"CPUOffloadOptimizer": _HostOffload})
    monkeypatch.setattr(optim, "_torchao_optim", lambda: torchao_optim)


def test_offloaded_optimizer_resumes_from_the_loaded_weights(monkeypatch, one_thread):
    """torchao copies each large parameter to the host once, when built, and every step writes that copy back: a
    run resumed as the loop resumes (build, load the model, then the optimizer's state) steps on as the run that
    never stopped did, not from the weights it was built with."""
    _host_offload(monkeypatch)
    args = [*TINY, "method=revffn", "optimizer_offload=cpu", "max_grad_norm=0.5"]
    ref = build_run(load_config(None, args), torch.device("cpu"))
    for s in range(2):
        train_step(ref, s, [_batch(s)])
    weights = {n: p.detach().clone() for n, p in ref.model.state_dict().items()}
    state = copy.deepcopy(ref.optimizer.state_dict())
    train_step(ref, 2, [_batch(2)])
    resumed = build_run(load_config(None, args), torch.device("cpu"))
    resumed.model.load_state_dict(weights)
    resumed.optimizer.load_state_dict(state)
    train_step(resumed, 2, [_batch(2)])
    got = dict(resumed.model.named_parameters())
    worst = max((got[n] - p).abs().max().item() for n, p in ref.model.named_parameters())
    assert worst <= 1e-6, worst


def test_hift_with_offload_is_a_config_error():
    """HiFT moves its resting groups' optimizer states off the device; torchao's host states cannot be moved."""
    from revffn.errors import UserError
    from revffn.methods import method_class
    from revffn.training.optim import check_optimizer

    cfg = load_config(None, [*TINY[:2], "method=hift", "optimizer_offload=cpu"])
    with pytest.raises(UserError, match="optimizer_offload=none with method=hift"):
        check_optimizer(cfg, torch.device("cuda"), torch.float32, method_class("hift"))


def test_offloaded_optimizer_equals_the_ordinary_step_through_a_chunked_recompute(monkeypatch, one_thread):
    """fp32, AdamW, clipping on: torchao's offload (its hook contract, on the CPU) trains the buffered RevFFN with a
    chunked recompute to the weights of the ordinary optimizer. Its hook overwrites the host gradient each time it
    fires, so each parameter's partial chunks must not fire it (`Offloaded` sets `hookless`), and the clipping must
    see the host gradients (the device holds none of the large parameters' after the backward)."""
    _host_offload(monkeypatch)
    extra = ["max_grad_norm=0.5", "revffn.recompute_chunk_tokens=7"]
    ref, ref_norms, _ = _weights_after("revffn", 3, *extra)
    got, norms, run = _weights_after("revffn", 3, "optimizer_offload=cpu", *extra)
    assert isinstance(run.optimizer, Offloaded) and run.optimizer.inner.param_d2h_map  # large parameters offloaded
    assert run.model.last_stack_stats.get("recompute_chunks")  # the chunked path ran
    assert min(ref_norms) > 0.5  # every step clipped
    worst = max((got[n] - ref[n]).abs().max().item() for n in ref)
    assert worst <= 1e-6, worst
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert set(run.optimizer.state) == {p for p in run.params if p.requires_grad}  # each one's state, by the device's


def test_in_backward_clips_each_parameter_by_its_share_of_the_norm(one_thread):
    # epsilon 1e-3, far above these gradients: the update is ~ lr * g / eps, so the clipping shows in it
    got, _, run = _weights_after("full", 1, "max_grad_norm=1e-3", "optimizer_in_backward=true",
                                 "lr_scheduler_type=constant", "weight_decay=0", "adam_epsilon=1e-3")
    ref_run = build_run(load_config(None, [*TINY, "method=full", "max_grad_norm=0"]), torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in ref_run.model.named_parameters()}
    out = ref_run.model(**_batch(0), return_logits=False)
    loss = out.loss_sum / int((_batch(0)["labels"][:, 1:] != -100).sum())
    (loss + ref_run.model.aux_loss_coef * out.aux_loss).backward()  # as train_step: the router's aux loss too
    total, clipped = sum(p.numel() for p in ref_run.params), 0
    for n, p in ref_run.model.named_parameters():  # the reference: clip each gradient alone, one AdamW step
        if p.grad is None:
            continue
        bound = 1e-3 * (p.numel() / total) ** 0.5  # its share of the global budget
        clipped += float(p.grad.norm()) > bound
        g = p.grad * min(1.0, bound / (float(p.grad.norm()) + 1e-6))
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.0, eps=1e-3)
        p.grad = g
        opt.step()
        assert torch.allclose(got[n], p.detach(), atol=1e-6), n
        assert not torch.equal(got[n], before[n])
    assert clipped > 5  # the bound bit


def _run_and_resume(args: list[str], tmp: Path) -> tuple[dict, dict]:
    """Per-step losses of a 6-step run (`args`, checkpoint at step 3) and of a copy resumed from step 3."""
    assert main([*args, f"output_dir={tmp / 'ref'}"]) == 0
    shutil.copytree(tmp / "ref", tmp / "run")
    assert main([*args, f"output_dir={tmp / 'run'}", "resume=true"]) == 0

    def losses(d: Path) -> dict:
        return {r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}

    return losses(tmp / "ref"), losses(tmp / "run")


@pytest.mark.parametrize("optimizer", ["adafactor", pytest.param("adamw8bit", marks=pytest.mark.integration),
                                       pytest.param("adamw4bit", marks=pytest.mark.integration)])
@pytest.mark.parametrize("in_backward", [False, True])
def test_optimizers_train_and_resume_exactly(optimizer, in_backward, tmp_path, one_thread):
    """Each optimizer, with and without the in-backward step: the loss falls, and a run resumed from its
    step-3 checkpoint reproduces steps 4-6 (the optimizer state saved and restored)."""
    pytest.importorskip("torchao") if "bit" in optimizer else None
    args = ["train", *TINY[:2], "method=revffn", "data=builtin:reversal_train", "eval_data=null",
            "model_config={num_hidden_layers: 2, hidden_size: 64}", "max_steps=6", "save_steps=3",
            "per_device_train_batch_size=4", "max_seq_length=32", "dtype=float32", "device=cpu",
            "learning_rate=" + ("3e-2" if optimizer == "adafactor" else "1e-3"), "logging_steps=1",
            "revffn.coupling=additive", "revffn.adapter_init=coordinate", "revffn.adapter_warmup_steps=2",
            "revffn.heal_data=task", f"optimizer={optimizer}", f"optimizer_in_backward={str(in_backward).lower()}"]
    ref, resumed = _run_and_resume(args, tmp_path)
    assert ref[6] < ref[1]
    for s in range(1, 7):
        assert abs(resumed[s] - ref[s]) <= 1e-6, (s, resumed[s], ref[s])


@pytest.mark.parametrize("overrides,needle", [
    (["optimizer=adamw9bit"], "optimizer"),
    (["optimizer_in_backward=true", "gradient_accumulation_steps=2"], "gradient_accumulation_steps=1"),
    (["optimizer_offload=cpu"], "optimizer_offload=none"),
    (["bf16_stochastic_round=true"], "dtype=bfloat16"),
    (["method=hift", "optimizer_in_backward=true"], "optimizer_in_backward=false"),
])
def test_bad_optimizer_combinations_exit_2_and_write_nothing(overrides, needle, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "model=tiny-qwen2-moe", "method=full", "data=builtin:reversal_train", "max_steps=2",
                 "device=cpu", f"output_dir={out}", *overrides]) == 2
    err = capsys.readouterr().err
    assert needle in err and not out.exists()


def test_a_missing_torchao_is_a_config_error(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *a, **k):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    out = tmp_path / "run"
    assert main(["train", "model=tiny-qwen2-moe", "method=full", "data=builtin:reversal_train", "max_steps=2",
                 "device=cpu", f"output_dir={out}", "optimizer=adamw8bit"]) == 2
    assert "pip install torchao" in capsys.readouterr().err and not out.exists()


@pytest.mark.integration
def test_bf16_stochastic_rounding_trains_and_resumes(tmp_path, one_thread):
    """bf16 weights with torchao's stochastic rounding: the loss falls, and a resumed run reproduces the
    uninterrupted one (the rounding draws from the generator state the checkpoint restores)."""
    pytest.importorskip("torchao")
    args = ["train", "model=tiny-qwen2-moe", "model_config={num_hidden_layers: 2, hidden_size: 64}", "method=full",
            "data=builtin:reversal_train", "eval_data=null", "max_steps=6", "save_steps=3", "logging_steps=1",
            "per_device_train_batch_size=4", "max_seq_length=32", "dtype=bfloat16", "device=cpu",
            "learning_rate=1e-3", "bf16_stochastic_round=true"]
    ref, resumed = _run_and_resume(args, tmp_path)
    assert ref[6] < ref[1]
    assert all(abs(resumed[s] - ref[s]) <= 1e-6 for s in range(1, 7)), (resumed, ref)
