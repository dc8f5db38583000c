"""The shipped tokenizer, the builtin task files, the task generators and the docstring corpus."""

import json
import re
import sys
from pathlib import Path

import make_pydoc_text
import pytest
import tasks
from corpus import ITEMS, python_doc_corpus
from smollm2_probes import CANDIDATES

from revffn.data.formats import BUILTIN_DIR, load_examples
from revffn.data.tokenizer import SHIPPED_TOKENIZER, SPECIAL_TOKENS, load_tokenizer
from revffn.errors import UserError
from revffn.training.evaluate import is_match


def test_shipped_tokenizer(tok):
    assert len(tok) == 2048
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(6))
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token, tok.eos_token_id) == ("<|pad|>", 0, "<|end|>", 2)
    assert tok.bos_token_id == 1
    text = "Tom has 3 apples.\n  def f(x): return x ** 2  # ünïcode ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok("<|user|>\nhi<|end|>", add_special_tokens=False)["input_ids"][0] == 4  # specials are atomic
    assert sum(p.stat().st_size for p in Path(SHIPPED_TOKENIZER).iterdir()) < 300_000


def test_task_words_are_single_tokens(tok):
    for word in tasks.WORDS:
        assert len(tok(" " + word, add_special_tokens=False)["input_ids"]) == 1, word


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match=r"^tokenizer: directory .*missing.*Fix"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(UserError, match=r"^tokenizer: .* holds no tokenizer files \(one of tokenizer.json.*Fix"):
        load_tokenizer(str(tmp_path))  # exists, holds no tokenizer files


def test_local_tokenizer_without_pad_gets_eos(tmp_path):
    tok = load_tokenizer(None)
    tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("pad_token")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == "<|end|>"


def _prompts(path: Path) -> set[str]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["instruction"] + "\n\n" + r["input"] for r in records}


def test_builtin_files_are_regenerated_identically(tmp_path):
    written = tasks.write_builtin(tmp_path)
    # written by other scripts: retention_test.jsonl (the base's held-out pretraining text) by pretrain_base.py,
    # pydoc_text.jsonl, pydoc_calibration.jsonl and stdlib_text.jsonl by make_pydoc_text.py, smollm2_probes.jsonl by
    # smollm2_probes.py
    others = {"retention_test.jsonl", "pydoc_text.jsonl", "pydoc_calibration.jsonl", "stdlib_text.jsonl",
              "smollm2_probes.jsonl"}
    assert {p.name for p in written} == {p.name for p in BUILTIN_DIR.glob("*.jsonl")} - others
    for path in written:
        assert path.read_bytes() == (BUILTIN_DIR / path.name).read_bytes(), path.name
    assert sum(p.stat().st_size for p in written) < 1_000_000


@pytest.mark.parametrize("prefix,sizes", [("reversal", {"train": 600, "test": 64}),
                                          ("gsm", {"train": 1000, "val": 100, "test": 100}),
                                          ("format", {"train": 1000, "val": 100, "test": 100}),
                                          ("commas", {"train": 1000, "val": 100, "test": 100})])
def test_builtin_splits_are_disjoint(prefix, sizes):
    prompts = {split: _prompts(BUILTIN_DIR / f"{prefix}_{split}.jsonl") for split in sizes}
    assert {split: len(p) for split, p in prompts.items()} == sizes  # distinct within each split
    splits = list(prompts)
    for i, first in enumerate(splits):
        for second in splits[i + 1 :]:
            assert not prompts[first] & prompts[second], (first, second)


def test_gsm_solutions_are_correct():
    for ex in tasks.mini_gsm(200, seed=5):
        a, op, b, result = re.fullmatch(r"(\d+) ([+-]) (\d+) = (\d+)\nAnswer: (\d+)", ex["output"]).groups()[:4]
        assert int(result) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        assert ex["output"].endswith(f"Answer: {result}") and f" {a} " in f" {ex['instruction']} "


def test_reversal_tasks():
    for ex in tasks.format_task(100, seed=1):
        words = ex["input"].split()
        assert 2 <= len(words) <= 4 and ex["output"].split() == words[::-1]
    for ex in tasks.reversal(100, seed=1):
        words = ex["instruction"].removeprefix("Reverse: ").split()
        assert set(words) <= set(tasks.QUICK_WORDS) and ex["output"].split() == words[::-1]
    assert tasks.reversal(50, seed=2) == tasks.reversal(50, seed=2) != tasks.reversal(50, seed=3)


def test_comma_task():
    for ex in tasks.commas(100, seed=1):
        words = ex["instruction"].removeprefix("Put commas between: ").split()
        assert 2 <= len(words) <= 3 and set(words) <= set(ITEMS) and ex["output"] == ", ".join(words)


def test_python_doc_corpus():
    docs = python_doc_corpus(20_000)
    assert docs and sum(map(len, docs)) <= 20_000 and len(set(docs)) == len(docs)
    assert python_doc_corpus(20_000) == docs


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the reference manual's topics change between versions")
def test_pydoc_text_is_regenerated_identically():
    shipped = (BUILTIN_DIR / "pydoc_text.jsonl").read_text(encoding="utf-8")
    assert shipped == make_pydoc_text.render(make_pydoc_text.pydoc_text())


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the reference manual's topics change between versions")
def test_pydoc_calibration_is_regenerated_identically_and_disjoint_from_the_eval_text():
    shipped = (BUILTIN_DIR / "pydoc_calibration.jsonl").read_text(encoding="utf-8")
    assert shipped == make_pydoc_text.render(make_pydoc_text.pydoc_calibration())
    calibration = {json.loads(line)["text"] for line in shipped.splitlines()}
    held_out = {json.loads(line)["text"] for line in (BUILTIN_DIR / "pydoc_text.jsonl").read_text().splitlines()}
    assert len(calibration) > 5 * len(held_out) and not calibration & held_out


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the standard library's docstrings change between versions")
def test_stdlib_text_is_regenerated_identically_and_shares_no_piece_with_the_eval_text():
    shipped = (BUILTIN_DIR / "stdlib_text.jsonl").read_text(encoding="utf-8")
    assert shipped == make_pydoc_text.render(make_pydoc_text.stdlib_text())
    text = [json.loads(line)["text"] for line in shipped.splitlines()]
    held_out = [json.loads(line)["text"] for line in (BUILTIN_DIR / "pydoc_text.jsonl").read_text().splitlines()]
    assert len(text) > 500 and not [h for h in held_out if any(h in t or t in h for t in text)]


def test_pydoc_text_is_held_out_text():
    docs = [json.loads(line) for line in (BUILTIN_DIR / "pydoc_text.jsonl").read_text().splitlines()]
    assert len(docs) == make_pydoc_text.N_DOCS and all(d.keys() == {"text"} for d in docs)
    texts = [d["text"] for d in docs]
    assert len(set(texts)) == len(texts)
    assert all(make_pydoc_text.MIN_CHARS <= len(t) <= make_pydoc_text.MAX_CHARS for t in texts)
    retention = {json.loads(line)["text"] for line in (BUILTIN_DIR / "retention_test.jsonl").read_text().splitlines()}
    assert not retention & set(texts)


def test_smollm2_probes_are_short_questions_with_references():
    probes = load_examples("builtin:smollm2_probes")
    report = json.loads((Path(__file__).resolve().parents[2] / "docs" / "smollm2_probes.json").read_text())
    kept = [(r["question"], r["reference"]) for r in report["candidates"] if r["kept"]]
    assert [(p["messages"][0]["content"], p["answer"]) for p in probes] == kept
    assert len(probes) == report["n_kept"] >= 40
    # the report is of the script's current candidates (rerun scripts/smollm2_probes.py after editing them)
    assert [(r["category"], r["question"], r["reference"]) for r in report["candidates"]] == list(CANDIDATES)
    for row in report["candidates"]:
        assert row["kept"] is is_match(row["answer"], row["reference"], "contains")
