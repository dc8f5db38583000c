"""State that the backward recomputation must replay exactly: choices, RNG, autocast.

The reversible backward re-runs each sub-block on an input *rebuilt* from the layer's output.
The rebuilt input equals the original only up to float rounding, so anything discrete that the
sub-block decides from its input can flip. For MoE that is the router's top-k: a token whose two
best experts are within rounding of each other could be sent to a different expert on the rebuilt
input, and its gradient would then belong to a different function. The same holds for a sparse-
attention indexer's top-k over keys, a `max(dim)` sparse mixer, an `argsort` of scores. HF Reformer
solves this for its LSH buckets by reusing them; we record the indices of every index-choosing op
a sub-block makes on values in forward and reuse them in backward, while the chosen *values* are
gathered afresh from the recomputed input, so they stay differentiable.

Recording needs no router path and no list of architectures: a `TorchFunctionMode` is active
around each whole F and G call (`recording` in forward, `replaying` in backward) and intercepts,
in call order, `topk`, `sort`, `argsort`, `max`/`min` with a dim, `argmax`/`argmin` and
`multinomial` (function and method forms) on floating-point inputs. Integer inputs (sorting expert
ids, counting tokens) are not choices on values: they follow from the recorded ones.

RNG: a sub-block that draws random numbers (dropout, router jitter, any op) must draw the same
ones when the backward re-runs it. `RNGState` is read around each sub-block of the reversible
forward, and the state from before it is kept only where it drew (see its docstring).

`RouterTap` only keeps the router's latest logits, for the load-balancing loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# index-choosing op -> (name, kind). Kinds: "topk" and "sort" return (values, indices) along `dim`;
# "reduce" (max/min with a dim) returns (values, indices) with `dim` reduced; "arg" (argmax/argmin,
# argsort) returns indices; "sample" (multinomial) returns indices drawn from the RNG.
_KINDS = {"topk": "topk", "sort": "sort", "max": "reduce", "min": "reduce", "argmax": "arg", "argmin": "arg",
          "argsort": "arg", "multinomial": "sample"}
CHOICE_OPS = {f: (name, kind) for name, kind in _KINDS.items()
              for f in (getattr(torch, name), getattr(torch.Tensor, name))}
_DIM_AT = {"topk": 2, "sort": 1, "argsort": 1, "max": 1, "min": 1, "argmax": 1, "argmin": 1}  # positional index of dim
_DIM_DEFAULT = {"topk": -1, "sort": -1, "argsort": -1}  # max/min/argmax/argmin: None (no dim: not recorded / flat)


def compact_index_dtype(n: int) -> torch.dtype:
    """The smallest integer dtype that holds indices in [0, n)."""
    if n <= 256:
        return torch.uint8
    if n <= 32768:
        return torch.int16
    if n <= 2**31:
        return torch.int32
    return torch.int64


@dataclass(frozen=True)
class _Choice:
    """One intercepted call: which op, along which dim (None: over all elements), keepdim."""

    name: str
    kind: str
    dim: int | None
    keepdim: bool

    @classmethod
    def of(cls, func, args, kwargs) -> _Choice | None:
        """The choice `func(*args, **kwargs)` makes on values, or None when it makes none (not a
        choice op, an integer input, max/min without a dim or of two tensors, an `out=`)."""
        op = CHOICE_OPS.get(func)
        if op is None or not args or not torch.is_tensor(args[0]) or not args[0].is_floating_point() \
                or "out" in kwargs:
            return None
        name, kind = op
        if kind == "sample":
            return cls(name, kind, -1, True)
        at = _DIM_AT[name]
        dim = kwargs["dim"] if "dim" in kwargs else args[at] if len(args) > at else _DIM_DEFAULT.get(name)
        if dim is not None and not isinstance(dim, int):
            return None  # max(a, b) elementwise, or a named dim
        if dim is None and kind == "reduce":
            return None  # a full max/min returns a value, not an index
        keepdim = bool(kwargs.get("keepdim", args[2] if kind in ("reduce", "arg") and name != "argsort"
                                  and len(args) > 2 else False))
        return cls(name, kind, dim, keepdim)

    def within_rows(self, source: torch.Tensor) -> bool:
        """Whether the choice is made within each row of `source`'s leading dim (along another dim),
        so the indices of rows a..b are the choice on rows a..b alone (`SubBlockRecord.rows`). Not
        so for a choice over all elements, along the leading dim, or on a 1-D or 0-D input."""
        return self.dim is not None and source.dim() >= 2 and self.dim % source.dim() != 0

    def index_dtype(self, source: torch.Tensor) -> torch.dtype:
        n = source.numel() if self.dim is None else (source.shape[self.dim] if source.dim() else 1)
        return compact_index_dtype(max(n, 2))

    def indices(self, out) -> torch.Tensor:
        return out if self.kind in ("arg", "sample") else out[1]

    def replayed(self, source: torch.Tensor, indices: torch.Tensor):
        """The op's output with `indices` as its choice; chosen values are gathered from `source`."""
        if self.kind in ("arg", "sample"):
            return indices
        if source.dim() == 0:
            values = source
        elif self.kind == "reduce" and not self.keepdim:
            values = source.gather(self.dim, indices.unsqueeze(self.dim)).squeeze(self.dim)
        else:
            values = source.gather(self.dim, indices)
        return getattr(torch.return_types, self.name)((values, indices))

    def differs(self, fresh: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
        """How many choices (rows along `dim`; elements for max/min/argmax) `fresh` makes differently."""
        if self.kind in ("reduce",) or self.name in ("argmax", "argmin") or fresh.dim() == 0:
            return (fresh != recorded).sum()
        if self.kind == "topk":  # the chosen set, not its order
            fresh, recorded = fresh.sort(self.dim).values, recorded.sort(self.dim).values
        return (fresh != recorded).any(self.dim).sum()


class _Record(TorchFunctionMode):
    """Run every choice op normally and append its indices, compactly typed, to `records` (and,
    with a list `within_rows`, whether it chose within rows: `_Choice.within_rows`)."""

    def __init__(self, records: list[torch.Tensor], within_rows: list[bool] | None = None):
        super().__init__()
        self.records, self.within_rows = records, within_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        choice = _Choice.of(func, args, kwargs)
        if choice is not None:
            self.records.append(choice.indices(out).detach().to(choice.index_dtype(args[0])))
            if self.within_rows is not None:
                self.within_rows.append(choice.within_rows(args[0]))
        return out


class _Replay(TorchFunctionMode):
    """Answer every choice op with the next record (in call order); the chosen values are gathered
    from the op's input, so they carry its gradient. `multinomial` still runs, so the RNG advances
    as it did in forward, but returns the recorded samples."""

    def __init__(self, records: list[torch.Tensor], track_flips: bool):
        super().__init__()
        self.records, self.cursor = records, 0
        self.track_flips = track_flips
        self.flips: torch.Tensor | int = 0  # choices the rebuilt input would have made differently

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        choice = _Choice.of(func, args, kwargs)
        if choice is None:
            return func(*args, **kwargs)
        if self.cursor >= len(self.records):
            raise RuntimeError(f"choice replay: the recomputation calls {choice.name} more often than the forward "
                               f"did ({len(self.records)} recorded); the sub-block is not a function of its input.")
        indices = self.records[self.cursor].long()
        self.cursor += 1
        if self.track_flips or choice.kind == "sample":
            with torch.no_grad():
                fresh = choice.indices(func(*args, **kwargs))
            if self.track_flips:
                self.flips = self.flips + choice.differs(fresh, indices)
        return choice.replayed(args[0], indices)


@contextlib.contextmanager
def recording_choices(within_rows: list[bool] | None = None) -> Iterator[list[torch.Tensor]]:
    """Record the indices of every choice op in the body; yields the list they are appended to.
    With a list `within_rows`, also append, per choice, whether it was made within each row of its
    input's leading dim (what lets a recomputation by chunks of rows replay a slice of it)."""
    records: list[torch.Tensor] = []
    with _Record(records, within_rows):
        yield records


@contextlib.contextmanager
def replaying_choices(records: list[torch.Tensor], track_flips: bool = False) -> Iterator[_Replay]:
    """Reuse `records` (from `recording_choices`) as the body's choices, in call order. With
    ``track_flips=True``, the yielded object's `flips` counts the choices the body would have made
    differently. Raises RuntimeError if the body does not consume exactly the records."""
    replay = _Replay(list(records), track_flips)
    with replay:
        yield replay
    if replay.cursor != len(replay.records):
        raise RuntimeError(f"choice replay: the recomputation made {replay.cursor} choices, the forward "
                           f"{len(replay.records)}; the sub-block is not a function of its input.")


@dataclass
class SubBlockRecord:
    """What one F or G call of the reversible forward must hand to its recomputation: its choices'
    indices (in call order) and, if it drew random numbers, the RNG state from before it ran.
    `within_rows` says, per choice, whether it was made within each row of its input's leading dim
    (`_Choice.within_rows`); an empty tuple (the default) claims it for none."""

    where: tuple[int, str]  # (layer_idx, "F" | "G")
    choices: list[torch.Tensor] = field(default_factory=list)
    rng: RNGState | None = None
    within_rows: tuple[bool, ...] = ()

    def tensors(self) -> list[torch.Tensor]:
        return [*self.choices, *(self.rng.tensors() if self.rng is not None else [])]

    def layout(self) -> tuple:
        """Everything but the tensors (those go through save_for_backward)."""
        return self.where, len(self.choices), None if self.rng is None else self.rng.slots(), self.within_rows

    @classmethod
    def from_layout(cls, layout: tuple, tensors: Iterator[torch.Tensor]) -> SubBlockRecord:
        """The inverse of (`layout()`, `tensors()`): takes this record's tensors from `tensors`."""
        where, n_choices, slots, within_rows = layout
        choices = [next(tensors) for _ in range(n_choices)]
        return cls(where, choices, None if slots is None else RNGState.from_slots(slots, tensors), within_rows)

    def splits_into_rows(self, n: int) -> bool:
        """Whether a recomputation on chunks of the `n` rows (the leading dim of the sub-block's
        flattened input) can replay this record chunk by chunk (`rows`): it drew no random numbers
        (a chunk would draw other ones than the whole did) and every choice was made within the
        rows of an input with `n` rows, so its indices' row i belongs to row i alone."""
        if self.rng is not None or len(self.within_rows) != len(self.choices):
            return False
        return all(within and c.dim() >= 1 and c.shape[0] == n for c, within in zip(self.choices, self.within_rows))

    def rows(self, rows: slice) -> SubBlockRecord:
        """The record of the recomputation on the input rows `rows` alone: each choice's rows
        (only when `splits_into_rows`: row slices of RNG state do not exist)."""
        return SubBlockRecord(self.where, [c[rows] for c in self.choices], None, self.within_rows)


class RouterTap:
    """A forward hook on one HF router module that keeps its latest logits (output index
    `logits_index`), for the load-balancing loss. Choices are recorded for the whole sub-block
    (`recording_choices`), not here."""

    def __init__(self, router: nn.Module, logits_index: int = 0, listening: bool = True):
        self.router = router
        self.logits_index = logits_index
        self.logits: torch.Tensor | None = None
        self.listening = listening  # False: calls pass unrecorded (see `listen`)
        self._handle = router.register_forward_hook(self._keep)

    def _keep(self, module, args, output):
        if self.listening:
            self.logits = output[self.logits_index] if isinstance(output, tuple) else output

    @contextlib.contextmanager
    def listen(self):
        """Record only inside: a tap that listens to every call would also keep the logits of a gradient
        checkpoint's recompute in backward, and with them that recomputed layer's whole graph, until the
        next forward (HF checkpointing under `CausalLM`: 290 MiB at the bench's act-heavy profile)."""
        self.listening = True
        try:
            yield
        finally:
            self.listening = False

    def take(self) -> torch.Tensor | None:
        """The logits of the router's last call since the previous `take()` (None if it was not
        called); drops the reference, so the sub-block's graph is not kept alive."""
        logits, self.logits = self.logits, None
        return logits

    def remove(self) -> None:
        """Detach the hook: the router then runs untouched and `logits` is no longer updated."""
        self._handle.remove()


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
