"""The typed, frozen config: `load_config` builds it once from SCHEMA and each method's SCHEMA; nothing
downstream edits it in place (a changed copy is `replace`), and every field has the type its key declares."""

import dataclasses
import pickle
from pathlib import Path

import pytest

from revffn.methods import METHODS
from revffn.schema import Record, annotation
from revffn.training.config import SCHEMA, TrainConfig, load_config


def test_every_key_is_a_typed_field_and_the_config_is_frozen():
    cfg = load_config(None, ["max_steps=17", "revffn.coupling=additive", "revffn.stream_width=half"])
    hints = TrainConfig.__annotations__
    assert {f.name for f in dataclasses.fields(cfg)} == set(SCHEMA) | {"sections", "source"}
    assert all(hints[k] == annotation(key) for k, key in SCHEMA.items())
    assert cfg.max_steps == 17 and isinstance(cfg.max_steps, int)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_steps = 8
    later = cfg.replace(max_steps=18)
    assert (later.max_steps, cfg.max_steps) == (18, 17)
    cfg.values["max_steps"] = 19  # a copy: the config does not change
    assert cfg.max_steps == 17


def test_method_options_are_records_of_their_own_schema():
    cfg = load_config(None, ["revffn.coupling=additive", "revffn.stream_width=half", "lora.r=4"])
    opts = cfg.options("revffn")
    assert isinstance(opts, Record) and type(opts) is METHODS["revffn"].Options
    assert opts.stream_width == "half" and opts["stream_width"] == "half" and dict(opts)["stream_width"] == "half"
    assert set(opts) == set(METHODS["revffn"].SCHEMA)
    assert cfg.options("lora").r == 4 and cfg.section("lora")["r"] == 4
    assert set(cfg.options("full")) == set(METHODS["full"].SCHEMA)
    assert len(cfg.options("no-such-method")) == 0  # a method without options: an empty record
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.stream_width = "full"
    assert opts.replace(stream_width="full").stream_width == "full" and opts.stream_width == "half"


def test_a_method_instance_holds_the_typed_options():
    cfg = load_config(None, ["revffn.coupling=additive", "revffn.adapter_warmup_ratio=0.5", "max_steps=10"])
    method = METHODS["revffn"](cfg)
    assert method.opts.adapter_warmup_steps == 5  # derived once, on a copy
    assert cfg.options("revffn").adapter_warmup_steps != 5 or cfg.options("revffn").adapter_warmup_ratio is None


def test_the_config_crosses_processes():
    """A restart runs in a child process and a worker gets its config: it pickles, options records included."""
    cfg = load_config(None, ["revffn.coupling=additive", "revffn.stream_width=half"])
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and type(again.options("revffn")) is METHODS["revffn"].Options


def test_the_quickstart_evaluates_its_own_task_only():
    """The quickstart's eval_data is its task's test split: a data override alone drops it (else a run on other
    data would end by scoring the comma task's exact match); given, or with the quickstart's data, it stays."""
    assert load_config(None).eval_data == "builtin:commas_test"
    assert load_config(None, ["model=tiny-qwen2-moe", "max_steps=5"]).eval_data == "builtin:commas_test"
    assert load_config(None, ["data=builtin:reversal_train"]).eval_data is None
    both = load_config(None, ["data=builtin:reversal_train", "eval_data=builtin:reversal_test"])
    assert both.eval_data == "builtin:reversal_test"


def test_a_path_from_home_in_a_yaml_file_is_expanded(tmp_path, monkeypatch):
    """The shell expands `output_dir=~/runs/x` on the command line; YAML kept the `~`, a directory named `~`."""
    monkeypatch.setenv("HOME", str(tmp_path))
    p = tmp_path / "cfg.yaml"
    p.write_text("model: tiny-qwen2-moe\ndata: builtin:reversal_train\nmax_steps: 1\noutput_dir: ~/runs/x\n"
                 "resume: ~/runs/x/c\n")
    cfg = load_config(str(p))
    assert cfg.output_dir == str(tmp_path / "runs" / "x") and cfg.resume == str(tmp_path / "runs" / "x" / "c")


def test_null_clears_a_mapping_the_config_file_sets():
    """`model_config={}` merges into the file's mapping (a merge keeps its keys): null is how to clear it."""
    cfg = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_lora.yaml")
    assert load_config(cfg, []).model_config == {"num_hidden_layers": 2, "hidden_size": 64}
    assert load_config(cfg, ["model_config={}"]).model_config == {"num_hidden_layers": 2, "hidden_size": 64}
    assert load_config(cfg, ["model_config=null"]).model_config == {}
