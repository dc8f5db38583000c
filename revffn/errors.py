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


def one_line(error: BaseException | str) -> str:
    """An exception's message (or a text) on one line: the first non-empty line, for a one-line error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def closest(word: str, choices) -> str:
    """A ' Did you mean X?' suffix, or '' when nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {match[0]!r}?" if match else ""
