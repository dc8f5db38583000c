"""The pretraining corpus of the shipped base: deterministic, split cleanly, free of task data."""

import json

import corpus
import pytest

from revffn.data.formats import BUILTIN_DIR, load_examples


@pytest.fixture(scope="module")
def small_corpus():
    return corpus.pretraining_corpus(seed=0, n_world=300)


def test_world_corpus_is_deterministic_and_seeded():
    assert corpus.world_corpus(20, seed=3) == corpus.world_corpus(20, seed=3)
    assert corpus.world_corpus(20, seed=3) != corpus.world_corpus(20, seed=4)
    # Different paragraph seeds tell the same facts: the world is fixed by world_seed.
    towns, people = corpus._world(0)
    for para in corpus.world_corpus(50, seed=9):
        name = para.split()[0] if para.split()[0] in corpus.PEOPLE else None
        if name and f"{name} lives in " in para:
            assert f"{name} lives in {people[name]['town']}." in para


def test_chunk_text_keeps_pieces_short_and_text_complete():
    doc = ("First paragraph, long enough to be kept.\nstill first.\n\n" + "word " * 400
           + "\n\nlast paragraph here, long enough to keep.")
    pieces = corpus.chunk_text([doc], max_chars=200)
    assert all(len(p) <= 200 for p in pieces)
    assert "".join(pieces).replace(" ", "").replace("\n", "") == doc.replace(" ", "").replace("\n", "")


def test_pretraining_split_is_disjoint_and_deterministic(small_corpus):
    train, heldout = small_corpus
    assert len(heldout) > 50 and len(train) > 10 * len(heldout)
    assert not set(train) & set(heldout)
    assert corpus.pretraining_corpus(seed=0, n_world=300) == (train, heldout)


def test_tasks_are_absent_from_the_pretraining_corpus(small_corpus):
    train, heldout = small_corpus
    text = "\n".join(train + heldout)
    for marker in ("Reverse the order of these words", "Answer:", "How many", "Reverse:", "Put commas between"):
        assert marker not in text, marker
    for task in ("gsm", "format", "commas"):
        for ex in load_examples(f"builtin:{task}_test", "data")[:50]:
            if ex["answer"].count(",") >= 2:  # "a, b" may occur in a corpus list "a, b and c"; "a, b, c" may not
                assert ex["answer"] not in text, ex["answer"]
            assert ex["messages"][-2]["content"] not in text


def test_shipped_retention_set_is_the_held_out_split(small_corpus):
    _, heldout = small_corpus
    shipped = [json.loads(line)["text"] for line in (BUILTIN_DIR / "retention_test.jsonl").read_text().splitlines()]
    # Docstrings differ between Python versions; the world paragraphs do not.
    world = set(corpus.world_corpus(500, seed=1_000_003))
    assert [d for d in shipped if d in world] == [d for d in heldout if d in world]
    assert len([d for d in shipped if d in world]) >= 50
