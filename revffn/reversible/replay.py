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

RNG: a sub-block that draws random numbers (dropout, router jitter, any op) must draw the same
ones when the backward re-runs it. `RNGState` is read around each sub-block of the reversible
forward, and the state from before it is kept only where it drew (see its docstring).
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
    """The state of the generators one sub-block drew from, taken before it ran.

    A field is None when its generator is not recorded: `capture` takes both the CPU generator's
    state (`cpu`, 5056 bytes of mt19937) and, for a CUDA stream, its device's (`cuda`, 16 bytes:
    seed and Philox offset); `used_since` keeps only the ones that have moved since. No list of
    stochastic ops or config keys is involved: dropout, router jitter, a sampling router or any
    future op draws from these generators, and drawing always moves their state. Reading and
    comparing a state draws nothing, so watching does not change the random stream.

    Not seen: an op given its own `torch.Generator`, or a generator of another device than the
    stream's.
    """

    cpu: torch.Tensor | None
    cuda: torch.Tensor | None
    device: int | None  # the CUDA device index, or None on CPU

    @classmethod
    def capture(cls, device: torch.device) -> RNGState:
        """The CPU generator's state and, for a CUDA `device`, that device's."""
        if device.type != "cuda":
            return cls._now(None)
        return cls._now(device.index if device.index is not None else torch.cuda.current_device())

    @classmethod
    def _now(cls, idx: int | None) -> RNGState:
        return cls(torch.get_rng_state(), None if idx is None else torch.cuda.get_rng_state(idx), idx)

    def used_since(self) -> RNGState | None:
        """This state (from `capture`) restricted to the generators that have moved since it was
        taken; None when none has, i.e. no random number was drawn in between."""
        now = RNGState._now(self.device)
        cpu = None if torch.equal(self.cpu, now.cpu) else self.cpu
        cuda = None if self.cuda is None or torch.equal(self.cuda, now.cuda) else self.cuda
        return None if cpu is None and cuda is None else RNGState(cpu, cuda, self.device)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.cpu, self.cuda) if t is not None]

    def slots(self) -> tuple[bool, bool, int | None]:
        """Which generators are recorded, without the tensors (those go through save_for_backward)."""
        return self.cpu is not None, self.cuda is not None, self.device

    @classmethod
    def from_slots(cls, slots: tuple[bool, bool, int | None], tensors: Iterator[torch.Tensor]) -> RNGState:
        """The inverse of (`slots()`, `tensors()`): takes this state's tensors from `tensors`."""
        has_cpu, has_cuda, device = slots
        return cls(next(tensors) if has_cpu else None, next(tensors) if has_cuda else None, device)

    @contextlib.contextmanager
    def replay(self):
        """Run the body with the recorded generators set to this state; on exit every generator is
        back where it was (`torch.random.fork_rng`), so the global RNG is untouched."""
        with torch.random.fork_rng(devices=[] if self.cuda is None else [self.device]):
            if self.cpu is not None:
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
