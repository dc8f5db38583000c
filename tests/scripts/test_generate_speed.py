"""scripts/generate_speed.py: the cached and recomputed decodes agree, and docs/outputs.md quotes the measured
figures."""

import json
from pathlib import Path

import generate_speed

ROOT = Path(__file__).resolve().parents[2]


def test_the_script_times_both_decodes_and_they_agree(tmp_path, one_thread):
    out = tmp_path / "speed.json"
    result = generate_speed.main(["--model", "tiny-qwen2-moe", "--new-tokens", "4", "--batches", "1", "3",
                                  "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [(r["model"], r["batch"]) for r in result["results"]] == [
        ("revffn (converted)", 1), ("revffn (converted)", 3), ("plain HF", 1), ("plain HF", 3)]
    assert all(r["same_tokens"] and r["no_cache_s"] > 0 and r["cache_s"] > 0 for r in result["results"])


def test_the_outputs_page_quotes_docs_generate_speed():
    result = json.loads((ROOT / "docs" / "generate_speed.json").read_text())
    assert generate_speed.summary(result) in (ROOT / "docs" / "outputs.md").read_text(), \
        "docs/outputs.md: rerun python scripts/generate_speed.py --out docs/generate_speed.json and quote its last line"
