"""Careless input to `revffn train` never ends in a traceback: every case below exits 2 with one
`revffn train: error: ...` line and leaves nothing behind (no output_dir, the inputs unchanged).

The cases are the classes a careless user produces, applied to every file the config names (the
config itself, data, eval_data, model, tokenizer, resume, output_dir): random bytes, non-UTF-8 text,
truncated files, a directory where a file is expected and a file where a directory is expected,
unreadable paths; absurd numbers (0, negative, huge, NaN, inf); and a value of the wrong YAML type
for every key of the schema, method sections included.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from revffn import cli
from revffn.methods import method_section_schema
from revffn.training.config import SCHEMA

TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 1, hidden_size: 32}", "method=full",
        "data=builtin:reversal_train", "eval_data=null", "max_steps=1", "max_seq_length=16", "device=cpu"]
RANDOM = bytes(random.Random(0).randrange(256) for _ in range(600))
NOT_UTF8 = "model: tiny-qwen2-moe\ndata: café.jsonl\n".encode("latin-1")
YAML_TRUNCATED = b"model: tiny-qwen2-moe\ndata: [builtin:quickstart_tr"
JSON_TRUNCATED = b'[{"instruction": "a", "output": "b"}, {"instruction": "c", "outp'
ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _snapshot(root: Path) -> dict:
    return {p: (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _assert_refused(tmp_path: Path, capsys, argv: list[str], output_dir: bool = True) -> str:
    """`revffn train ARGV output_dir=tmp/run`: exit 2, one error line, no traceback, nothing written."""
    out = tmp_path / "run"
    argv = [a.replace("OUT", str(out)) for a in argv]
    if output_dir and not any(a.startswith("output_dir=") for a in argv):
        argv.append(f"output_dir={out}")
    before = _snapshot(tmp_path)
    code = cli.main(["train", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("revffn train: error:")]
    assert code == 2, f"exit {code}: {err[-2000:]}"
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert "Fix" in lines[0] or "expected" in lines[0] or "must be" in lines[0] or "not one of" in lines[0], lines[0]
    assert _snapshot(tmp_path) == before, "something was written or changed"
    return lines[0]


# -- files ------------------------------------------------------------------------------------------
CONFIG_FILES = {"random bytes": RANDOM, "not UTF-8": NOT_UTF8, "truncated": YAML_TRUNCATED,
                "a list, not a mapping": b"- model\n- data\n"}


@pytest.mark.parametrize("case", CONFIG_FILES)
def test_config_file(tmp_path, capsys, case):
    config = _write(tmp_path / "in" / "cfg.yaml", CONFIG_FILES[case])
    _assert_refused(tmp_path, capsys, [str(config), *TINY])


DATA_FILES = {"random.jsonl": RANDOM, "latin1.jsonl": '{"text": "café"}\n'.encode("latin-1"),
              "truncated.json": JSON_TRUNCATED, "random.parquet": RANDOM, "random.csv": RANDOM,
              "empty.jsonl": b"", "scalars.json": b"[1, 2, 3]"}


@pytest.mark.parametrize("key", ["data", "eval_data"])
@pytest.mark.parametrize("name", DATA_FILES)
def test_data_file(tmp_path, capsys, key, name):
    path = _write(tmp_path / "in" / name, DATA_FILES[name])
    _assert_refused(tmp_path, capsys, [*TINY, f"{key}={path}"])


def _model_dir(tmp_path: Path, config: bytes) -> Path:
    return _write(tmp_path / "in" / "model" / "config.json", config).parent


@pytest.mark.parametrize("case", ["random config.json", "truncated config.json", "config.json of no model",
                                  "no weights"])
def test_model_directory(tmp_path, capsys, case):
    config = {"random config.json": RANDOM, "truncated config.json": b'{"model_type": "qwen2_moe", "hidd',
              "config.json of no model": json.dumps({"model_type": "no-such-arch"}).encode(),
              "no weights": json.dumps({"model_type": "qwen2_moe"}).encode()}[case]
    _assert_refused(tmp_path, capsys, [*TINY, f"model={_model_dir(tmp_path, config)}"])


@pytest.mark.parametrize("key", ["data", "eval_data", "model", "tokenizer", "resume"])
def test_directory_where_a_file_is_expected_or_the_reverse(tmp_path, capsys, key):
    """data/eval_data/tokenizer get an empty directory; model and resume, a file (they want directories)."""
    target = _write(tmp_path / "in" / "f.txt", b"hello") if key in ("model", "resume") else tmp_path / "in" / "d"
    target.mkdir(parents=True, exist_ok=True) if key not in ("model", "resume") else None
    _assert_refused(tmp_path, capsys, [*TINY, f"{key}={target}"])


def test_output_dir_is_a_file(tmp_path, capsys):
    out = _write(tmp_path / "in" / "out", b"not a directory")
    _assert_refused(tmp_path, capsys, [*TINY, f"output_dir={out}"])


@pytest.mark.parametrize("key", ["config", "data", "eval_data", "model", "tokenizer", "resume", "output_dir"])
def test_path_through_a_file(tmp_path, capsys, key):
    """A path one of whose parents is a file (ENOTDIR): unreachable as root too."""
    blocker = _write(tmp_path / "in" / "blocker", b"x")
    bad = blocker / ("c.yaml" if key == "config" else "x.jsonl" if "data" in key else "x")
    argv = [str(bad), *TINY] if key == "config" else [*TINY, f"{key}={bad}"]
    _assert_refused(tmp_path, capsys, argv)


@pytest.mark.skipif(ROOT, reason="root reads files whatever their mode")
@pytest.mark.parametrize("key", ["config", "data"])
def test_unreadable_file(tmp_path, capsys, key):
    path = _write(tmp_path / "in" / ("c.yaml" if key == "config" else "d.jsonl"), b'{"text": "a"}\n')
    path.chmod(0)
    try:
        _assert_refused(tmp_path, capsys, [str(path), *TINY] if key == "config" else [*TINY, f"data={path}"])
    finally:
        path.chmod(0o600)


def test_resume_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    ckpt = _write(tmp_path / "in" / "ckpt" / "trainer_state.json", RANDOM).parent
    _assert_refused(tmp_path, capsys, [*TINY, f"resume={ckpt}"])


# -- numbers --------------------------------------------------------------------------------------
ABSURD = [("max_steps", "0"), ("max_steps", "-3"), ("per_device_train_batch_size", "0"),
          ("per_device_train_batch_size", "1000000000000"), ("gradient_accumulation_steps", "-1"),
          ("global_batch_size", "0"), ("global_batch_size", "1000000000000"), ("learning_rate", "0"),
          ("learning_rate", "-1e-4"), ("learning_rate", ".nan"), ("learning_rate", ".inf"), ("warmup_steps", "-1"),
          ("max_grad_norm", ".nan"), ("weight_decay", "-1"), ("adam_beta1", "1.5"), ("adam_epsilon", "0"),
          ("max_seq_length", "1"), ("save_total_limit", "0"), ("logging_steps", "0"), ("min_lr_ratio", "2"),
          ("distributed_timeout", "0"), ("router_aux_loss_coef", "-1"), ("eval_max_new_tokens", "0"),
          ("revffn.adapter_warmup_steps", "-1"), ("lora.r", "0"), ("lora.lora_alpha", ".nan")]


@pytest.mark.parametrize("key, value", ABSURD)
def test_absurd_number(tmp_path, capsys, key, value):
    method = key.split(".")[0] if "." in key else "full"
    _assert_refused(tmp_path, capsys, [*TINY, f"method={method}", f"{key}={value}"])


# -- types ----------------------------------------------------------------------------------------
def _wrong_type_cases() -> list[tuple[str, str]]:
    """(dotted key, a YAML value of a type the key does not take): every key of the schema and of every
    method's section. A mapping for all but mapping-valued keys, which get a list."""
    keys = [(k, key) for k, key in SCHEMA.items()]
    keys += [(f"{m}.{k}", key) for m, section in method_section_schema().items() for k, key in section.items()]
    out = []
    for name, key in keys:
        types = key.type if isinstance(key.type, tuple) else (key.type,)
        out.append((name, "[1, 2]" if dict in types else "{a: 1}"))
    return out


@pytest.mark.parametrize("key, value", _wrong_type_cases())
def test_wrong_yaml_type(tmp_path, capsys, key, value):
    method = ["method=" + key.split(".")[0]] if "." in key else []
    section, _, name = key.rpartition(".")
    if _key(key).path:  # on the command line a path key is the string written (`data=my #1.jsonl`): in the YAML
        config = _write(tmp_path / "cfg" / "c.yaml", (f"{section}:\n  {name}: {value}\n" if section
                                                      else f"{name}: {value}\n").encode())
        argv = [str(config), *[a for a in TINY if not a.startswith(f"{key}=")], *method]
        _assert_refused(tmp_path, capsys, argv, output_dir=key != "output_dir")
    else:
        _assert_refused(tmp_path, capsys, [*TINY, *method, f"{key}={value}"])


def _key(name: str):
    section, _, key = name.rpartition(".")
    return method_section_schema()[section][key] if section else SCHEMA[name]
