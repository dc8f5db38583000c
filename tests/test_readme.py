"""The README's contract: two set-up commands first, .ci/run runs the second, every config key documented,
and the docs do not lie about the code: every `revffn SUBCOMMAND ...` line names a real subcommand, its real
flags and real config keys; every repo path, `revffn.` name and Markdown link they mention exists."""

import argparse
import glob
import importlib
import json
import re
import shlex
from pathlib import Path

import pytest

from revffn.cli import build_parser
from revffn.methods import METHODS
from revffn.training.config import SCHEMA

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./~-])((?:revffn|configs|scripts|docs|tests|\.ci)/[\w./*-]*)")
DOTTED = re.compile(r"(?<![\w./-])revffn(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIXES = (".json", ".jsonl", ".yaml", ".md", ".py", ".png", ".txt", ".safetensors", ".pt")
PLACEHOLDER_KEY = re.compile(r"^[A-Z][A-Z0-9_]*$")  # KEY=VALUE in a usage line


def subcommand_flags(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Subcommand name -> the option strings it accepts, read from argparse itself."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}


FLAGS = subcommand_flags(build_parser())
TOP_FLAGS = {s for a in build_parser()._actions for s in a.option_strings}


def code_lines(text: str) -> list[str]:
    """Every line of every fenced block (backslash continuations joined), then every inline code span."""
    lines = []
    for block in FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()
    return lines + INLINE.findall(FENCE.sub("", text))


def commands(line: str) -> list[list[str]]:
    """The `revffn ...` invocations on one line, as token lists without the leading `revffn`."""
    line = re.sub(r"^\s*\$\s+", "", line)
    line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]  # drop a shell comment
    found = []
    for segment in re.split(r"&&|\|\||;|\s\|\s", line):
        try:
            tokens = shlex.split(segment)
        except ValueError:
            tokens = segment.split()
        while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):  # VAR=value env prefix
            tokens = tokens[1:]
        if tokens[:3] == ["python", "-m", "revffn"]:
            tokens = tokens[2:]
        if len(tokens) > 1 and tokens[0] == "revffn":
            found.append(tokens[1:])
    return found


def key_problem(key: str) -> str | None:
    if "." in key:
        method, option = key.split(".", 1)
        if method in METHODS and option in METHODS[method].SCHEMA:
            return None
        return f"{key!r} is not a method option"
    return None if key in SCHEMA else f"{key!r} is not a config key"


def command_problems(tokens: list[str]) -> list[str]:
    sub, *rest = tokens
    if sub.startswith("-"):  # `revffn --help`: the top-level parser's own flags
        return [] if sub in TOP_FLAGS else [f"revffn: no flag {sub!r}"]
    if PLACEHOLDER_KEY.match(sub):  # `revffn SUBCOMMAND --help`: flags every subcommand takes
        return [f"revffn {sub}: not every subcommand takes {t!r}" for t in rest
                if t.startswith("-") and not all(t in flags for flags in FLAGS.values())]
    if sub not in FLAGS:
        return [f"unknown subcommand {sub!r}"]
    problems = []
    rest = [t.strip("[]") for t in rest]
    for i, tok in enumerate(rest):
        if tok.startswith("-"):
            if tok.split("=", 1)[0] not in FLAGS[sub]:
                problems.append(f"revffn {sub}: no flag {tok.split('=', 1)[0]!r}")
            continue
        override = "=" in tok and ((sub in ("train", "validate") and (i == 0 or not rest[i - 1].startswith("-")))
                                   or (sub == "bench" and i > 0 and rest[i - 1] == "--set"))
        key = tok.split("=", 1)[0]
        if override and not PLACEHOLDER_KEY.match(key) and (problem := key_problem(key)):
            problems.append(f"revffn {sub}: {problem}")
    return problems


def dotted_problem(name: str) -> str | None:
    """`revffn.x.y` must be importable (module, then attributes), or a `revffn` method option."""
    parts = name.split(".")
    if len(parts) == 2 and parts[1] in METHODS["revffn"].SCHEMA:
        return None
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{name}: {'.'.join(parts[:cut])} has no {attr!r}"
            obj = getattr(obj, attr)
        return None
    return f"{name}: not importable"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+\s+(.*)$", FENCE.sub("", text), re.M)}


def page_problems(page: str, text: str, root: Path = ROOT) -> list[str]:
    """Everything wrong with one Markdown page's commands, paths, `revffn.` names and links."""
    problems = []
    for line in code_lines(text):
        for tokens in commands(line):
            problems += [f"{page}: `{line.strip()}`: {p}" for p in command_problems(tokens)]
    prose_and_code = text
    for path in {p.rstrip(".,:;") for p in REPO_PATH.findall(prose_and_code)}:
        hits = glob.glob(str(root / path)) if "*" in path else [p for p in [root / path] if p.exists()]
        if not hits:
            problems.append(f"{page}: path {path} does not exist")
    for name in {n for n in DOTTED.findall(text) if not n.endswith(FILE_SUFFIXES)}:
        if problem := dotted_problem(name):
            problems.append(f"{page}: {problem}")
    here = (root / page).parent
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (here / file) if file else root / page
        if not dest.exists():
            problems.append(f"{page}: link {target} does not resolve")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{page}: link {target}: no heading #{anchor}")
    return problems


def test_readme_opens_with_two_commands_and_ci_runs_the_test_one():
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(block) == 2
    assert block[0].endswith("revffn train")
    assert "pytest" in block[1]
    assert block[1] in (ROOT / ".ci" / "run").read_text()


def test_every_config_key_is_documented():
    for key in SCHEMA:
        assert f"`{key}`" in README, key
    for name, method in METHODS.items():
        assert f"`{name}`" in README
        for key in method.SCHEMA:
            assert f"`{name}.{key}`" in README, f"{name}.{key}"


@pytest.mark.parametrize("page", PAGES)
def test_docs_name_only_real_commands_flags_keys_paths_and_links(page):
    assert page_problems(page, (ROOT / page).read_text()) == []


def test_readme_shows_every_subcommand():
    shown = {tokens[0] for line in code_lines(README) for tokens in commands(line)}
    assert set(FLAGS) <= shown, sorted(set(FLAGS) - shown)


@pytest.mark.parametrize("bad", [
    "```bash\nrevffn train --help-methods\n```",
    "```bash\nrevffn nosuch --json\n```",
    "`revffn --version`",
    "`revffn SUBCOMMAND --json`",
    "```bash\nrevffn train configs/tiny_lora.yaml lora.rank=8\n```",
    "run `revffn validate configs/tiny_lora.yaml max_step=3`",
    "```\n$ revffn eval runs/x/final --data builtin:commas_test --batch 4\n```",
    "```bash\nrevffn bench --model tiny-qwen2-moe \\\n    --set revffn.stream=bfloat16\n```",
    "see `configs/no_such.yaml`",
    "see `revffn/inference.py`",
    "`revffn.reports.bench_worker` runs each method",
    "Python API: `revffn.no_such_function(path)`",
    "[the methods](docs/no_such_page.md)",
    "[limits](#no-such-heading)",
])
def test_the_docs_check_catches_a_broken_line(bad):
    assert page_problems("README.md", f"# t\n\n{bad}\n"), bad


def test_the_architecture_claim_matches_the_committed_sweep():
    """The README's counts and named types, per family, are those `revffn archs` wrote to docs/architectures.json."""
    import re

    sweep = json.loads((ROOT / "docs" / "architectures.json").read_text())
    moe = [r for r in sweep["results"] if r["family"] == "moe"]
    exact = {r["model_type"] for r in moe if r["status"] == "exact"}
    claim = re.search(r"\((\d+) of the (\d+) MoE model types in transformers [\d.]+ convert with exact gradients, "
                      r"e\.g\. (.+?); the other (\d+) are refused", " ".join(README.split()))
    assert claim, "README: the architecture sentence changed; keep it checkable"
    n_exact, n_all, named, n_refused = claim.groups()
    assert (int(n_exact), int(n_all), int(n_refused)) == (len(exact), len(moe),
                                                         sweep["family_counts"]["moe"]["refused"])
    assert set(re.findall(r"`(\w+)`", named)) <= exact
    assert not any(sweep["family_counts"]["moe"][s] for s in ("crash", "wrong", "unfaithful", "build-error"))
    dense = sweep["family_counts"]["dense"]
    exact = {r["model_type"] for r in sweep["results"] if r["family"] == "dense" and r["status"] == "exact"}
    claim = re.search(r"Of the (\d+) dense model types, (\d+) convert exactly too, e\.g\. (.+?); (\d+) are refused, "
                      r"(\d+) crash, (\d+) cannot be built tiny", " ".join(README.split()))
    assert claim, "README: the dense architecture sentence changed; keep it checkable"
    n_all, n_exact, named, *n_failed = claim.groups()
    assert int(n_all) == sum(dense.values()) and int(n_exact) == len(exact) == dense["exact"]
    assert [int(n) for n in n_failed] == [dense["refused"], dense["crash"], dense["build-error"]]
    assert set(re.findall(r"`(\w+)`", named)) <= exact and not dense["wrong"] and not dense["unfaithful"]


FIGURE = re.compile(r"(?<![\w.`-])[+]?(\d+\.\d+)x?(?![\w.`])|(?<![\w.`-])(\d+) %")  # 0.854x, +1.8, 90 %
CITED = re.compile(r"\(?(docs/[\w./-]+\.md)")


def readme_figures() -> list[tuple[str, list[str], list[str]]]:
    """(paragraph, the docs pages it cites, the measured figures in it) for each README paragraph or bullet that
    cites a page, outside code fences and tables (the tables are generated from the code and checked)."""
    text = FENCE.sub("", README)
    out = []
    for para in re.split(r"\n\s*\n|\n(?=- )", text):
        if para.lstrip().startswith("|"):
            continue
        pages = sorted(set(CITED.findall(para)))
        figures = [a or b for a, b in FIGURE.findall(para)]
        if pages and figures:
            out.append((" ".join(para.split())[:80], pages, figures))
    return out


def test_readme_figures_are_quoted_from_the_pages_they_cite():
    """A measured figure in the README (a ratio, a loss, a percentage) is never typed twice: it appears on a page
    the same paragraph cites, where the command that measured it is."""
    checked = readme_figures()
    assert len(checked) >= 3  # the quickstart result and the limits at least
    for para, pages, figures in checked:
        text = " ".join((ROOT / p).read_text() for p in pages)
        missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", text)]
        assert not missing, f"README: {missing} in {para!r}... appear on none of {pages}"
