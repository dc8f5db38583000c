"""scripts/conversion_gap.py: the table of docs/conversion.md is rendered from its rows, and the page's table
is exactly the rendering of the committed docs/conversion.json."""

import json
from pathlib import Path

import conversion_gap

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


def test_the_committed_table_is_the_rendering_of_the_committed_json():
    page = (ROOT / "docs" / "conversion.md").read_text()
    table = page.split("<!-- conversion-gap:start -->\n", 1)[1].split("<!-- conversion-gap:end -->", 1)[0]
    assert table == conversion_gap.render(json.loads((ROOT / "docs" / "conversion.json").read_text()))
