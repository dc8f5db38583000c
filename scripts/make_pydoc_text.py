"""Write `builtin:pydoc_text`: held-out English text for loss evaluation of a real pretrained model,
`builtin:pydoc_calibration`: the rest of the same manual, real text to calibrate a conversion on, and
`builtin:stdlib_text`: the standard library's docstrings, the default calibration text (`revffn.calibration_data`).

    python scripts/make_pydoc_text.py          # rewrites both in revffn/assets/data/ (Python 3.11)
    revffn eval builtin:smollm2 --data builtin:pydoc_text
    revffn convert builtin:smollm2 --calibration-data builtin:pydoc_calibration --eval-data builtin:pydoc_text

The text is the Python reference manual's help topics that ship with the interpreter
(`pydoc_data.topics.topics`, the text `help("with")` prints), nothing downloaded. A web-trained model
has seen the same manual as HTML pages, but not this plain-text rendering of it, cut at these
boundaries. The topics, in name order, are cut at paragraph breaks into pieces of at most
`MAX_CHARS` characters (`corpus.chunk_text`); `N_DOCS` of the distinct ones with at least `MIN_CHARS`, evenly
spaced over the whole manual, become `{"text": ...}` records, the format of `builtin:retention_test`.
About 900 characters is ~220 SmolLM2 tokens and ~330 tokens of the shipped tokenizer, under
`revffn eval`'s default `--max-seq-length 512` for both; 64 documents keep a 135M model's loss pass
around a minute on 2 CPU cores.

Deterministic for a given Python version (the topics change between versions);
`tests/scripts/test_assets.py` checks the shipped file on Python 3.11. Unlike for SmolLM2, this is
not held-out text for `builtin:base`: its pretraining corpus holds the same topics in 600-character
pieces (`corpus.pretraining_corpus`), so its figure here is no held-out loss (docs/base.md).

`builtin:pydoc_calibration` is every other distinct piece (none of the evaluation's): disjoint text, but the
same manual, so a conversion calibrated on it is calibrated in the evaluation's domain (docs/conversion.md
reports it beside text sampled from the model itself).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from corpus import chunk_text, python_doc_corpus, python_reference_corpus

DATA_DIR = Path(__file__).resolve().parent.parent / "revffn" / "assets" / "data"
DEFAULT_OUT = DATA_DIR / "pydoc_text.jsonl"
CALIBRATION_OUT = DATA_DIR / "pydoc_calibration.jsonl"
STDLIB_OUT = DATA_DIR / "stdlib_text.jsonl"
STDLIB_MIN_CHARS = 200  # docstrings are shorter than the manual's topics
N_DOCS = 64
MAX_CHARS = 1000
MIN_CHARS = 400  # shorter pieces are mostly headings and grammar snippets


def _pieces(max_chars: int) -> list[str]:
    pieces = chunk_text(python_reference_corpus(), max_chars=max_chars)
    return [p for p in dict.fromkeys(pieces) if len(p) >= MIN_CHARS]  # distinct: some topics share paragraphs


def pydoc_text(n_docs: int = N_DOCS, max_chars: int = MAX_CHARS) -> list[str]:
    """`n_docs` pieces of the reference manual, evenly spaced over its pieces of `MIN_CHARS` to `max_chars`
    characters in topic-name order."""
    pieces = _pieces(max_chars)
    if len(pieces) < n_docs:
        raise ValueError(f"only {len(pieces)} pieces of {MIN_CHARS} to {max_chars} characters; asked for {n_docs}")
    return [pieces[i * len(pieces) // n_docs] for i in range(n_docs)]


def pydoc_calibration(n_docs: int = N_DOCS, max_chars: int = MAX_CHARS) -> list[str]:
    """Every piece `pydoc_text` does not take, in the same order."""
    held_out = set(pydoc_text(n_docs, max_chars))
    return [p for p in _pieces(max_chars) if p not in held_out]


def stdlib_text(max_chars: int = MAX_CHARS) -> list[str]:
    """The docstrings of `corpus.STDLIB_MODULES` (`corpus.python_doc_corpus`: the modules' own text, not the
    reference manual's), cut like the manual into distinct pieces of `STDLIB_MIN_CHARS` to `max_chars` characters;
    none contains or is contained in a piece of `pydoc_text` (checked by tests/scripts/test_assets.py)."""
    pieces = chunk_text(python_doc_corpus(), max_chars=max_chars)
    return [p for p in dict.fromkeys(pieces) if len(p) >= STDLIB_MIN_CHARS]


def render(docs: list[str]) -> str:
    """The JSONL text of the asset: one `{"text": ...}` per line, as `retention_test.jsonl`."""
    return "".join(json.dumps({"text": d}) + "\n" for d in docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output file (default: %(default)s)")
    parser.add_argument("--n-docs", type=int, default=N_DOCS)
    parser.add_argument("--calibration-out", default=str(CALIBRATION_OUT), help="default: %(default)s")
    args = parser.parse_args()
    docs = pydoc_text(args.n_docs)
    Path(args.out).write_text(render(docs), encoding="utf-8")
    print(f"wrote {args.out}: {len(docs)} documents, {sum(map(len, docs))} characters")
    calibration = pydoc_calibration(args.n_docs)
    Path(args.calibration_out).write_text(render(calibration), encoding="utf-8")
    print(f"wrote {args.calibration_out}: {len(calibration)} documents, {sum(map(len, calibration))} characters")
    stdlib = stdlib_text()
    STDLIB_OUT.write_text(render(stdlib), encoding="utf-8")
    print(f"wrote {STDLIB_OUT}: {len(stdlib)} documents, {sum(map(len, stdlib))} characters")


if __name__ == "__main__":
    main()
