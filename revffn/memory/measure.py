"""Measure memory: bytes saved for backward (saved_tensors_hooks), process peak RSS, CUDA peaks, in use now.

Saved bytes are counted per unique storage: a saved view keeps its whole storage alive, and a
tensor saved twice costs once. Parameters (and views of them) are excluded: they live anyway.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys

import torch

from revffn.errors import UserError


class SavedTensorLog:
    """Storages saved for backward while active; `bytes(exclude)` sums them."""

    def __init__(self, params=()):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.param_storages and ptr != 0:
            self.storages[ptr] = storage.nbytes()
        return t

    def bytes(self, exclude: set[int] = frozenset()) -> int:
        return sum(n for ptr, n in self.storages.items() if ptr not in exclude)

    def stack_bytes(self, stats: dict) -> int:
        """What a reversible stack keeps for its backward, from its `last_stack_stats`: the saved storages but the
        routing and RNG records' (reported apart), plus `held_bytes`, what it holds outside saved tensors (the
        buffered coupling's bit buffers, freed layer by layer)."""
        return self.bytes(stats.get("record_storages", set())) + stats.get("held_bytes", 0)

    @contextlib.contextmanager
    def hooks(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield


@contextlib.contextmanager
def saved_bytes_of_stack(model):
    """Log what the decoder stack of a `RevFFNForCausalLM` saves for backward (params excluded).

    Yields the log; after the forward, `log.stack_bytes(model.last_stack_stats)` gives the activation bytes
    without the records (choice indices and RNG states; their sizes are `last_stack_stats["record_bytes"]` and
    `["rng_bytes"]`).
    """
    log = SavedTensorLog(model.parameters())
    previous = model.debug.stack_scope
    model.debug.stack_scope = log.hooks
    try:
        yield log
    finally:
        model.debug.stack_scope = previous


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, at least the RSS now (Linux raises its high-water mark lazily,
    when memory is unmapped, so the RSS now can be above it).

    On Linux the high-water mark of the process's own memory (`VmHWM` in /proc/self/status), not getrusage's
    ru_maxrss: at exec the kernel keeps the peak of the memory the process had before, which for a child started
    by fork (or vfork) + exec, as Python's subprocess starts one, is its parent's, so a child of a process holding a
    model reported that process's size (stop 50: every row of a conversion table, 8.1 GiB on the MoE). Elsewhere
    ru_maxrss (macOS reports bytes)."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        peak = kib * 1024
    except (OSError, StopIteration, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024
    return max(peak, current_rss_bytes())


def current_rss_bytes() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def reset_rss_peak() -> bool:
    """Start a new RSS peak: Linux's high-water mark set to the RSS now (`/proc/self/clear_refs` "5", Linux 4.0+),
    so that `peak_rss_bytes` then covers what follows only, as CUDA's peak after `reset_peak_memory_stats`. False
    where the kernel does not allow it: the peak is then the process's since its start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak for `peak_memory_bytes`: CUDA's allocator statistics on GPU, the RSS high-water mark on CPU
    (`reset_rss_peak`; False where the kernel does not allow it, and the peak is then the process's since start)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    return reset_rss_peak()


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def memory_in_use_bytes(device: torch.device) -> int:
    """CUDA memory allocated now on GPU, process RSS now on CPU (what a leak raises step after step)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return current_rss_bytes()


def free_memory_bytes(device: torch.device) -> int:
    """What an allocation on `device` can still take: CUDA's free memory, or the host's available memory plus its
    free swap, capped by the room under this process's cgroup memory limit (a container's, a Slurm job's), where
    it has one: psutil reads the host's /proc/meminfo."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    host = psutil.virtual_memory().available + psutil.swap_memory().free
    room = cgroup_room()
    return host if room is None else min(host, room)


def cgroup_room(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The bytes this process's cgroups still allow, the tightest of its own and its ancestors' limits; the page
    cache they may reclaim (inactive files) counts as room. None where no limit applies (no cgroup, `max`, v1's
    unlimited). cgroup v2 (`memory.max`, `memory.current`, `memory.stat`) and v1's memory controller."""
    from pathlib import Path

    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            names, base = ("memory.max", "memory.current", "inactive_file"), Path(root)
        elif "memory" in controllers.split(","):
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            base = Path(root) / "memory"
        else:
            continue
        d = base / path.strip("/")
        while True:
            try:
                limit = (d / names[0]).read_text().strip()
                if limit != "max" and int(limit) < 2**60:  # v1 writes "unlimited" as a huge number
                    stat = dict(x.split() for x in (d / "memory.stat").read_text().splitlines() if x.count(" ") == 1)
                    rooms.append(int(limit) - int((d / names[1]).read_text()) + int(stat.get(names[2], 0)))
            except (OSError, ValueError):
                pass
            if d == base or base not in d.parents:
                break
            d = d.parent
    return max(0, min(rooms)) if rooms else None


def refuse_beyond_free(needed: int, device: torch.device, what: str, fix: str) -> None:
    """Refuse work that needs at least `needed` bytes on `device` where less is free, before it allocates: past
    the host's memory the kernel's OOM killer ends the process without a word (and a GPU's OutOfMemoryError comes
    only after minutes of work).

    Raises:
        UserError: naming `what` (the flag, and what it needs) and `fix`.
    """
    free = free_memory_bytes(device)
    if needed > free:
        where = "on the GPU" if device.type == "cuda" else "in host memory (swap included)"
        raise UserError(f"{what} needs at least {needed / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB are free {where}. "
                        f"Nothing was written. Fix: {fix}.")
