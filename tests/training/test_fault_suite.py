"""Hostile and extreme input, as a new user's files and shells produce it: each case ends in a clean run or in one
`error:` line with exit 2, never a traceback, a MemoryError or an abort.

(The run-directory faults, simultaneous starts, overwrite of a live run, a kill during the final/ swap, are in
test_run_lock.py and test_run_dir.py; the careless-input classes per config key in test_fuzz_inputs.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from revffn import cli

TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 1, hidden_size: 32}", "method=full",
        "eval_data=null", "eval_generate_limit=0", "max_steps=2", "max_seq_length=32", "device=cpu",
        "per_device_train_batch_size=2"]
BOMB = "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10) if p else ', '.join(['1'] * 10)}]\n"
               for p, c in zip(["", *"abcdefgh"], "abcdefghi"))  # i: 10^9 values once expanded


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    return lines[0]


def _chat(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


HI = [{"instruction": f"say hi {i}", "output": "hi there"} for i in range(8)]


@pytest.mark.parametrize("where", ["max_steps", "model_config"])
def test_a_yaml_alias_bomb_exits_2_at_once(tmp_path, capsys, where):
    config = tmp_path / "bomb.yaml"
    config.write_text(f"model: tiny-qwen2-moe\ndata: builtin:reversal_train\noutput_dir: {tmp_path / 'run'}\n"
                      + BOMB.replace("i: &i", f"{where}: &i"))
    t0 = time.perf_counter()
    assert cli.main(["train", str(config)]) == 2
    took = time.perf_counter() - t0
    line = _error_line(capsys.readouterr().err)
    assert f"bomb.yaml:12: {where}: its YAML aliases expand to more than 100,000 values" in line and "Fix:" in line
    assert took < 5 and len(line) < 400 and not (tmp_path / "run").exists()


def test_an_alias_bomb_in_an_override_exits_2(tmp_path, capsys):
    value = "{" + BOMB.replace("\n", ", ").rstrip(", ") + "}"
    assert cli.main(["train", *TINY, f"model_config={value}", "data=builtin:reversal_train",
                     f"output_dir={tmp_path / 'run'}"]) == 2
    assert "override model_config: i: its YAML aliases expand" in _error_line(capsys.readouterr().err)


def test_a_long_bad_value_is_shown_in_at_most_200_characters(tmp_path, capsys):
    assert cli.main(["train", *TINY, "data=builtin:reversal_train", f"output_dir={tmp_path / 'run'}",
                     "lr_scheduler_type=" + "x" * 100_000]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "lr_scheduler_type" in line and len(line) < 600


def test_a_path_override_is_the_string_written(tmp_path, capsys):
    """`data=PATH` where PATH holds ` #`: YAML would read a comment there; a path key takes the text as written."""
    data = _chat(tmp_path / "my data #1.jsonl", HI)
    assert cli.main(["train", *TINY, f"data={data}", f"output_dir={tmp_path / 'run #2'}"]) == 0
    assert (tmp_path / "run #2" / "final").is_dir()
    assert cli.main(["train", *TINY, f"data={data}", f"output_dir={tmp_path / 'run #2'}", "resume=true"]) == 2
    assert "no complete checkpoint" in _error_line(capsys.readouterr().err)  # true/false still parse on resume


def test_lone_surrogates_train(tmp_path):
    """Valid JSON may hold a lone UTF-16 surrogate (\\ud800), which is no character: it becomes U+FFFD."""
    data = _chat(tmp_path / "s.jsonl", HI + [{"instruction": "lone \ud800 here", "output": "and \udfff there"}])
    assert "\\ud800" in data.read_text()
    assert cli.main(["train", *TINY, f"data={data}", f"output_dir={tmp_path / 'run'}"]) == 0


_CAPPED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from revffn import cli
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.integration
def test_a_50_mb_row_trains_truncated_under_a_2_gib_address_space_cap(tmp_path):
    data = _chat(tmp_path / "huge.jsonl", [{"instruction": "x " * 25_000_000, "output": "ok"}] + HI)
    assert data.stat().st_size > 50_000_000
    child = subprocess.run([sys.executable, "-c", _CAPPED, "train", *TINY, f"data={data}",
                            f"output_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "Traceback" not in child.stderr


def test_every_count_and_number_flag_refuses_what_it_cannot_mean(capsys):
    """No subcommand takes a bare int or float: each numeric flag goes through a validator; `eval --limit -1` (a
    Python slice: 99 of 100) exits 2."""
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    bare = [f"{name} {'/'.join(a.option_strings)}" for name, sub in subs.items() for a in sub._actions
            if a.type in (int, float)]
    assert bare == []
    for argv in (["eval", "x", "--data", "builtin:reversal_test", "--limit", "-1"],
                 ["bench", "--nproc", "0"], ["bench", "--timeout", "nan"], ["estimate", "--model", "x",
                                                                            "--world-size", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2, argv
        assert "must be" in capsys.readouterr().err, argv


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("model") / "run"
    assert cli.main(["train", *TINY, "data=builtin:reversal_train", f"output_dir={run}", "max_steps=1"]) == 0
    return run / "final"


def _damaged(saved_model: Path, tmp_path: Path, damage) -> Path:
    model = tmp_path / "model"
    shutil.copytree(saved_model, model)
    damage(model)
    return model


def _truncate(model: Path) -> None:
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)


def _bad_type(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "two"}))


def _no_tokenizer(model: Path) -> None:
    for f in model.glob("tokenizer*"):
        f.unlink()


@pytest.mark.parametrize("damage, says", [
    (_truncate, "model.safetensors' is truncated: "),
    (_bad_type, "config.json' does not validate: StrictDataclassFieldValidationError: Validation error for field "
                "'num_hidden_layers'"),
    (_no_tokenizer, "tokenizer: "),
])
@pytest.mark.parametrize("command", ["train", "eval", "generate"])
def test_a_damaged_model_is_refused_before_anything_is_written(saved_model, tmp_path, capsys, damage, says, command):
    model = _damaged(saved_model, tmp_path, damage)
    run = f"output_dir={tmp_path / 'run'}"
    argv = {"train": ["train", *TINY, f"model={model}", "data=builtin:reversal_train", run],
            "eval": ["eval", str(model), "--data", "builtin:reversal_test", "--limit", "2"],
            "generate": ["generate", str(model), "--prompt", "hi"]}[command]
    assert cli.main(argv) == 2
    line = _error_line(capsys.readouterr().err)
    assert says in line and "Fix:" in line, line
    if damage is _no_tokenizer:
        assert "holds no tokenizer files (one of tokenizer.json" in line, line
    assert not (tmp_path / "run").exists()
