"""A tiny checkpointed run for the checkpoint, resume and privilege tests, and the helpers they share:

    trained = train_tiny(tmp / "run")     # 2 steps in this process: checkpoints/step-1, final/
    before = files_state(trained); ...; assert files_state(trained) == before   # nothing modified
"""

from __future__ import annotations

import os
from pathlib import Path

from revffn.training import loop
from revffn.training.config import load_config

TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 1, hidden_size: 32}", "data=builtin:reversal_train",
        "eval_data=null", "max_steps=2", "save_steps=1", "logging_steps=1", "per_device_train_batch_size=2",
        "max_seq_length=32", "dtype=float32", "device=cpu", "revffn.coupling=additive", "revffn.adapter_warmup_steps=1"]
BUFFERED = [o for o in TINY if not o.startswith("revffn.")] + ["revffn.coupling=buffered"]  # (no additive options)


def train_tiny(out: Path, *over: str, umask: int = 0o022, base: list[str] = TINY) -> Path:
    """Train `base` (TINY) into `out` under `umask` (restored after): the run's own umask must win over it."""
    before = os.umask(umask)
    try:
        loop.run(load_config(None, [*base, f"output_dir={out}", *over]))
    finally:
        os.umask(before)
    return out


def files_state(root: Path) -> dict[str, tuple[bytes, int, int]]:
    """{relative path: (bytes, mtime_ns, mode)} of every file and directory under `root`."""
    state = {}
    for p in sorted(Path(root).rglob("*")):
        st = p.stat()
        state[str(p.relative_to(root))] = (p.read_bytes() if p.is_file() else b"", st.st_mtime_ns, st.st_mode)
    return state


def flip_byte(path: Path, offset: int = -1) -> None:
    """Flip every bit of one byte (default the last: a safetensors file's tensor data, so it still loads)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
