"""scripts/estimate_table.py: docs/memory.md's per-GPU memory table is the script's output."""

from pathlib import Path

import estimate_table

ROOT = Path(__file__).resolve().parents[2]


def test_readme_table_is_the_scripts_output():
    readme = (ROOT / "docs" / "memory.md").read_text()
    section = readme.split(estimate_table.HEADING + "\n", 1)[1].split("\n#", 1)[0]
    assert estimate_table.table() in section, "docs/memory.md: rerun python scripts/estimate_table.py --readme"


def test_write_readme_replaces_only_the_table(tmp_path):
    page = tmp_path / "README.md"
    page.write_text(f"# t\n\n{estimate_table.HEADING}\n\nintro\n\n| old |\n|---|\n| 1 |\n\nafter\n\n## next\n")
    estimate_table.write_readme("| new |\n|---|\n", page)
    assert page.read_text() == f"# t\n\n{estimate_table.HEADING}\n\nintro\n\n| new |\n|---|\n\nafter\n\n## next\n"
