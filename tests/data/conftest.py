"""Shared fixtures for the data tests: the shipped tokenizer and a JSONL writer."""

import json

import pytest

from revffn.data.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer(None)


@pytest.fixture
def fallback_tok():
    t = load_tokenizer(None)
    t.chat_template = None
    return t


@pytest.fixture
def write_jsonl(tmp_path):
    def write(records, name="train.jsonl"):
        path = tmp_path / name
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
        return str(path)

    return write
