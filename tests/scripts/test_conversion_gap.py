"""scripts/conversion_gap.py: the table of docs/conversion.md is rendered from its rows, and the page's table
is exactly the rendering of the committed docs/conversion.json."""

import json
import subprocess
import sys
from pathlib import Path

import conversion_gap
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_render_gives_one_line_per_row_and_deltas_against_the_base():
    data = {"rows": [
        {"name": "base (unconverted)", "loss": 2.5},
        {"name": "calibrated (self; no skip)", "status": "ok", "adapter_skip": False, "calibration_data": "self",
         "calibration_tokens": 1024, "heal_data": None, "heal_steps": 0, "loss": 2.75, "calibration_s": 3.4,
         "heal_s": None, "peak_rss_bytes": 600 * 2**20},
        {"name": "calibrated + heal (self; heal self x4)", "status": "exit 2", "error": "boom"},
    ]}
    lines = conversion_gap.render(data).splitlines()
    assert len(lines) == 2 + 3
    assert lines[2] == "| base (unconverted) | – | – | **2.500** | +0.000 | – | – | – |"
    assert lines[3] == "| calibrated (self; no skip) | self (1024 tok) | – | **2.750** | +0.250 | 3 | – | 600 MiB |"
    assert lines[4].startswith("| calibrated + heal (self; heal self x4) | | | exit 2 |")


@pytest.mark.parametrize("marker, data", [("conversion-gap", "conversion.json"),
                                          ("conversion-gap:smollm2", "conversion_smollm2.json"),
                                          ("conversion-gap:smollm2-moe", "conversion_smollm2_moe.json")])
def test_the_committed_table_is_the_rendering_of_the_committed_json(marker, data):
    """builtin:base's table and each real model's: the page holds exactly what the committed JSON renders to."""
    page = (ROOT / "docs" / "conversion.md").read_text()
    table = page.split(f"<!-- {marker}:start -->\n", 1)[1].split(f"<!-- {marker}:end -->", 1)[0]
    assert table == conversion_gap.render(json.loads((ROOT / "docs" / data).read_text()))


@pytest.mark.integration  # runs the script in a subprocess (`--render`)
def test_a_real_models_table_adds_probes_and_tokens_to_target(tmp_path):
    """A real model's rows carry the probes answered and, for a heal measured along the way, the heal tokens until
    base + 0.2 (or "not reached"); `--render` rewrites the page's table from a JSON written elsewhere (a GPU)."""
    row = {"status": "ok", "calibration_data": "pydoc", "calibration_tokens": 32768, "heal_data": "pydoc",
           "heal_steps": 400, "heal_lr": 1e-4, "loss": 3.1, "calibration_s": 20.0, "heal_s": 60.0,
           "peak_rss_bytes": 2**30, "probes": 0.5, "heal_curve": [[50, 51200, 3.5]]}
    data = {"model": "builtin:smollm2-moe", "base_probes": 1.0, "rows": [
        {"name": "base (unconverted)", "loss": 3.0},
        {**row, "name": "reached", "tokens_to_target": 51200},
        {**row, "name": "short", "tokens_to_target": None},
        {**row, "name": "calibrated", "heal_data": None, "heal_s": None, "heal_curve": None, "tokens_to_target": None}]}
    lines = conversion_gap.render(data).splitlines()
    assert lines[0].endswith("| peak RSS | probes | heal tokens to base + 0.2 |")
    assert lines[2] == "| base (unconverted) | – | – | **3.000** | +0.000 | – | – | – | 100 % | – |"
    assert lines[3] == ("| reached | pydoc (32768 tok) | pydoc, 400 steps, lr 0.0001 | **3.100** | +0.100 | 20 | 60 "
                        "| 1024 MiB | 50 % | 51,200 |")
    assert lines[4].endswith("| 50 % | not reached |") and lines[5].endswith("| – | 1024 MiB | 50 % | – |")
    page = tmp_path / "conversion.md"
    marker = "conversion-gap:smollm2-moe"
    page.write_text(f"# page\n\n<!-- {marker}:start -->\nold\n<!-- {marker}:end -->\nafter\n")
    src = tmp_path / "gpu" / "conversion_smollm2_moe.json"
    src.parent.mkdir()
    src.write_text(json.dumps(data))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "conversion_gap.py"), "--render", str(src), "--docs",
                    str(page)], check=True, capture_output=True)
    text = page.read_text()
    assert conversion_gap.render(data) in text and "old" not in text and text.endswith("after\n")
    assert json.loads((tmp_path / "conversion_smollm2_moe.json").read_text()) == data  # the JSON beside the page


def test_a_buffered_row_needs_no_calibration_or_heal():
    """The buffered coupling's row (`buffered_row`): no calibration text, no heal, and the target reached with 0 heal
    tokens."""
    data = {"model": "builtin:smollm2", "base_probes": 1.0, "rows": [
        {"name": "base (unconverted)", "loss": 2.94},
        {"name": "buffered coupling, 6 bits (no adapters)", "status": "ok", "coupling": "buffered", "buffer_bits": 6,
         "loss": 2.95, "calibration_s": 0.0, "peak_rss_bytes": 2**30, "tokens_to_target": 0, "probes": 0.93}]}
    line = conversion_gap.render(data).splitlines()[-1]
    assert line == ("| buffered coupling, 6 bits (no adapters) | – | – | **2.950** | +0.010 | 0 | – | 1024 MiB | 93 % "
                    "| 0 (no heal) |")


def test_a_conversion_on_a_gpu_shows_the_gpus_peak_beside_the_hosts(tmp_path):
    """`revffn convert --device cuda` writes CUDA's peak (`peak_gpu_bytes`) beside the host's RSS in revffn.json; the
    row carries it and the table shows both. A CPU table is as before."""
    data = {"model": "builtin:smollm2", "base_probes": 1.0, "rows": [
        {"name": "base (unconverted)", "loss": 2.94},
        {"name": "buffered", "status": "ok", "coupling": "buffered", "loss": 2.95, "calibration_s": 0.0,
         "peak_rss_bytes": 2**30, "tokens_to_target": 0, "probes": 0.93}]}
    assert "peak RSS |" in conversion_gap.render(data).splitlines()[0]
    done = tmp_path / "models" / "buffered_6_positive" / "revffn.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"convert": {"buffer_bits": 6, "buffer_momentum": "positive"}, "wall_s": 9.0,
                                "conversion_gap": {"buffered": 2.95}, "peak_rss_bytes": 2**30,
                                "peak_gpu_bytes": 3 * 2**29}))
    row = conversion_gap.buffered_row(6, tmp_path, 1, "builtin:smollm2", "builtin:pydoc_text")  # reused, not run
    assert row["peak_gpu_bytes"] == 3 * 2**29
    lines = conversion_gap.render({**data, "rows": [data["rows"][0], {**row, "probes": 0.93}]}).splitlines()
    assert lines[0].endswith("| peak RSS; GPU | probes | heal tokens to base + 0.2 |")
    assert lines[-1].endswith("| 1024 MiB; 1536 MiB | 93 % | 0 (no heal) |")
