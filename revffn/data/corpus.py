"""Offline English text corpus: docstrings of Python's standard library.

Used to train the shipped tokenizer (`scripts/build_tokenizer.py`) and reusable as a small,
always-available pretraining corpus. Nothing is downloaded: the text comes from the modules of
the running interpreter, walked in a fixed order, so the result is deterministic for a given
Python version.
"""

from __future__ import annotations

import importlib
import inspect

# Fixed, sorted list of pure-documentation-rich stdlib modules. Modules with import side effects
# (this, antigravity, turtle, tkinter, idlelib) are deliberately absent.
STDLIB_MODULES: tuple[str, ...] = (
    "abc", "argparse", "array", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "dis", "email.message", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools",
    "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html.parser",
    "http.client", "http.server", "imaplib", "inspect", "io", "ipaddress", "itertools", "json",
    "logging", "mailbox", "math", "mimetypes", "numbers", "operator", "optparse", "os", "pathlib",
    "pdb", "pickle", "pkgutil", "platform", "poplib", "pprint", "queue", "random", "re", "sched",
    "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "trace", "traceback", "types", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "zipfile",
)


def _module_docs(name: str) -> list[str]:
    """The module docstring and those of its public classes, functions and methods, in name order."""
    try:
        module = importlib.import_module(name)
    except Exception:  # an optional C extension may be missing on some builds; skip the module
        return []
    docs = [inspect.getdoc(module) or ""]
    for attr in sorted(vars(module)):
        obj = getattr(module, attr)
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue  # private, or re-exported from another module (counted there)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for meth in sorted(vars(obj)):
                if not meth.startswith("_") and inspect.isfunction(vars(obj)[meth]):
                    docs.append(inspect.getdoc(vars(obj)[meth]) or "")
    return docs


def python_doc_corpus(max_chars: int = 2_000_000) -> list[str]:
    """Distinct stdlib docstrings (one per list item), in a fixed order, up to `max_chars` in total."""
    out: list[str] = []
    seen: set[str] = set()
    total = 0
    for name in STDLIB_MODULES:
        for doc in _module_docs(name):
            doc = doc.strip()
            # Very short docstrings ("Return self.") add repetition, not language.
            if len(doc) < 40 or doc in seen:
                continue
            seen.add(doc)
            if total + len(doc) > max_chars:
                return out
            out.append(doc)
            total += len(doc)
    return out
