"""Bad input: one clear message naming FILE:LINE or the key, exit code 2, nothing written."""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from revffn import cli
from revffn.models.model_config import grouped_mm_runs
from revffn.training.config import QUICKSTART
from revffn.training.manifest import config_sha256
from revffn.training.setup import RUN_MARKER
from tests.training._util import BUFFERED, TINY, files_state, flip_byte, train_tiny


def _cfg(tmp_path: Path, **over) -> Path:
    data = tmp_path / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f"ok {i}"}) + "\n" for i in range(8)))
    cfg = {"model": "tiny-qwen2-moe", "method": "revffn", "data": str(data), "output_dir": str(tmp_path / "run"),
           "max_steps": 2, "save_steps": 1, "max_seq_length": 64}
    cfg.update(over)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fails(capsys, argv, *needles):
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    return err


def test_missing_config(tmp_path, capsys):
    _fails(capsys, ["train", str(tmp_path / "nope.yaml")], "nope.yaml", "not found")


def test_unreadable_config(tmp_path, capsys):
    d = tmp_path / "dir.yaml"
    d.mkdir()
    _fails(capsys, ["train", str(d)], "dir.yaml", "is a directory")


def test_yaml_syntax_error_names_the_line(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("model: tiny-qwen2-moe\nmethod: revffn\ndata: [unclosed\nmax_steps: 3\n")
    _fails(capsys, ["train", str(p)], "bad.yaml:", "YAML syntax error")


def test_unknown_key_suggests_closest(tmp_path, capsys):
    p = _cfg(tmp_path, learning_rat=0.1)
    _fails(capsys, ["train", str(p)], "learning_rat", "Did you mean 'learning_rate'", "cfg.yaml:")


def test_unknown_method_key_suggests_closest(tmp_path, capsys):
    p = _cfg(tmp_path, revffn={"adapter_warmup_step": 1})
    _fails(capsys, ["train", str(p)], "revffn.adapter_warmup_step", "adapter_warmup_steps")


@pytest.mark.parametrize("key,value,needle", [
    ("max_steps", 0, "max_steps: must be >= 1"),
    ("max_steps", "ten", "max_steps: expected an integer"),
    ("learning_rate", -1e-3, "learning_rate: must be > 0"),
    ("per_device_train_batch_size", 0, "per_device_train_batch_size: must be >= 1"),
    ("lr_scheduler_type", "cosin", "Did you mean 'cosine'"),
    ("report_to", "tensorbord", "report_to: 'tensorbord' is not one of none, tensorboard, wandb, mlflow. Did you mean "
                                "'tensorboard'?"),
    ("report_to", "tensorboard,wandbb", "report_to: 'wandbb' is not one of"),
])
def test_wrong_type_or_range(tmp_path, capsys, key, value, needle):
    p = _cfg(tmp_path, **{key: value})
    _fails(capsys, ["train", str(p)], needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("report_to,message", [
    ("wandb", "report_to: 'wandb' needs the wandb package, which is not installed. Fix: pip install wandb (every "
              "tracker: pip install 'revffn[track]'), or remove wandb from report_to."),
    ("tensorboard,mlflow", "needs the tensorboard, mlflow packages, which are not installed. Fix: pip install "
                           "tensorboard mlflow"),
])
def test_missing_tracker_package(tmp_path, capsys, monkeypatch, report_to, message):
    """A tracker whose package is not installed stops the run before anything is written or built."""
    for name in ("tensorboard", "wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    err = _fails(capsys, ["train", str(_cfg(tmp_path, report_to=report_to))], message)
    assert len([line for line in err.splitlines() if "report_to" in line]) == 1
    assert not (tmp_path / "run").exists()


def test_all_problems_reported_at_once(tmp_path, capsys):
    p = _cfg(tmp_path, max_steps=0, learning_rate=-1.0, foo=1)
    err = _fails(capsys, ["train", str(p)], "3 problems", "max_steps", "learning_rate", "foo")
    assert err.count(" - ") >= 3


def test_override_errors_and_overrides_win(tmp_path, capsys):
    p = _cfg(tmp_path)
    _fails(capsys, ["validate", str(p), "max_steps=-4"], "override", "max_steps")
    assert cli.main(["validate", str(p), "max_steps=7", "revffn.buffer_bits=4"]) == 0


def test_missing_data_file(tmp_path, capsys):
    p = _cfg(tmp_path, data=str(tmp_path / "missing.jsonl"))
    _fails(capsys, ["train", str(p)], "missing.jsonl", "data")
    assert not (tmp_path / "run").exists()


def test_malformed_json_line(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "fine"}\n{"text": broken}\n')
    _fails(capsys, ["train", str(_cfg(tmp_path))], "train.jsonl:2")


def test_example_missing_fields(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "fine"}\n{"text": "ok"}\n{"instruction": "no output here"}\n')
    _fails(capsys, ["train", str(_cfg(tmp_path))], "train.jsonl:3", "output")


def test_empty_after_truncation(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"instruction": "word " * 200, "output": "x"}) + "\n")
    _fails(capsys, ["train", str(_cfg(tmp_path, max_seq_length=16))], "max_seq_length")


def test_responses_cut_by_truncation_are_said_once_and_kept_in_events(tmp_path, capsys):
    """3 prompts too long for their response (left out), 1 response cut at its end, 4 whole: one line, one event."""
    data = tmp_path / "train.jsonl"
    rows = [{"instruction": "word " * 40, "output": "x"}] * 3 + [{"instruction": "a", "output": "b " * 40}] + \
        [{"instruction": "a b", "output": "b a"}] * 4
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["train", str(_cfg(tmp_path, max_seq_length=16, max_steps=1))]) == 0
    err = capsys.readouterr().err
    assert ("data: 4 of 8 examples lost tokens they train on (a response's end, a text's) to truncation at "
            "max_seq_length=16, 3 of them all of it (left out)") in err, err
    (event,) = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert (event["event"], event["n_cut"], event["n_dropped"], event["n_examples"]) == ("data_truncated", 4, 3, 8)


def test_a_batch_larger_than_the_data_is_refused_saying_what_truncation_took(tmp_path, capsys):
    _fails(capsys, ["train", str(_cfg(tmp_path, per_device_train_batch_size=16))],
           "= 16 rows a step, but data holds 8: every step would repeat examples. Fix: a smaller batch")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [{"instruction": "word " * 40, "output": "x"}] * 3
                            + [{"instruction": "a b", "output": "b a"}] * 5))
    _fails(capsys, ["train", str(_cfg(tmp_path, per_device_train_batch_size=6, max_seq_length=16))],
           "but data holds 5 (3 of its 8 examples lost all they train on to truncation at max_seq_length=16)",
           "a larger max_seq_length")


def test_unknown_method_and_preset(tmp_path, capsys):
    _fails(capsys, ["train", str(_cfg(tmp_path, method="revfn"))], "revfn", "Did you mean 'revffn'")
    _fails(capsys, ["train", str(_cfg(tmp_path, model="tiny-qwen2-mo"))], "tiny-qwen2-mo", "tiny-qwen2-moe")
    _fails(capsys, ["train", str(_cfg(tmp_path)), "lora.rr=8"], "Did you mean 'lora.r'?")  # what to type, not 'r'


def test_model_dir_without_config_json(tmp_path, capsys):
    d = tmp_path / "empty_model"
    d.mkdir()
    _fails(capsys, ["train", str(_cfg(tmp_path, model=str(d)))], "config.json")


def test_resume_without_checkpoint(tmp_path, capsys):
    _fails(capsys, ["train", str(_cfg(tmp_path, resume=True))], "resume", "no complete checkpoint")


def test_refuses_existing_run_and_touches_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("precious\n")
    (run / RUN_MARKER).write_text("{}")  # a revffn run (without it, not a run: tests/training/test_run_dir.py)
    _fails(capsys, ["train", str(_cfg(tmp_path))], "already holds a run", "overwrite=true")
    assert (run / "metrics.jsonl").read_text() == "precious\n"
    assert sorted(p.name for p in run.iterdir()) == [RUN_MARKER, "metrics.jsonl"]


def _resume_fails(capsys, trained_run, tmp_path, over, *needles, damage=None):
    """A resume of a copy of the trained run with `over`: exit 2, every needle in the message, and no file
    of the run modified (bytes, mtime, mode)."""
    run = shutil.copytree(trained_run, tmp_path / "run")
    if damage:
        damage(run / "checkpoints")
    before = files_state(run)
    err = _fails(capsys, ["train", str(QUICKSTART), *TINY, f"output_dir={run}", *over], *needles)
    assert files_state(run) == before
    return err


@pytest.mark.parametrize("over,says,was,fix", [
    (["method=full"], "method='full'", "method='revffn'", "method=revffn"),
    (["model=tiny-olmoe"], "model='tiny-olmoe'", "model='tiny-qwen2-moe'", "model=tiny-qwen2-moe"),
    (["dtype=bfloat16"], "dtype='bfloat16'", "dtype='float32'", "dtype=float32"),
    (["revffn.freeze_router=false"], "revffn.freeze_router=False", "revffn.freeze_router=True",
     "revffn.freeze_router=true"),
    (["learning_rate=0.5", "seed=7"], "seed=7, learning_rate=0.5", "seed=0, learning_rate=0.001",
     "seed=0 learning_rate=0.001"),
], ids=["method", "model", "dtype", "method-option", "two-keys"])
def test_resume_refuses_a_change_of_the_math(capsys, trained_run, tmp_path, over, says, was, fix):
    _resume_fails(capsys, trained_run, tmp_path, ["resume=true", *over], f"the config says {says}, but checkpoint",
                  f"was trained with {was}, which changes the math", f"Fix: resume with the checkpoint's value {fix}, ")


def test_resume_of_a_checkpoint_from_before_the_skip_adapters(capsys, trained_run, tmp_path):
    """A checkpoint whose config predates `revffn.adapter_skip` was trained without the skips: resuming it with
    the new default is refused, naming the key and the value to resume with."""
    def drop_key(checkpoints):
        for manifest in checkpoints.glob("step-*/manifest.json"):
            m = json.loads(manifest.read_text())
            del m["config"]["revffn.adapter_skip"]
            m["config_sha256"] = config_sha256(m["config"])  # as a manifest of that time was: consistent
            manifest.write_text(json.dumps(m))
    _resume_fails(capsys, trained_run, tmp_path, ["resume=true"], "the config says revffn.adapter_skip=True",
                  "was trained with revffn.adapter_skip=False", "Fix: resume with the checkpoint's value "
                  "revffn.adapter_skip=false", damage=drop_key)


def _drop_keys(*keys):
    def drop(checkpoints):
        for manifest in checkpoints.glob("step-*/manifest.json"):
            m = json.loads(manifest.read_text())
            for key in keys:
                del m["config"][key]
            m["config_sha256"] = config_sha256(m["config"])
            manifest.write_text(json.dumps(m))
    return drop


def test_resume_of_a_buffered_checkpoint_from_before_the_momentum_sign(capsys, tmp_path):
    """A buffered run from before `revffn.buffer_momentum` ran the negative form: resuming it with the default
    (positive) is refused, naming the value to resume with; an additive run, which never read the key, resumes."""
    trained = train_tiny(tmp_path / "buffered", base=BUFFERED)
    _drop_keys("revffn.buffer_momentum")(trained / "checkpoints")
    before = files_state(trained)
    _fails(capsys, ["train", str(QUICKSTART), *BUFFERED, f"output_dir={trained}",
                    "resume=true"], "the config says revffn.buffer_momentum='positive'",
           "was trained with revffn.buffer_momentum='negative'", "revffn.buffer_momentum=negative")
    assert files_state(trained) == before
    additive = train_tiny(tmp_path / "additive")
    _drop_keys("revffn.buffer_momentum", "revffn.coupling")(additive / "checkpoints")
    assert cli.main(["train", str(QUICKSTART), *TINY, f"output_dir={additive}", "resume=true", "max_steps=3"]) == 0


def test_resume_path_of_another_models_checkpoint(capsys, trained_run, tmp_path):
    ckpt = trained_run / "checkpoints" / "step-1"
    _resume_fails(capsys, trained_run, tmp_path, [f"resume={ckpt}", "model=tiny-mixtral"], "model='tiny-mixtral'",
                  "Fix: resume with the checkpoint's value model=tiny-qwen2-moe")


def test_resume_path_that_is_not_a_checkpoint(capsys, trained_run, tmp_path):
    _resume_fails(capsys, trained_run, tmp_path, [f"resume={trained_run / 'final'}"], "is not a checkpoint",
                  "Fix: point resume at a checkpoints/step-N")


@pytest.mark.parametrize("damage,needle", [
    (lambda c: flip_byte(c / "model.safetensors"), "model.safetensors: sha256 mismatch"),
    (lambda c: (c / "manifest.json").unlink(), "manifest.json missing"),  # e.g. written before manifests
], ids=["weights", "no-manifest"])
def test_resume_path_of_a_damaged_checkpoint(capsys, trained_run, tmp_path, damage, needle):
    ckpt = tmp_path / "run" / "checkpoints" / "step-1"
    _resume_fails(capsys, trained_run, tmp_path, [f"resume={ckpt}"], f"fails verification: {needle}",
                  "Fix: resume=true", damage=lambda c: damage(c / "step-1"))


def test_resume_when_no_checkpoint_verifies(capsys, trained_run, tmp_path):
    _resume_fails(capsys, trained_run, tmp_path, ["resume=true"], "no checkpoint in", "verifies (step-1: optimizer.pt: "
                  "sha256 mismatch", "Fix: restore", damage=lambda c: flip_byte(c / "step-1" / "optimizer.pt", 100))


@pytest.mark.parametrize("over,needle", [
    ("model_config.num_hiden_layers=1", "model_config.num_hiden_layers: Qwen2MoeConfig (tiny-qwen2-moe) has no setting "
                                        "'num_hiden_layers'. Did you mean 'num_hidden_layers'? Fix:"),
    ("model_config.hidden_size=abc", "model_config.hidden_size: expected an integer (the model's is 64), got 'abc'. "
                                     "Fix: model_config.hidden_size=64 or another integer."),
    ("model_config.num_hidden_layers=-1", "model_config.num_hidden_layers: must be at least 1, got -1. Fix:"),
    ("model_config.tie_word_embeddings=3", "model_config.tie_word_embeddings: expected a boolean"),
    ("model_config={num_hidden_layers:1}", "YAML reads 'num_hidden_layers:1', with no space after the colon, as one "
                                           "key: write `num_hidden_layers: 1`."),
    # values that build but failed at the first step, after the run directory was written
    ("model_config.num_experts_per_tok=100", "model_config: num_experts_per_tok=100 is more than the 8 experts there "
                                             "are. Fix: num_experts_per_tok between 1 and 8."),
    ("model_config.num_key_value_heads=3", "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("model_config.attention_dropout=2.0", "attention_dropout=2.0 is not a probability. Fix:"),
    ("model_config.hidden_size=36", "the attention heads would be 9 wide (hidden_size=36 / num_attention_heads=4): "
                                    "rotary embeddings rotate pairs"),
    ("model_config.vocab_size=10", "model_config.vocab_size: 10 is below the tokenizer's"),
    # values transformers does not build with (a traceback from its modules)
    ("model_config.hidden_act=foo", "'hidden_act': 'foo'}: KeyError: 'foo'. Fix:"),
    ("model_config.decoder_sparse_step=0", "ZeroDivisionError"),
    ("model_config.pad_token_id=100000", "AssertionError: Padding_idx must be within num_embeddings. Fix:"),
], ids=["misspelled", "type", "range", "bool", "colon", "top_k", "kv_heads", "dropout", "odd_head", "vocab", "act",
         "sparse_step", "pad"])
@pytest.mark.parametrize("command", ["train", "validate"])
def test_model_config_is_checked_against_the_models_config(tmp_path, capsys, over, needle, command):
    """A misspelled key used to be stored unread (the model built without it), a wrong type to end in a traceback."""
    p = _cfg(tmp_path, model_config={"num_hidden_layers": 1, "hidden_size": 64})
    _fails(capsys, [command, str(p), over], needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model,over", [
    ("tiny-qwen2-moe", "model_config.pad_token_id=1000"),  # in the tokenizer's 2048 (the preset's own vocab: 512)
    ("tiny-qwen3-moe", "model_config={num_attention_heads: 6, num_key_value_heads: 3}"),  # head_dim set: 64 % 6 is ok
    ("tiny-olmoe", "model_config={num_key_value_heads: 4, attention_dropout: 0.5}"),
])
def test_model_config_checks_refuse_nothing_the_model_takes(tmp_path, capsys, model, over):
    p = _cfg(tmp_path, model=model, model_config={"num_hidden_layers": 1})
    assert cli.main(["train", str(p), over, "max_steps=1"]) == 0, capsys.readouterr().err


def test_model_config_keeps_a_pretrained_models_weight_shapes(tmp_path, capsys):
    """Its depth may be cut; a width would not load (it was a traceback from transformers' load report)."""
    p = _cfg(tmp_path, model="builtin:base", model_config={"num_hidden_layers": 1})
    assert cli.main(["validate", str(p)]) == 0
    _fails(capsys, ["train", str(p), "model_config.hidden_size=64"], "model_config: builtin:base is pretrained, and "
           "with hidden_size=64 its weight model.embed_tokens.weight would have shape [2048, 64], not the stored "
           "[2048, 256]", "Fix: drop those keys")
    assert not (tmp_path / "run").exists()


def test_a_key_given_twice_names_both_lines(tmp_path, capsys):
    p = _cfg(tmp_path)
    p.write_text(p.read_text() + "max_steps: 5\n")  # YAML keeps the last silently
    line = len(p.read_text().splitlines())
    _fails(capsys, ["validate", str(p)], f"cfg.yaml:{line}: key 'max_steps' is given twice (first at line", "Fix:")
    _fails(capsys, ["validate", str(_cfg(tmp_path)), "model_config={hidden_size: 64, hidden_size: 32}"],
           "override model_config: key 'hidden_size' is given twice")


@pytest.mark.parametrize("over,needle", [
    ("output_dir=", "output_dir: is empty. Fix:"),
    ("resume=", "resume: is empty. Fix: resume=true"),
    ("max_steps=ten", "max_steps: expected an integer, got 'ten' (str). Fix: an integer"),
    ("revffn.buffer_bits=9", "revffn.buffer_bits: must be <= 8, got 9. Fix: a value >= 1 and <= 8 (the default: 6)."),
])
def test_empty_and_out_of_range_values_say_the_fix(tmp_path, capsys, monkeypatch, over, needle):
    monkeypatch.chdir(tmp_path)  # an empty output_dir used to run into the current directory
    _fails(capsys, ["train", str(_cfg(tmp_path)), over], needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml", "train.jsonl"]


def test_teacher_cache_that_is_a_file(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    p = _cfg(tmp_path, revffn={"adapter_warmup_steps": 1, "coupling": "additive", "distill_coef": 0.5,
                               "distill_teacher": "cached", "teacher_cache": str(tmp_path / "notes.txt")})
    _fails(capsys, ["train", str(p)], "revffn.teacher_cache=", "is a file, not a directory. Fix:")
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("over,needle", [
    (["method=lora", "lora.target_modules=[nonexistent_proj]"], "lora.target_modules: 'nonexistent_proj' matches no"),
    (["method=lora", "lora.lora_dropout=0.1"], "lora.lora_dropout=0.1 cannot apply to the parameter targets"),
    (["method=refta", "refta.target_modules=[gate]"], "refta.target_modules: ['gate'] match no nn.Linear module"),
    # the loss reads the head's weight itself: an adapter on it never trained (alone: a RuntimeError at step 1)
    *((["method=" + m, f"{m}.target_modules=[q_proj, lm_head]"], f"{m}.target_modules: 'lm_head' matches the LM head")
      for m in ("lora", "dora", "refta")),
], ids=["lora-target", "lora-dropout-experts", "refta-target", "lora-head", "dora-head", "refta-head"])
def test_validate_prepares_the_method_on_the_models_modules(tmp_path, capsys, over, needle):
    """Found by preparing the method on the model built on the meta device: validate no longer says "config OK"
    for what train then refuses."""
    _fails(capsys, ["validate", str(_cfg(tmp_path)), *over], needle, "Fix:")
    assert cli.main(["validate", str(_cfg(tmp_path)), over[0]]) == 0
    assert "the method prepared on the model's modules" in capsys.readouterr().out


def test_resume_of_a_checkpoint_whose_step_is_not_a_count(capsys, trained_run, tmp_path):
    """A trainer state that its manifest vouches for (rehashed) but whose step is not a count: exit 2, not a
    TypeError, and the run's files (its marker included) as they were."""
    def damage(ckpts):
        step = ckpts / "step-1"
        (step / "trainer_state.json").write_text(json.dumps({"step": "x"}))
        manifest = json.loads((step / "manifest.json").read_text())
        manifest["files"]["trainer_state.json"] = hashlib.sha256((step / "trainer_state.json").read_bytes()).hexdigest()
        (step / "manifest.json").write_text(json.dumps(manifest))

    _resume_fails(capsys, trained_run, tmp_path, ["resume=true"], "holds step 'x', not a step count", "Fix:",
                  damage=damage)


def test_model_config_takes_what_transformers_takes(tmp_path, capsys):
    """Not refused: a float YAML 1.1 reads as a string (`1e-5`: no dot), made a float as config keys' values are, and
    transformers 5's older keyword `rope_theta` (taken into rope_parameters)."""
    p = _cfg(tmp_path, method="full", save_steps=0, max_steps=1,
             model_config={"num_hidden_layers": 1, "hidden_size": 64})
    assert cli.main(["validate", str(p), "model_config.rope_theta=20000.0"]) == 0
    assert cli.main(["train", str(p), "model_config.rms_norm_eps=1e-5"]) == 0
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-5 and config["num_hidden_layers"] == 1


def test_validate_checks_a_config_torchrun_launches(tmp_path, capsys, monkeypatch):
    """Before torchrun starts it: its strategy's refusals, then the rest as one process (it used to refuse any
    distributed config for lack of RANK/WORLD_SIZE)."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    p = _cfg(tmp_path, distributed="fsdp", model_config={"num_hidden_layers": 1})
    assert cli.main(["validate", str(p)]) == 0
    assert "distributed=fsdp: its checks passed, the rest checked as one process" in capsys.readouterr().out
    _fails(capsys, ["validate", str(p), "optimizer=adamw8bit"], "distributed: fsdp shards the optimizer state")
    assert not (tmp_path / "run").exists()


def test_eval_max_new_tokens_past_the_models_positions(tmp_path, capsys):
    # the final exact-match eval would have decoded 100000 tokens on at untrained positions, hours after the start
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f"ok {i}"}) + "\n" for i in range(8)))
    cfg = _cfg(tmp_path, eval_data=str(data), eval_max_new_tokens=100000)
    _fails(capsys, ["train", str(cfg)], "eval_max_new_tokens 100000: the model has 2048 positions",
           "Fix: eval_max_new_tokens 2047 or less")
    assert not (tmp_path / "run").exists()
    assert cli.main(["validate", str(_cfg(tmp_path, eval_data=str(data), eval_max_new_tokens=2000))]) == 0


@pytest.mark.skipif(not grouped_mm_runs("cpu"), reason="no grouped_mm on this torch's CPU: transformers loops")
@pytest.mark.parametrize("dtype,hidden,says", [
    ("float32", 42, "42 is not. Fix: hidden_size multiples of 4 (this preset derives its "
                    "expert widths from hidden_size: e.g. hidden_size=48)"),
    ("float32", 44, "multiple of 4 in float32 (16-byte rows), and 22 is not. Fix: moe_intermediate_size multiples "
                    "of 4"),
    ("bfloat16", 44, "multiple of 8 in bfloat16 (16-byte rows), and 44 is not."),
])
def test_expert_widths_grouped_mm_cannot_take(tmp_path, capsys, dtype, hidden, says):
    """It was "RuntimeError: strides should be multiple of 16 bytes" from torch at the first step, after the run's
    directory was written (tiny-qwen3-moe's expert width is half its hidden_size)."""
    p = _cfg(tmp_path, model="tiny-qwen3-moe", dtype=dtype,
             model_config={"num_hidden_layers": 1, "hidden_size": hidden, "head_dim": 16})
    _fails(capsys, ["train", str(p)], "model_config: the experts' weight model.layers.0.mlp.experts.", says)
    assert not (tmp_path / "run").exists()
    assert cli.main(["train", str(p), "model_config.hidden_size=48", "max_steps=1"]) == 0, capsys.readouterr().err
