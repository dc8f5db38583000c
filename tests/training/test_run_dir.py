"""What a run may do to its output_dir: `overwrite=true` clears only a revffn run (its marker), anything else exits
2 naming what would have been deleted; final/ is swapped so that a kill at any step leaves a loadable one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from revffn import cli
from revffn.training.loop import Recipe
from revffn.training.manifest import read_manifest, write_manifest
from revffn.training.setup import LOCK_FILE, RUN_MARKER
from revffn.training.watch import append_event, read_jsonl

FAULT_RUN = Path(__file__).with_name("fault_run.py")
TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 1, hidden_size: 32}", "data=builtin:reversal_train",
        "eval_data=null", "eval_generate_limit=0", "logging_steps=1", "per_device_train_batch_size=2",
        "max_seq_length=32", "dtype=float32", "device=cpu", "method=full"]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("extra", [[], ["overwrite=true"]])
def test_a_directory_that_is_not_a_run_is_never_written_nor_deleted(tmp_path, capsys, extra):
    run_dir = tmp_path / "thesis"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "report.md").write_text("my report")
    (run_dir / "final" / "thesis.txt").write_text("four years")
    before = _tree(run_dir)
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={run_dir}", *extra]) == 2
    err = capsys.readouterr().err
    assert "not a revffn run (final/, report.md)" in err and "Nothing was touched" in err and "Fix:" in err, err
    assert "Traceback" not in err and _tree(run_dir) == before


def test_a_revffn_run_is_marked_and_overwrite_replaces_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={run_dir}"]) == 0
    assert json.loads((run_dir / RUN_MARKER).read_text())["format"] == "revffn-run"
    assert cli.main(["train", *TINY, "max_steps=2", f"output_dir={run_dir}", "overwrite=true"]) == 0
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in rows if "loss" in line]
    assert steps == [1, 2]
    (run_dir / RUN_MARKER).unlink()  # a run written before the marker: its config.yaml and metrics.jsonl say so
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={run_dir}", "overwrite=true"]) == 0


def test_bad_input_found_while_building_the_model_leaves_the_directory_as_it_was(tmp_path, capsys):
    """A method option the model does not fit is found only once the model is built: a fresh output_dir is not
    left behind (the corrected command then starts), and `overwrite=true` does not delete the run it would replace."""
    bad = ["method=lora", "lora.target_modules=[nonexistent_proj]"]
    fresh = tmp_path / "new" / "run"
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={fresh}", *bad]) == 2
    err = capsys.readouterr().err
    assert "lora.target_modules" in err and "Fix:" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []  # neither run/ nor new/, which the lock had made
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={fresh}"]) == 0
    before = _tree(fresh)
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={fresh}", "overwrite=true", *bad]) == 2
    assert _tree(fresh) == before and "already holds a run" not in capsys.readouterr().err


def test_resuming_a_finished_run_says_it_trains_the_tail_again(tmp_path, capsys):
    """A finished run's last step has no checkpoint (final/ is its model): `resume=true` trains the steps after its
    newest checkpoint again (the resume tests replay runs so), and says so; the run's marker records each finish."""
    run_dir = tmp_path / "run"
    assert cli.main(["train", *TINY, "max_steps=3", "save_steps=2", f"output_dir={run_dir}"]) == 0
    assert json.loads((run_dir / RUN_MARKER).read_text())["finished_step"] == 3
    capsys.readouterr()
    assert cli.main(["train", *TINY, "max_steps=4", "save_steps=2", f"output_dir={run_dir}", "resume=true"]) == 0
    err = capsys.readouterr().err
    assert "the run had finished at step 3; resuming from step-2 trains step 3 again, then on to 4," in err, err
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in rows if "loss" in line] == [1, 2, 3, 4]
    assert json.loads((run_dir / RUN_MARKER).read_text())["finished_step"] == 4
    assert cli.main(["train", *TINY, "max_steps=3", "save_steps=0", f"output_dir={run_dir}", "resume=true"]) == 0
    assert "had finished at step 4; resuming from step-2 trains step 3 again and" in capsys.readouterr().err  # shorter


def test_a_failing_final_exact_match_leaves_the_run_finished(tmp_path, capsys, monkeypatch):
    """The end-of-run exact match runs after final/ is written: its failure is one stderr line, not the run's."""
    from revffn.training.loop import Recipe

    def fail(self):
        raise RuntimeError("generation broke")

    monkeypatch.setattr(Recipe, "exact_match", fail)
    run_dir = tmp_path / "run"
    over = ["eval_data=builtin:reversal_test", "eval_generate_limit=2", "eval_max_new_tokens=2"]
    assert cli.main(["train", *TINY, *over, "max_steps=1", f"output_dir={run_dir}"]) == 0
    captured = capsys.readouterr()
    assert "the final exact-match eval failed (RuntimeError: generation broke); final/ is complete" in captured.err
    assert "eval exact match" not in captured.out and (run_dir / "final" / "config.json").is_file()
    assert json.loads((run_dir / RUN_MARKER).read_text())["finished_step"] == 1


def _load(final: Path):
    model = AutoModelForCausalLM.from_pretrained(final)
    AutoTokenizer.from_pretrained(final)
    return model


@pytest.mark.integration
@pytest.mark.parametrize("kill_at", [1, 2, 3])
def test_a_kill_at_every_step_of_the_final_swap_leaves_a_loadable_final(tmp_path, kill_at):
    """A resumed run re-exports final/ over the old one; killed (SIGKILL) after step `kill_at` of the swap, final/
    loads, old or new, and the next start finds nothing to repair or a leftover it removes."""
    run_dir = tmp_path / "run"
    args = [*TINY, f"output_dir={run_dir}", "save_steps=2"]
    assert cli.main(["train", *args, "max_steps=3"]) == 0  # checkpoint at step 2, final/ at 3
    old = _load(run_dir / "final").state_dict()
    child = subprocess.run([sys.executable, str(FAULT_RUN), f"kill@final:{kill_at}", *args, "max_steps=4",
                            "resume=true"], capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-2000:]
    now = _load(run_dir / "final").state_dict()
    moved = any(not (now[k] == old[k]).all() for k in old)
    assert moved == (kill_at >= 2)  # step 1: written aside; step 2 on: exchanged in
    assert cli.main(["train", *args, "max_steps=4", "resume=true"]) == 0  # its start sweeps what the kill left
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith((".tmp-", ".old-"))) == []
    _load(run_dir / "final")


def _stale_lock(run_dir: Path) -> None:
    """The lock file a start killed while building the model leaves: its holder's name, no flock on it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "gone", "started": "2026-01-01T00:00:00"}))


def test_a_start_killed_while_building_leaves_nothing_that_blocks_the_next(tmp_path, capsys):
    """Its stale lock is taken over: a start with bad input found while building leaves no events.jsonl (the
    killed start's lock file, not the user's, goes), and the corrected start runs, logging the takeover."""
    run_dir = tmp_path / "run"
    _stale_lock(run_dir)
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={run_dir}", "method=lora",
                     "lora.target_modules=[nonexistent_proj]"]) == 2
    assert list(run_dir.iterdir()) == [] and "lora.target_modules" in capsys.readouterr().err
    for extra in ([], ["overwrite=true"]):  # a start killed while building: in a fresh directory, over a run
        _stale_lock(run_dir)
        assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={run_dir}", *extra]) == 0, extra
        assert [e["event"] for e in read_jsonl(run_dir / "events.jsonl")] == ["lock_taken_over"]


def test_max_restarts_over_a_build_that_keeps_failing_leaves_the_directory_as_it_was(tmp_path, capsys, monkeypatch):
    def crash(self):
        raise RuntimeError("injected: the build failed")

    monkeypatch.setattr(Recipe, "build", crash)  # (the attempts are forked: they inherit it)
    fresh = tmp_path / "new" / "run"
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={fresh}", "max_restarts=2"]) == 1
    assert "injected: the build failed" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_resume_after_a_kill_mid_line_in_metrics_and_events(tmp_path, capsys):
    """A process killed while writing a line of metrics.jsonl or events.jsonl leaves it unfinished: the resume
    drops it, and the next event starts on its own line."""
    run_dir = tmp_path / "run"
    assert cli.main(["train", *TINY, "max_steps=2", "save_steps=1", f"output_dir={run_dir}"]) == 0
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    (run_dir / "events.jsonl").write_text('{"event": "stall", "st')
    assert cli.main(["train", *TINY, "max_steps=3", "save_steps=1", f"output_dir={run_dir}", "resume=true"]) == 0
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert read_jsonl(run_dir / "events.jsonl") == []  # (no event in a plain resume; the partial line skipped)
    append_event(run_dir, "restart")
    assert [e["event"] for e in read_jsonl(run_dir / "events.jsonl")] == ["restart"]


def _rewrite(path: Path, damage) -> None:
    """`damage(file)`, then the checkpoint's manifest rehashed: it verifies, as one written so would."""
    damage(path)
    ckpt = path.parent
    write_manifest(ckpt, read_manifest(ckpt)["config"])


@pytest.mark.parametrize("damage", [
    lambda p: _rewrite(p / "optimizer.pt", lambda f: f.write_bytes(b"not a pickle")),
    lambda p: _rewrite(p / "rng.pt", lambda f: f.write_bytes(b"")),
    lambda p: _rewrite(p / "model.safetensors", lambda f: f.write_bytes(f.read_bytes()[:200])),
    lambda p: _rewrite(p / "trainer_state.json", lambda f: f.write_text(json.dumps(
        {**json.loads(f.read_text()), "data_order": {}}))),
], ids=["optimizer", "rng", "truncated_weights", "data_order"])
def test_a_checkpoint_that_verifies_but_does_not_load_is_refused(tmp_path, capsys, damage):
    """Exit 2 naming the checkpoint, the directory as it was; under max_restarts too (it used to start over)."""
    run_dir = tmp_path / "run"
    assert cli.main(["train", *TINY, "max_steps=2", "save_steps=1", f"output_dir={run_dir}"]) == 0
    damage(run_dir / "checkpoints" / "step-1")
    before = _tree(run_dir)
    for extra in ([], ["max_restarts=2"]):
        assert cli.main(["train", *TINY, "max_steps=3", f"output_dir={run_dir}", "resume=true", *extra]) == 2
        err = capsys.readouterr().err
        assert "checkpoints/step-1' verifies but does not load" in err and "Fix:" in err, err
        assert "Traceback" not in err and _tree(run_dir) == before


def test_a_resume_past_max_steps_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", *TINY, "max_steps=3", "save_steps=2", f"output_dir={run_dir}"]) == 0
    before = _tree(run_dir)
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={run_dir}", "resume=true"]) == 2
    err = capsys.readouterr().err
    assert "max_steps: 1 is below the step of the checkpoint" in err and "(step 2)" in err and "Fix:" in err, err
    assert _tree(run_dir) == before


def test_an_output_dir_that_cannot_be_made_is_refused_before_anything(tmp_path, capsys, monkeypatch):
    """A dangling symbolic link on its path, or a parent this user cannot write to: exit 2 naming it (both were a
    traceback from mkdir, after the model was built)."""
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={tmp_path / 'link' / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "link' is a symbolic link to" in err and "which does not exist. Fix:" in err, err
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere: the permission it lacks elsewhere, as os.access would say
        monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked)
    assert cli.main(["train", *TINY, "max_steps=1", f"output_dir={locked / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"would be made in {str(locked)!r}, which is not writable by this user" in err and "Fix:" in err, err
    assert list(locked.iterdir()) == []
