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
from collections.abc import Iterator
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


class RouterTap:
    """Hooks on one HF router module: record or replay its top-k choices, and tap its logits.

    The reversible stack drives it with two context managers; outside both the tap only keeps
    `logits`, the router's most recent logits (output index `logits_index`), for the
    load-balancing loss:

      - ``with tap.recording() as records:`` top-k runs normally; its indices, compactly typed,
        are appended to `records` in call order.
      - ``with tap.replaying(records) as replay:`` top-k returns the recorded indices (in call order)
        and ``input.gather(dim, indices)`` as values, so the routing weights stay differentiable.
        With ``track_flips=True``, `replay.flips` counts the tokens whose fresh top-k on the
        rebuilt input differs from the record.

    The `TorchFunctionMode` that intercepts `topk` is entered by the router's forward pre-hook and
    left by its forward hook (registered with ``always_call=True``, so an exception inside the
    router still leaves it), and only while one of the two contexts is active: the interception
    is scoped to this router's call. `remove()` detaches both hooks.
    """

    def __init__(self, router: nn.Module, num_experts: int, logits_index: int = 0):
        self.router = router
        self.index_dtype = compact_index_dtype(max(num_experts, 2))
        self.logits_index = logits_index
        self.logits: torch.Tensor | None = None
        self._session: _Record | _Replay | None = None  # set by recording() / replaying()
        self._entered = False  # the session's mode is on the torch-function stack (inside the router)
        self._handles = (router.register_forward_pre_hook(self._enter),
                         router.register_forward_hook(self._exit, always_call=True))

    # -- contexts ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Record the router's top-k indices; yields the list they are appended to."""
        session = _Record(self.index_dtype)
        with self._active(session):
            yield session.records

    @contextlib.contextmanager
    def replaying(self, records: list[torch.Tensor], track_flips: bool = False) -> Iterator[_Replay]:
        """Reuse `records` (from `recording()`) as the router's top-k indices, in call order."""
        session = _Replay(list(records), track_flips)
        with self._active(session):
            yield session

    @contextlib.contextmanager
    def _active(self, session):
        if self._session is not None:
            raise RuntimeError("RouterTap: already recording or replaying; the contexts do not nest.")
        self._session, self.logits = session, None  # logits of an earlier call are stale here
        try:
            yield
        finally:
            self._session, self.logits = None, None  # the logits' graph is the block's: do not keep it alive

    def remove(self) -> None:
        """Detach both hooks: the router then runs untouched and `logits` is no longer updated."""
        for handle in self._handles:
            handle.remove()

    # -- hooks -------------------------------------------------------------------------------------
    def _enter(self, module, args):
        if self._session is not None:
            self._session.__enter__()
            self._entered = True

    def _exit(self, module, args, output):
        if self._entered:  # also runs when the router raised (always_call=True)
            self._entered = False
            self._session.__exit__(None, None, None)
        out = output[self.logits_index] if isinstance(output, tuple) else output
        self.logits = out


class _Record(TorchFunctionMode):
    """Inside the router: run `topk` and keep its indices."""

    def __init__(self, index_dtype: torch.dtype):
        super().__init__()
        self.index_dtype = index_dtype
        self.records: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _TOPK:
            return func(*args, **kwargs)
        values, indices = func(*args, **kwargs)
        self.records.append(indices.to(self.index_dtype))
        return torch.return_types.topk((values, indices))


class _Replay(TorchFunctionMode):
    """Inside the router: answer `topk` with the next record; the values are gathered from the
    input, so they carry its gradient."""

    def __init__(self, records: list[torch.Tensor], track_flips: bool):
        super().__init__()
        self.records, self.cursor = records, 0
        self.track_flips = track_flips
        self.flips: torch.Tensor | int = 0  # tokens whose fresh top-k differs from the record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _TOPK:
            return func(*args, **kwargs)
        source = args[0]
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        indices = self.records[self.cursor].long()
        self.cursor += 1
        if self.track_flips:
            with torch.no_grad():
                fresh = func(*args, **kwargs)[1]
                differs = (fresh.sort(dim).values != indices.sort(dim).values).any(dim)
                self.flips = self.flips + differs.sum()
        return torch.return_types.topk((source.gather(dim, indices), indices))


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
