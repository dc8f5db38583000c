"""`python -m revffn.reports.lm_eval_task`'s arguments: refused before any work, with exit 2 and one line, and
nothing written outside --out (the task files' scores against lm-eval are in tests/models/test_lm_eval.py)."""

import pytest

from revffn.reports.lm_eval_task import main


@pytest.mark.parametrize("extra,says", [
    (["--name", "../escape"], "--name '../escape': a task name is letters, digits"),  # it wrote outside --out
    (["--name", "bad/name"], "--name 'bad/name': a task name"),  # FileNotFoundError, after --out was made
    (["--limit", "-1"], "argument --limit: -1 examples: at least 1"),  # it dropped the last example
    (["--limit", "0"], "argument --limit: 0 examples: at least 1"),
], ids=["escape", "slash", "negative_limit", "zero_limit"])
def test_bad_arguments_exit_2_writing_nothing(tmp_path, capsys, extra, says):
    out = tmp_path / "tasks"
    with pytest.raises(SystemExit) as exit_info:
        main(["builtin:base", "--data", "builtin:commas_test", "--out", str(out), *extra])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_out_that_is_a_file_and_a_missing_model(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    for out, says in ((tmp_path / "afile", "is a file. Fix:"), (tmp_path / "afile" / "sub", "afile is a file.")):
        with pytest.raises(SystemExit) as exit_info:
            main(["builtin:base", "--data", "builtin:commas_test", "--out", str(out)])
        assert exit_info.value.code == 2 and says in capsys.readouterr().err
    assert main([str(tmp_path / "nothere"), "--data", "builtin:commas_test", "--out", str(tmp_path / "t")]) == 2
    assert "MODEL_DIR: " in capsys.readouterr().err and not (tmp_path / "t").exists()
    assert (tmp_path / "afile").read_text() == "mine"
