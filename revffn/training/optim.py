"""The optimizer of a training run, over a method's `optimizer_parameters`, in two decay groups.

    optimizer: adamw | adamw8bit | adamw4bit | adafactor      (the config key; README "Config keys")

- ``adamw``: `torch.optim.AdamW`; with ``bf16_stochastic_round`` (bf16 weights only) torchao's `_AdamW`,
  which keeps fp32 states and rounds each update into the bf16 weight stochastically, so updates
  smaller than a bf16 ulp are not lost on average.
- ``adamw8bit``, ``adamw4bit``: torchao's `AdamW8bit` / `AdamW4bit` (block-wise quantized states:
  ~2 and ~1 bytes per parameter for the two states together, plus one fp32 scale per block).
- ``adafactor``: `torch.optim.Adafactor` (factored second moment: O(rows + cols) per matrix, no first moment).
- ``optimizer_offload: cpu`` (CUDA only): torchao's `CPUOffloadOptimizer` keeps the states, and the
  step, on the host; gradients are moved to the host as they are produced (`offload_gradients`), so
  the device holds one tensor's gradient at a time, as with ``optimizer_in_backward`` (which it
  subsumes: with offload, the flag changes nothing; the host step runs after the backward). `Offloaded`
  wraps it: a chunked recompute's partial gradients do not fire its hook (which would overwrite the host
  gradient with the last chunk's), and `max_grad_norm` clips the host gradients.

``optimizer_in_backward: true`` steps every parameter as soon as its gradient is complete
(`Tensor.register_post_accumulate_grad_hook`: one optimizer per parameter, as PyTorch's
"optimizer step in backward" recipe and torchtune do) and frees that gradient at once, so the
gradients of the whole model are never held together. In RevFFN's reverse walk a block's parameters
are stepped inside that block's `backward_pass`, after the sub-block's outputs used to rebuild its
inputs were computed, so the reconstruction is untouched. The global gradient norm is only known after
the last gradient, so clipping is **per parameter**, with the global budget shared out by size: the
gradient of a parameter with n_p of the N elements the optimizer holds is scaled to norm ≤
`max_grad_norm` · sqrt(n_p / N) (0 disables), so that if every parameter sits at its bound the global
norm is `max_grad_norm`, as with ordinary clipping. (A bound of `max_grad_norm` for each parameter
clips almost nothing: the quickstart's eval loss came out 2.2x AdamW's that way, docs/optimizers.md.) The
logged `grad_norm` is still the global norm before clipping. It needs one backward per step
(`gradient_accumulation_steps: 1`).
"""

from __future__ import annotations

import torch
from torch import nn

from revffn.errors import UserError
from revffn.reversible.coupling import PartialGradients

OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adafactor")
TORCHAO = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Parameter groups with no weight decay on 1-D parameters (biases, norm weights), as HF Trainer does.

    Every parameter lands in exactly one group: `>= 2-D` ones decay by `weight_decay`, the others by 0.
    """
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def set_lr(optimizer, lr: float) -> None:
    """Set every group's LR (torchao's optimizers hold it as a tensor, updated in place)."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _torchao_optim():
    try:
        import torchao.optim
    except ImportError as e:
        raise UserError(f"this optimizer needs torchao, which is not importable ({e}). Fix: pip install torchao, "
                        "or optimizer=adamw / optimizer=adafactor.") from None
    return torchao.optim


def check_optimizer(cfg, device: torch.device, weights_dtype: torch.dtype, method_cls=None) -> None:
    """Every optimizer-key combination that cannot run, as one UserError naming the key and the fix."""
    name = cfg.optimizer
    if name in TORCHAO or cfg.bf16_stochastic_round:
        optim = _torchao_optim()
        if name in TORCHAO and not hasattr(optim, TORCHAO[name]):
            raise UserError(f"optimizer: {name} needs torchao.optim.{TORCHAO[name]}, which the installed torchao "
                            "lacks. Fix: upgrade torchao, or optimizer=adamw.")
    if name == "adafactor" and not hasattr(torch.optim, "Adafactor"):
        raise UserError("optimizer: adafactor needs torch.optim.Adafactor (torch >= 2.5; this is "
                        f"{torch.__version__}). "
                        "Fix: upgrade torch, or optimizer=adamw.")
    if cfg.optimizer_in_backward and cfg.gradient_accumulation_steps > 1:
        raise UserError(f"optimizer_in_backward: true steps each parameter inside the backward, so it cannot "
                        f"accumulate {cfg.gradient_accumulation_steps} micro-batches. Fix: "
                        "gradient_accumulation_steps=1 (raise per_device_train_batch_size instead), or "
                        "optimizer_in_backward=false.")
    if cfg.optimizer_in_backward and method_cls is not None and not method_cls.OPTIMIZER_IN_BACKWARD:
        raise UserError(f"optimizer_in_backward: method {method_cls.name!r} manages its optimizer state itself. Fix: "
                        "optimizer_in_backward=false.")
    if cfg.optimizer_offload == "cpu" and device.type != "cuda":
        raise UserError("optimizer_offload: cpu moves optimizer states from the GPU to the host; this run is on "
                        f"{device.type}, where they already are in host memory. Fix: optimizer_offload=none.")
    if cfg.optimizer_offload == "cpu" and method_cls is not None and method_cls.name == "hift":
        raise UserError("optimizer_offload: cpu keeps each large parameter's optimizer state on the host, where HiFT "
                        "cannot move the states of its resting groups. Fix: optimizer_offload=none with method=hift.")
    if cfg.optimizer_offload == "cpu" and cfg.gradient_accumulation_steps > 1:
        raise UserError(f"optimizer_offload: cpu moves each gradient to the host as it is produced (torchao's "
                        f"offload_gradients), so it cannot accumulate {cfg.gradient_accumulation_steps} micro-batches. "
                        "Fix: gradient_accumulation_steps=1, or optimizer_offload=none.")
    if cfg.bf16_stochastic_round and weights_dtype != torch.bfloat16:
        raise UserError(f"bf16_stochastic_round: true rounds updates into bf16 weights; this run's weights are "
                        f"{str(weights_dtype).removeprefix('torch.')}. Fix: dtype=bfloat16, or "
                        "bf16_stochastic_round=false.")
    if cfg.bf16_stochastic_round and name == "adafactor":
        raise UserError("bf16_stochastic_round: torch's Adafactor has no stochastic rounding. Fix: optimizer=adamw "
                        "(or adamw8bit / adamw4bit), or bf16_stochastic_round=false.")


def _optimizer_class(cfg):
    """(class, kwargs beyond lr and weight_decay) for `cfg.optimizer`."""
    adam = {"betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon}
    if cfg.optimizer == "adafactor":
        return torch.optim.Adafactor, {}
    if cfg.optimizer in TORCHAO:
        return getattr(_torchao_optim(), TORCHAO[cfg.optimizer]), {
            **adam, "bf16_stochastic_round": cfg.bf16_stochastic_round}
    if cfg.bf16_stochastic_round:
        from torchao.optim.adam import _AdamW

        return _AdamW, {**adam, "bf16_stochastic_round": True}
    return torch.optim.AdamW, adam


def build_optimizer(cfg, params: list[nn.Parameter], partial: PartialGradients | None = None):
    """The run's optimizer (the loop sets each step's LR from the schedule): one over every parameter,
    `InBackward` (one per parameter, stepped by gradient hooks; `partial`: the model's chunked-recompute flag),
    or torchao's CPU offload wrapper."""
    cls, kwargs = _optimizer_class(cfg)
    if cfg.optimizer_in_backward and cfg.optimizer_offload != "cpu":
        return InBackward(params, cls, dict(kwargs, lr=cfg.learning_rate), cfg.weight_decay, cfg.max_grad_norm,
                          partial)
    groups = decay_groups(params, cfg.weight_decay)
    if cfg.optimizer_offload == "cpu":
        return Offloaded(_torchao_optim().CPUOffloadOptimizer(groups, cls, offload_gradients=True,
                                                              lr=cfg.learning_rate, **kwargs), partial)
    return cls(groups, lr=cfg.learning_rate, **kwargs)


class Offloaded:
    """torchao's `CPUOffloadOptimizer` (`offload_gradients=True`) as the loop needs it.

    - Its gradient hook copies each parameter's gradient to the host and frees it, so a second gradient of the
      same backward would overwrite the first: a chunked recompute's partial gradients (`PartialGradients`) are
      therefore added without firing hooks (`hookless`, as under DDP), and the hook sees each complete gradient
      once.
    - The large parameters' gradients live on the host once the backward ends (the device holds none), so
      `clip_grad_norm` clips there: the global norm over the host gradients and the small parameters' device
      gradients, as `torch.nn.utils.clip_grad_norm_` computes it over the whole model.
    - `state`: each device parameter's state (held on the host for the large ones), as any optimizer's.
    """

    def __init__(self, inner, partial: PartialGradients | None = None):
        self.inner = inner
        if partial is not None:
            partial.hookless = True

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        small = self.inner.d_opt.state if self.inner.d_opt is not None else {}
        return {**{p: opt.state[self.inner.param_d2h_map[p]] for p, opt in self.inner.optim_dict.items()
                   if self.inner.param_d2h_map[p] in opt.state}, **small}

    def gradients(self) -> list[torch.Tensor]:
        """Every gradient of this step, where it is now: the host copies of the large parameters' (once their
        transfers are done) and the small parameters' on the device."""
        host = []
        for p, done in self.inner.queue.items():
            done.synchronize()
            host.append(self.inner.param_d2h_map[p].grad)
        small = [p.grad for g in self.inner.d_param_groups for p in g["params"] if p.grad is not None]
        return host + small

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient of the step to a global norm of `max_norm` (0: no clipping); the norm before."""
        return clip_grads(self.gradients(), max_norm)

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """The states, and the host copies brought to the device parameters: torchao copies each parameter to the
        host once, when it is built, and each step writes the host copy back, so a resume (the model loaded first,
        `training.checkpoint.load_checkpoint`) would otherwise go on from the weights before the checkpoint."""
        self.inner.load_state_dict(state)
        with torch.no_grad():
            for p, host in self.inner.param_d2h_map.items():
                host.copy_(p.detach())


def clip_grads(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over gradients that may sit on several devices (the host and a GPU):
    each device's sum of squares in float32, the global norm on the host, every gradient scaled in place by
    min(1, max_norm / (norm + 1e-6)) (0: none). Returns the norm before clipping."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    squares = [torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in gs]).square().sum()
               .cpu() for gs in by_device.values()]
    norm = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.device))
    return norm


class InBackward:
    """One optimizer per parameter, each stepped from its parameter's post-accumulate-grad hook; the
    gradient is clipped by its own norm to its share of `max_grad_norm` (0: no clipping; module doc)
    and freed right after.

    Looks like an optimizer to the loop: `param_groups` (every per-parameter group: setting "lr" there
    sets it everywhere), `step()` and `zero_grad()` (no-ops: the work happened in backward),
    `state_dict()` / `load_state_dict()` (the per-parameter optimizers' states, in parameter order), and
    `grad_norm()`: the global norm of the gradients seen since the last call, before clipping.
    """

    def __init__(self, params: list[nn.Parameter], cls, kwargs: dict, weight_decay: float, max_grad_norm: float,
                 partial: PartialGradients | None = None):
        self.params = list(params)
        self.partial = partial if partial is not None else PartialGradients()  # never raised: no chunked recompute
        self.optimizers = [cls([{"params": [p], "weight_decay": weight_decay if p.ndim >= 2 else 0.0}], **kwargs)
                           for p in self.params]
        self.max_grad_norm = max_grad_norm
        self._share_bounds()
        self._sq_norm: torch.Tensor | None = None  # on the device: no host sync per parameter
        self.largest_grad_bytes = 0  # the largest gradient held at once (what the bench reports)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(opt)) for p, opt in
                         zip(self.params, self.optimizers)]

    def _share_bounds(self) -> None:
        """Each parameter's clip bound: its share of `max_grad_norm` by size (module doc)."""
        total = sum(p.numel() for p in self.params)
        self.bounds = {id(p): self.max_grad_norm * (p.numel() / total) ** 0.5 for p in self.params}

    def drop(self, params: list[nn.Parameter]) -> None:
        """Stop optimizing `params` (their optimizers, states and hooks go); the clip bounds are shared out again
        over what is left."""
        ids = {id(p) for p in params}
        keep = [i for i, p in enumerate(self.params) if id(p) not in ids]
        for i in set(range(len(self.params))) - set(keep):
            self._handles[i].remove()
        self.params, self.optimizers, self._handles = ([xs[i] for i in keep] for xs in (
            self.params, self.optimizers, self._handles))
        self._share_bounds()

    def _hook(self, optimizer):
        def step(p: torch.Tensor) -> None:
            bound = self.bounds[id(p)]
            # None: RevFFN's stack Function hands its parameters an undefined gradient after its backward
            # already stepped and freed them block by block; partial: a chunked recompute has more to add
            if p.grad is None or self.partial.active():
                return
            norm = p.grad.detach().float().norm()
            self.largest_grad_bytes = max(self.largest_grad_bytes, p.grad.numel() * p.grad.element_size())
            self._sq_norm = norm.square() if self._sq_norm is None else self._sq_norm + norm.square()
            if bound > 0:
                p.grad.mul_(torch.clamp(bound / (norm + 1e-6), max=1.0).to(p.grad.dtype))
            optimizer.step()
            p.grad = None
        return step

    @property
    def param_groups(self) -> list[dict]:
        """Every per-parameter optimizer's groups (read afresh: `load_state_dict` replaces them)."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def grad_norm(self) -> torch.Tensor:
        norm = torch.zeros(()) if self._sq_norm is None else self._sq_norm.sqrt()
        self._sq_norm = None
        return norm

    def step(self) -> None:
        """Nothing left: every parameter was stepped in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing left: every gradient was freed in backward."""

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def state_dict(self) -> dict:
        return {"in_backward": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        if "in_backward" not in state or len(state["in_backward"]) != len(self.optimizers):
            raise UserError("resume: the checkpoint's optimizer state was not saved with optimizer_in_backward: true "
                            "(or for other parameters). Fix: resume with the optimizer settings it was saved with.")
        for opt, s in zip(self.optimizers, state["in_backward"]):
            opt.load_state_dict(s)


def drop_parameters(optimizer, params: list[nn.Parameter]) -> None:
    """Take `params` out of `optimizer` (their groups' entries and their states): a method removed them from the
    model (RevFFN's folded adapters), so their memory goes with them."""
    if isinstance(optimizer, InBackward):
        optimizer.drop(params)
        return
    ids = {id(p) for p in params}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in ids]
    for p in params:
        optimizer.state.pop(p, None)
