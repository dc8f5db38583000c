"""Offline English text corpus: docstrings of Python's standard library.

Used to train the shipped tokenizer (`scripts/build_tokenizer.py`) and reusable as a small,
always-available pretraining corpus. Nothing is downloaded: the text comes from the modules of
the running interpreter, walked in a fixed order, so the result is deterministic for a given
Python version.
"""

from __future__ import annotations

import importlib
import inspect
import random

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


def python_reference_corpus() -> list[str]:
    """The help topics of the Python reference manual that ship with the interpreter (`pydoc_data`)."""
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics) if len(topics[name].strip()) >= 40]


def chunk_text(docs: list[str], max_chars: int = 700) -> list[str]:
    """Split documents at paragraph breaks into pieces of at most ~`max_chars` characters.

    Paragraphs are kept whole when they fit; a longer paragraph is cut at line breaks, and a single
    longer line at `max_chars`. Pieces keep their order, so neighbouring text stays together.
    """
    out: list[str] = []
    for doc in docs:
        lines: list[str] = []
        for para in doc.split("\n\n"):
            lines += [para[i : i + max_chars] for i in range(0, max(len(para), 1), max_chars)] \
                if len(para) > max_chars and "\n" not in para else para.split("\n") + [""]
        piece = ""
        for line in lines:
            if piece and len(piece) + len(line) + 1 > max_chars:
                out.append(piece.strip())
                piece = ""
            piece += line + "\n"
        if piece.strip():
            out.append(piece.strip())
    return [p for p in out if len(p) >= 40]


# A small fictional world: fixed facts told in varied sentences. Unlike docstrings, these facts are
# learnable by a tiny model, so losing them during fine-tuning (forgetting) shows on the retention set.
PEOPLE = ("Ada", "Basil", "Cora", "Dmitri", "Elsa", "Felix", "Greta", "Hugo", "Iris", "Jonas", "Kira", "Luca",
          "Maren", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Soren", "Tara", "Ulrich", "Vera", "Wren", "Yara")
TOWNS = ("Oakridge", "Millbrook", "Stonehaven", "Riverton", "Ashford", "Brightwater", "Elmstead", "Foxhollow",
         "Glenmoor", "Harborview", "Ironwood", "Larkspur")
JOBS = ("baker", "teacher", "carpenter", "doctor", "painter", "fisher", "librarian", "gardener", "engineer",
        "musician", "tailor", "pilot")
PETS = ("a parrot", "a tortoise", "a goat", "a rabbit", "a hamster", "a pony", "an owl", "a lizard")
HOBBIES = ("plays the violin", "collects stamps", "builds model ships", "grows tomatoes", "writes poems",
           "repairs old clocks", "paints the sea", "keeps bees", "climbs mountains", "sings in a choir")
PLACES = ("by a wide river", "at the foot of a mountain", "on the edge of a forest", "beside a quiet lake",
          "near the sea", "on a windy hill")
GOODS = ("cheese", "glass", "wool", "clocks", "boats", "honey", "bells", "paper", "pottery", "lanterns")


def _world(seed: int) -> tuple[dict, dict]:
    rng = random.Random(seed)
    towns = {t: {"place": rng.choice(PLACES), "goods": rng.choice(GOODS)} for t in TOWNS}
    people = {}
    for name in PEOPLE:
        friend = rng.choice([p for p in PEOPLE if p != name])
        people[name] = {"town": rng.choice(TOWNS), "job": rng.choice(JOBS), "pet": rng.choice(PETS),
                        "hobby": rng.choice(HOBBIES), "friend": friend}
    return towns, people


_PERSON_SENTENCES = (
    ("town", ("{n} lives in {town}.", "{n} has a small house in {town}.", "The home of {n} is in {town}.")),
    ("job", ("{n} works as a {job}.", "By trade, {n} is a {job}.", "Everyone knows {n} as the {job}.")),
    ("pet", ("{n} keeps {pet} as a pet.", "{n} has {pet} at home.", "The pet of {n} is {pet}.")),
    ("hobby", ("In the evenings, {n} {hobby}.", "On weekends, {n} {hobby}.", "For fun, {n} {hobby}.")),
    ("friend", ("The best friend of {n} is {friend}.", "{n} often visits {friend}.",
                "{n} and {friend} are old friends.")),
)
_TOWN_SENTENCES = (
    "{town} lies {place}.", "The town of {town} is {place}.", "{town} is known for its {goods}.",
    "People come to {town} to buy {goods}.", "{town}, {place}, makes fine {goods}.",
)


ITEMS = GOODS + ("rope", "bread", "soap", "nails", "maps", "candles", "buttons", "ink", "tea", "wax", "thread",
                 "jars", "baskets", "kettles", "brushes", "blankets", "spoons", "hats", "boots", "keys")
_ERRANDS = (
    "{n} packed {items} for the trip. On the way home, {n} counted {items} again.",
    "In the shop of {n} there were {items}. A visitor asked for {items}, in that order.",
    "{n} wrote a list: {items}. {friend} read it aloud: {items}.",
)


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def world_corpus(n: int, seed: int, world_seed: int = 0) -> list[str]:
    """`n` short paragraphs about the fixed fictional world `world_seed`, drawn with `seed`.

    Each paragraph picks a person and tells 3-5 of their facts (and sometimes one about their town)
    in random order and wording. Different `seed`s give different paragraphs about the same facts.
    Some paragraphs add an errand that names a random list of 2-5 items twice, in the same order:
    text that rewards copying from the context (the "induction" skill that fine-tuning tasks such as
    word reordering build on), without containing any task.
    """
    towns, people = _world(world_seed)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name = rng.choice(PEOPLE)
        facts = {"n": name, **people[name]}
        kinds = rng.sample(_PERSON_SENTENCES, rng.randint(3, 5))
        sentences = [rng.choice(templates).format(**facts) for _, templates in kinds]
        if rng.random() < 0.5:
            town = people[name]["town"]
            sentences.append(rng.choice(_TOWN_SENTENCES).format(town=town, **towns[town]))
        if rng.random() < 0.5:
            items = _listing(rng.sample(ITEMS, rng.randint(2, 5)))
            sentences.append(rng.choice(_ERRANDS).format(n=name, friend=facts["friend"], items=items))
        out.append(" ".join(sentences))
    return out


def pretraining_corpus(seed: int, n_world: int, heldout_every: int = 40) -> tuple[list[str], list[str]]:
    """(train, held-out) documents for the shipped base: Python docs in ~600-char pieces + world text.

    Every `heldout_every`-th Python-docs piece is held out, and held-out world paragraphs are drawn
    with a different seed from the training ones. Deterministic for a given seed and Python version.
    """
    docs = chunk_text(python_doc_corpus(10_000_000) + python_reference_corpus(), max_chars=600)
    train = [d for i, d in enumerate(docs) if i % heldout_every != heldout_every - 1]
    heldout = [d for i, d in enumerate(docs) if i % heldout_every == heldout_every - 1]
    train += world_corpus(n_world, seed=seed)
    heldout += world_corpus(max(len(heldout), 1), seed=seed + 1_000_003)
    random.Random(seed).shuffle(train)
    random.Random(seed + 1).shuffle(heldout)
    return train, heldout
