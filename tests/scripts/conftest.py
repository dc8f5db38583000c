"""The asset builders live in scripts/ (run as `python scripts/NAME.py`); make them importable here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import pytest  # noqa: E402

from revffn.data.tokenizer import load_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer(None)
