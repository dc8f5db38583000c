"""Deterministic synthetic task generators and the builtin datasets they produce.

Every generator takes `(n, seed)`, draws from its own `random.Random(seed)` and returns `n`
alpaca-style dicts (`instruction`, `input`, `output`) with distinct prompts (instruction + input).

* `mini_gsm`: arithmetic word problems (numbers 1-20, + and -) with a worked line and a final
  "Answer: N" line, e.g. "Tom has 3 apples and buys 4 more. ..." -> "3 + 4 = 7\\nAnswer: 7".
* `format_task`: reverse the order of 2-4 words from a 40-word vocabulary,
  e.g. instruction "Reverse the order of these words.", input "red cat sun" -> "sun cat red".
* `quickstart`: the same reversal on 2-3 words from a 12-word vocabulary, all in the instruction
  ("Reverse: red cat sun" -> "sun cat red"): short and learnable by a tiny *random* model in minutes.
* `commas`: a format transformation, "Put commas between: rope ink tea" -> "rope, ink, tea" (2-3 nouns
  from `corpus.ITEMS`, which the base's pretraining text lists as "rope, ink and tea"; the
  instruction and the comma-only answer never occur there). The quickstart task on the shipped base.

`write_builtin(out_dir)` writes the `builtin:NAME` files (see `BUILTIN_SPLITS`). Splits are cut from
one pool of distinct prompts, so val/test prompts never occur in train.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Zoe", "Leo", "Emma")
OBJECTS = ("apples", "pencils", "books", "marbles", "cookies", "stickers", "cards", "shells", "eggs", "coins")

# (problem template, sign). `{a}` is always >= `{b}` so differences stay non-negative.
GSM_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("{n1} has {a} {obj} and buys {b} more. How many {obj} does {n1} have now?", "+"),
    ("{n1} has {a} {obj} and {n2} has {b} {obj}. How many {obj} do they have together?", "+"),
    ("{n1} had {a} {obj}. {n2} gave {n1} {b} more. How many {obj} does {n1} have now?", "+"),
    ("{n1} has {a} {obj} and gives {b} of them to {n2}. How many {obj} does {n1} have left?", "-"),
    ("There are {a} {obj} in a box. {n1} takes out {b}. How many {obj} are left in the box?", "-"),
    ("{n1} had {a} {obj} and lost {b} of them. How many {obj} does {n1} have now?", "-"),
)

WORDS = (
    "red", "blue", "green", "cat", "dog", "sun", "moon", "star", "tree", "fish",
    "bird", "cake", "milk", "book", "door", "hat", "car", "ship", "rain", "snow",
    "king", "queen", "ball", "bell", "lamp", "rose", "frog", "bear", "wolf", "lion",
    "gold", "salt", "corn", "rice", "ring", "road", "hill", "lake", "wind", "fire",
)
QUICK_WORDS = WORDS[:12]


def _distinct(n: int, seed: int, draw: Callable[[random.Random], dict]) -> list[dict]:
    """`n` examples from `draw`, skipping repeated prompts. Fails loudly if the space is too small."""
    rng = random.Random(seed)
    out: list[dict] = []
    seen: set[str] = set()
    for _ in range(100 * n + 1000):
        if len(out) == n:
            break
        ex = draw(rng)
        prompt = ex["instruction"] + "\n\n" + ex["input"]
        if prompt not in seen:
            seen.add(prompt)
            out.append(ex)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct examples could be drawn, {n} requested")
    return out


def _gsm_example(rng: random.Random) -> dict:
    template, sign = rng.choice(GSM_TEMPLATES)
    n1, n2 = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    if sign == "+":
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        result = a + b
    else:
        a = rng.randint(2, 20)
        b = rng.randint(1, a)
        result = a - b
    problem = template.format(n1=n1, n2=n2, obj=obj, a=a, b=b)
    return {"instruction": problem, "input": "", "output": f"{a} {sign} {b} = {result}\nAnswer: {result}"}


def mini_gsm(n: int, seed: int = 0) -> list[dict]:
    """`n` distinct arithmetic word problems whose output ends with the line "Answer: N"."""
    return _distinct(n, seed, _gsm_example)


def _reverse_example(rng: random.Random) -> dict:
    words = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
    return {"instruction": "Reverse the order of these words.", "input": " ".join(words),
            "output": " ".join(reversed(words))}


def format_task(n: int, seed: int = 0) -> list[dict]:
    """`n` distinct word-reversal examples (2-4 words from `WORDS`, words in `input`)."""
    return _distinct(n, seed, _reverse_example)


def _quick_example(rng: random.Random) -> dict:
    words = [rng.choice(QUICK_WORDS) for _ in range(rng.randint(2, 3))]
    return {"instruction": "Reverse: " + " ".join(words), "input": "", "output": " ".join(reversed(words))}


def reversal(n: int, seed: int = 0) -> list[dict]:
    """`n` distinct short word-reversal examples (2-3 words from `QUICK_WORDS`): builtin:reversal_*."""
    return _distinct(n, seed, _quick_example)


def _comma_example(rng: random.Random) -> dict:
    from corpus import ITEMS  # nouns the base saw in lists; the task format it never saw

    words = [rng.choice(ITEMS) for _ in range(rng.randint(2, 3))]
    return {"instruction": "Put commas between: " + " ".join(words), "input": "", "output": ", ".join(words)}


def commas(n: int, seed: int = 0) -> list[dict]:
    """`n` distinct format transformations: "Put commas between: rope ink tea" -> "rope, ink, tea" (2-3 nouns)."""
    return _distinct(n, seed, _comma_example)


# builtin name prefix -> (generator, seed, [(split, size), ...]); splits are consecutive slices of one pool.
BUILTIN_SPLITS: dict[str, tuple[Callable[[int, int], list[dict]], int, list[tuple[str, int]]]] = {
    "reversal": (reversal, 1234, [("train", 600), ("test", 64), ("val", 64)]),  # val last: train, test as before
    "gsm": (mini_gsm, 2345, [("train", 1000), ("val", 100), ("test", 100)]),
    "format": (format_task, 3456, [("train", 1000), ("val", 100), ("test", 100)]),
    "commas": (commas, 4567, [("train", 1000), ("val", 100), ("test", 100)]),
}


def write_builtin(out_dir: str | Path) -> list[Path]:
    """Write every `NAME_SPLIT.jsonl` of `BUILTIN_SPLITS` into `out_dir`; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for prefix, (generate, seed, splits) in BUILTIN_SPLITS.items():
        pool = generate(sum(size for _, size in splits), seed)
        start = 0
        for split, size in splits:
            path = out / f"{prefix}_{split}.jsonl"
            lines = [json.dumps(ex, ensure_ascii=False) + "\n" for ex in pool[start : start + size]]
            path.write_text("".join(lines), encoding="utf-8")
            written.append(path)
            start += size
    return written
