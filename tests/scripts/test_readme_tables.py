"""scripts/readme_tables.py: the README's command, config-key and method-option tables are the generator's output,
so a flag, key or default added or changed in the code shows up in the README (or this test fails)."""

from pathlib import Path

import pytest
import readme_tables

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_tables_are_current():
    text = (ROOT / "README.md").read_text()
    assert readme_tables.render(text) == text, "README.md: rerun python scripts/readme_tables.py"


def test_the_tables_follow_the_code(monkeypatch):
    from revffn.methods import METHODS
    from revffn.schema import Key
    from revffn.training import config

    monkeypatch.setitem(config.SCHEMA, "new_key", Key(int, 7, "a key | with a pipe"))
    assert "| `new_key` | `7` | a key \\| with a pipe |" in readme_tables.config_keys()
    monkeypatch.setitem(METHODS["lora"].SCHEMA, "r", Key(int, 32, "rank"))
    assert "| `lora.r` | `32` | rank |" in readme_tables.method_options()
    rows = readme_tables.commands().splitlines()[2:]
    assert any(r.startswith("| `revffn train [CONFIG] [OVERRIDES ...]` |") for r in rows)
    assert any(r.startswith("| `revffn convert MODEL` |") and "`--heal-eval-steps`" in r for r in rows)


def test_a_readme_without_markers_is_refused():
    with pytest.raises(SystemExit, match="commands:start"):
        readme_tables.render("# README\n")
