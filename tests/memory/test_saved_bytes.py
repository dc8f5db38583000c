"""Structural memory property: activations saved by the reversible stack do not grow with depth."""

from revffn.reports.check import run_check


def test_saved_bytes_flat_in_depth():
    r4 = run_check("tiny-qwen2-moe", layers=4, seq=32)
    r16 = run_check("tiny-qwen2-moe", layers=16, seq=32)
    print("reversible", r4["saved_bytes_reversible"], r16["saved_bytes_reversible"],
          "plain", r4["saved_bytes_plain"], r16["saved_bytes_plain"],
          "records", r4["routing_record_bytes"], r16["routing_record_bytes"])
    assert r16["saved_bytes_reversible"] <= 1.05 * r4["saved_bytes_reversible"]
    assert 3.5 <= r16["saved_bytes_plain"] / r4["saved_bytes_plain"] <= 4.5
    # routing records grow with depth by nature, and are compact: one uint8 per token and choice
    tokens, top_k = 2 * 32, 2
    assert r16["routing_record_bytes"] == 16 * tokens * top_k
