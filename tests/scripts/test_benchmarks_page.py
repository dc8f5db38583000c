"""scripts/benchmarks_page.py: docs/benchmarks.md is the script's output from the committed JSON, and `--run`
runs every bench command the page lists before writing it."""

from pathlib import Path

import benchmarks_page

ROOT = Path(__file__).resolve().parents[2]


def test_the_page_is_the_scripts_output(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmarks_page, "render_dir", lambda path: None)  # the .md / .png beside the JSON
    page = tmp_path / "benchmarks.md"
    assert benchmarks_page.main([str(ROOT / "docs" / "bench"), str(page)]) == 0
    assert page.read_text() == (ROOT / "docs" / "benchmarks.md").read_text(), \
        "docs/benchmarks.md: rerun python scripts/benchmarks_page.py"


def test_run_runs_each_listed_bench_in_order(monkeypatch):
    calls = []
    benchmarks_page.run_all(lambda args, cwd, check: calls.append((args, cwd, check)))
    assert len(calls) == len(benchmarks_page.COMMANDS) - 1  # all but the page's own command
    assert [c[0][:2] for c in calls[:-1]] == [["revffn", "bench"]] * (len(calls) - 1)
    assert calls[-1][0][1:] == ["scripts/memory_timeline.py", "--out", "docs/memory_timeline.json"]
    assert calls[-1][0][0].endswith(("python", "python3", "python3.11", "python3.12", "python3.13"))
    assert all(cwd == benchmarks_page.ROOT and check for _, cwd, check in calls)
    assert " ".join(calls[0][0]) == benchmarks_page.COMMANDS[0]
