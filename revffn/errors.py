"""User-facing errors.

`UserError` is bad input: a config key, a file, a model directory. The CLI prints its message
once and exits with code 2. Every message names where the problem is (file:line or the config
key), the bad value, and the fix.
"""

from __future__ import annotations

import difflib


class UserError(Exception):
    """Bad input. The CLI prints it and exits with code 2; nothing has been written."""

    exit_code = 2


class DiskFull(UserError):
    """No room to write (ENOSPC, EFBIG under a file-size limit, EDQUOT): one line, exit 1 (the input was fine);
    what was being written is removed, what was there before is kept."""

    exit_code = 1


DISK_ERRNOS = {28: "no space left on the device", 27: "file too large for the file-size limit (ulimit -f)",
               122: "disk quota exceeded"}
DISK_MESSAGES = {"no space left": 28, "file too large": 27, "quota exceeded": 122, "os error 28": 28,
                 "os error 27": 27, "os error 122": 122, "unexpected pos": 0}  # the last: torch.save's short write


def disk_fault(error: BaseException) -> str | None:
    """Why `error` is the disk refusing a write (see DISK_ERRNOS), or None when it is something else."""
    for e in (error, error.__cause__, error.__context__):
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return DISK_ERRNOS[e.errno]
        text = str(e).lower() if e is not None else ""
        for needle, code in DISK_MESSAGES.items():
            if needle in text:
                return DISK_ERRNOS.get(code, "a write came up short (no space, or the file-size limit)")
    return None


def one_line(error: BaseException | str) -> str:
    """An exception's message (or a text) on one line: the first non-empty line, for a one-line error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def unread(setting: str, reads: str, has: str, fix: str, written: bool = True) -> str:
    """The message for a setting that the rest of the input leaves unread: `setting: read only with READS, and
    HAS: it would change nothing. Fix: FIX.` (`written=False` adds that nothing was written)."""
    return (f"{setting}: read only with {reads}, and {has}: it would change nothing."
            f"{'' if written else ' Nothing was written.'} Fix: {fix}.")


def closest(word: str, choices) -> str:
    """A ' Did you mean X?' suffix, or '' when nothing is close."""
    name, colon, value = word.partition(":")
    if colon and name in set(choices):  # YAML's flow mapping {a:1}, no space after the colon: one key "a:1"
        return f" YAML reads {word!r}, with no space after the colon, as one key: write `{name}: {value}`."
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {match[0]!r}?" if match else ""
