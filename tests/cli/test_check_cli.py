"""`revffn check` as a user runs it: one JSON object, exit codes 0 / 1 / 2."""

import json
import subprocess
import sys

import pytest

from revffn import cli


@pytest.mark.integration
def test_check_json_is_one_object():
    proc = subprocess.run([sys.executable, "-m", "revffn", "check", "--model", "tiny-mixtral", "--layers", "2",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for key in ("max_reconstruction_error", "max_rel_grad_error", "routing_flips", "saved_bytes_reversible",
                "saved_bytes_plain", "routing_record_bytes", "passed", "conversion_gap"):
        assert key in report
    assert report["passed"] is True


def test_check_full_width_reports_it_and_passes(capsys):
    assert cli.main(["check", "--model", "tiny-mixtral", "--layers", "2", "--stream-width", "full", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stream_width"] == "full" and report["max_rel_grad_error"] <= 1e-5


def test_check_human_output_prints_conversion_gap(capsys):
    assert cli.main(["check", "--model", "tiny-olmoe", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "conversion_gap" in out and "PASSED" in out


def test_check_bf16_reports_ratio(capsys):
    assert cli.main(["check", "--model", "tiny-qwen2-moe", "--layers", "2", "--dtype", "bfloat16", "--json"]) == 0
    assert "err_ratio_vs_fp32" in json.loads(capsys.readouterr().out)


def test_check_exit_1_over_tolerance(monkeypatch, capsys):
    from revffn.reports import check

    monkeypatch.setitem(check.TOL, "max_rel_grad_error", 0.0)
    assert cli.main(["check", "--model", "tiny-qwen2-moe", "--layers", "2", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["passed"] is False


def test_check_bad_input_exit_2(tmp_path, capsys):
    assert cli.main(["check", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and err.count("\n") == 1
    assert cli.main(["check", "--model", "tiny-nope"]) == 2
    assert cli.main(["check", "--dtype", "float16"]) == 2
    assert "bfloat16" in capsys.readouterr().err


def test_check_buffer_momentum_reaches_the_model(capsys):
    """`--buffer-momentum` picks the buffered coupling's sign: both pass, the report names it, and the two convert
    to different models (the 2^-k velocity term flips)."""
    reports = {}
    for sign in ("positive", "negative"):
        assert cli.main(["check", "--model", "tiny-qwen2-moe", "--layers", "2", "--coupling", "buffered",
                         "--buffer-momentum", sign, "--json"]) == 0
        reports[sign] = json.loads(capsys.readouterr().out)
        assert reports[sign]["buffer_momentum"] == sign and reports[sign]["passed"] is True
    assert reports["positive"]["loss_converted"] != reports["negative"]["loss_converted"]
    with pytest.raises(SystemExit) as bad:  # argparse's choices: one usage line, exit 2
        cli.main(["check", "--buffer-momentum", "sideways"])
    assert bad.value.code == 2 and "positive" in capsys.readouterr().err
