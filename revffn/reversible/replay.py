"""State that the backward recomputation must replay exactly: routing, RNG, autocast.

The reversible backward re-runs each sub-block on an input *rebuilt* from the layer's output.
The rebuilt input equals the original only up to float rounding, so anything discrete that the
sub-block decides from its input can flip. For MoE that is the router's top-k: a token whose two
best experts are within rounding of each other could be sent to a different expert on the rebuilt
input, and its gradient would then belong to a different function. HF Reformer solves the same
problem for its LSH buckets by reusing them; we record the router's top-k indices in forward and
reuse them in backward, while the routing *weights* are gathered afresh, so they stay
differentiable.

Recording is architecture-agnostic: a `TorchFunctionMode` active only inside the router module
intercepts `torch.topk` (and `Tensor.topk`). Every HF router we support (softmax top-k, sigmoid
group-limited top-k) selects experts with `topk`, so the same code serves them all.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_TOPK = (torch.topk, torch.Tensor.topk)


def compact_index_dtype(n: int) -> torch.dtype:
    """The smallest integer dtype that holds indices in [0, n)."""
    if n <= 256:
        return torch.uint8
    if n <= 32768:
        return torch.int16
    return torch.int32


class _TopKMode(TorchFunctionMode):
    def __init__(self, tap: RouterTap):
        super().__init__()
        self.tap = tap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TOPK:
            return self.tap._topk(func, args, kwargs)
        return func(*args, **kwargs)


class RouterTap:
    """Hooks on one HF router module: record or replay its top-k choices, and tap its logits.

    Modes (set by the reversible stack, `None` outside it):
      - ``"record"``: run top-k normally and append the indices, compactly typed, to `records`.
      - ``"replay"``: return the recorded indices (in call order) and ``input.gather(indices)``
        as values, so the weights stay differentiable; optionally count would-be flips.
    `logits` holds the router's most recent logits (output index `logits_index`), for the
    load-balancing loss.
    """

    def __init__(self, router: nn.Module, num_experts: int, logits_index: int = 0):
        self.router = router
        self.index_dtype = compact_index_dtype(max(num_experts, 2))
        self.logits_index = logits_index
        self.mode: str | None = None
        self.records: list[torch.Tensor] = []
        self._cursor = 0
        self.track_flips = False
        self.flips: torch.Tensor | None = None  # tokens whose rebuilt top-k differs from the record
        self.logits: torch.Tensor | None = None
        self._mode_ctx: _TopKMode | None = None
        router.register_forward_pre_hook(self._enter)
        router.register_forward_hook(self._exit, always_call=True)

    # -- hooks -------------------------------------------------------------------------------
    def _enter(self, module, args):
        if self.mode is not None:
            self._mode_ctx = _TopKMode(self)
            self._mode_ctx.__enter__()

    def _exit(self, module, args, output):
        if self._mode_ctx is not None:
            self._mode_ctx.__exit__(None, None, None)
            self._mode_ctx = None
        out = output[self.logits_index] if isinstance(output, tuple) else output
        self.logits = out

    # -- top-k ---------------------------------------------------------------------------------
    def _topk(self, func, args, kwargs):
        if self.mode == "record":
            values, indices = func(*args, **kwargs)
            self.records.append(indices.to(self.index_dtype))
            return torch.return_types.topk((values, indices))
        # replay
        source = args[0]
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        indices = self.records[self._cursor].long()
        self._cursor += 1
        if self.track_flips:
            with torch.no_grad():
                fresh = func(*args, **kwargs)[1]
                differs = (fresh.sort(dim).values != indices.sort(dim).values).any(dim)
                count = differs.sum()
                self.flips = count if self.flips is None else self.flips + count
        return torch.return_types.topk((source.gather(dim, indices), indices))

    # -- control ---------------------------------------------------------------------------------
    def start(self, mode: str | None, records: list[torch.Tensor] | None = None) -> None:
        self.mode = mode
        self.records = [] if records is None else list(records)
        self._cursor = 0
        self.logits = None

    def take_records(self) -> list[torch.Tensor]:
        records, self.records = self.records, []
        return records


def record_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# -- RNG ---------------------------------------------------------------------------------------
@dataclass
class RNGState:
    """CPU (and, on CUDA, the current device's) RNG state before a sub-block ran."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: int | None

    @classmethod
    def capture(cls, device: torch.device) -> RNGState:
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            return cls(torch.get_rng_state(), torch.cuda.get_rng_state(idx), idx)
        return cls(torch.get_rng_state(), None, None)

    def tensors(self) -> list[torch.Tensor]:
        return [self.cpu] if self.cuda is None else [self.cpu, self.cuda]

    @contextlib.contextmanager
    def replay(self):
        """Run the body with this RNG state, leaving the global RNG untouched afterwards."""
        devices = [] if self.device is None else [self.device]
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


# -- autocast --------------------------------------------------------------------------------
@dataclass(frozen=True)
class AutocastState:
    """Autocast as it was when the forward ran; re-applied inside every sub-block call."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def capture(cls, device: torch.device) -> AutocastState:
        dt = device.type
        return cls(dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))

    def __call__(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=True)
