"""Progress with an ETA for the long operations (training, calibration, heal, convert, upcycle, archs, study, bench,
eval).

On a terminal it is a tqdm bar on stderr. On a log (stderr is not a TTY: CI, `nohup`, a captured run) it is one
line per update, `revffn: calibrate [12/60 passes, 20%]; 1m02s elapsed, ETA 4m08s`, at most one every
`every` seconds and none at all for work that ends before the first `every` seconds: a short command's output
stays its result alone. `bar=False` keeps the lines on a terminal too, and with `every=0` each update is a
line: the per-run results of bench, study and archs. `initial` is where resumed work starts (its ETA counts the
rate from there).

    with progress("calibrate", "pass") as bar:
        for i in range(n):
            ...
            bar(i + 1, n)            # done, total (the total may be given or change on any call), note=''
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

EVERY_S = 10.0


def clock(seconds: float) -> str:
    """62.4 -> '1m02s'; 3725 -> '1h02m'; 8.2 -> '8s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class LineProgress:
    """The log form: one line per update, throttled to one every `every` seconds, plus the last one."""

    def __init__(self, desc: str, unit: str, file: TextIO, every: float, now: Callable[[], float],
                 total: int | None = None, initial: int = 0):
        self.desc, self.file, self.every, self.now, self.total, self.initial = desc, file, every, now, total, initial
        self.units = unit + ("es" if unit.endswith(("s", "ch")) else "s")  # pass -> passes, batch -> batches
        self.start = self.last = now()
        self.printed = False
        self.pending: str | None = None

    def __call__(self, done: int, total: int | None = None, note: str = "") -> None:
        total = self.total = total if total is not None else self.total  # kept until another is given, as tqdm's
        t = self.now()
        elapsed = t - self.start
        count = f"{done}/{total} {self.units}, {100 * done / total:.0f}%" if total else f"{done} {self.units}"
        line = f"revffn: {self.desc} [{count}]" + (f" {note}" if note else "") + f"; {clock(elapsed)} elapsed"
        if total and self.initial < done < total:
            line += f", ETA {clock(elapsed / (done - self.initial) * (total - done))}"
        if t - self.last >= self.every or (total is not None and done >= total and self.printed):
            print(line, file=self.file, flush=True)
            self.last, self.printed, self.pending = t, True, None
        else:
            self.pending = line

    def close(self) -> None:
        """The last state when anything was printed and the final update was throttled away."""
        if self.printed and self.pending:
            print(self.pending, file=self.file, flush=True)


@contextlib.contextmanager
def progress(desc: str, unit: str, total: int | None = None, file: TextIO | None = None, every: float = EVERY_S,
             now: Callable[[], float] = time.monotonic, disable: bool = False,
             bar: bool = True, initial: int = 0) -> Iterator[Callable[..., None]]:
    """Yields update(done, total=None, note=''): a tqdm bar when `bar` and `file` (stderr by default) is a
    terminal, else `LineProgress`. `disable` yields a no-op (`--json` output)."""
    file = file if file is not None else sys.stderr
    if disable:
        yield lambda done, total=None, note="": None
        return
    if not (bar and getattr(file, "isatty", lambda: False)()):
        lines = LineProgress(desc, unit, file, every, now, total, initial)
        try:
            yield lines
        finally:
            lines.close()
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, initial=initial, desc=desc, unit=unit, file=file, dynamic_ncols=True) as tty:
        def update(done: int, total: int | None = None, note: str = "") -> None:
            if total is not None and total != tty.total:
                tty.total = total
                tty.refresh()
            if note:
                tty.set_postfix_str(note, refresh=False)
            tty.update(done - tty.n)

        yield update


class _KnownNoise(logging.Filter):
    """Third-party log lines that do not apply to a revffn command, dropped where they are logged: torchao's
    CUDA-only kernels (`torchao/_C*.so`) failing to load under a CPU build of torch, and torch's deprecation
    note on `register_constant` for Enum types (torchao registers its Enums at import; transformers imports
    torchao whenever it is installed). Installed by `cli.main` and `python -m revffn.reports.lm_eval_task` (the
    report workers' output is captured)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg.startswith("Failed to load") and "torchao" in msg and "/_C" in msg:
            import torch

            return torch.version.cuda is not None  # a CUDA build: the kernels could apply, so keep the line
        return "is an Enum subclass and is now natively supported by torch.compile" not in msg


def quiet_known_noise() -> None:
    """Install `_KnownNoise` on the loggers that emit it (idempotent)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownNoise) for f in logger.filters):
            logger.addFilter(_KnownNoise())


def library_bars_off() -> None:
    """transformers' own progress bars off for this process ("Loading weights" as any model loads, "Writing model
    shards" as one saves): revffn's progress line says what a command is doing, and such a bar ran into a
    command's output line. Installed by `cli.main`. transformers' switch turns off `huggingface_hub`'s download bars
    with its own; those are left as they were."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as hf_logging

    downloads_off = are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    if not downloads_off:
        enable_progress_bars()

