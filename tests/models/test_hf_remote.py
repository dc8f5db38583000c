"""A revffn `final/` loads with plain transformers (`trust_remote_code`) and generates what `revffn generate`
does, through `generate()` and `pipeline`; its tokenizer loads without remote code; revffn loads it without
a transformers warning; a baseline's `final/` stays a plain HF directory; final/ written before the
remote-code format, or with the nested config.json, loads."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.utils import logging as hf_logging

from revffn.cli import _load_for_cli, main
from revffn.conversion.convert import convert
from revffn.data.templates import chat_prompts
from revffn.methods.base import write_manifest
from revffn.models.generation import generate_ids, stop_ids
from revffn.models.hf_remote import AUTO_MAP, REMOTE_FILES, RevFFNConfig, save_converted
from revffn.models.loading import hf_config, load
from revffn.models.presets import tiny_model

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["model=tiny-qwen2-moe", "max_steps=2", "data=builtin:commas_train", "eval_data=null", "eval_generate_limit=0",
         "per_device_train_batch_size=2", "max_seq_length=32", "save_steps=0", "logging_steps=1"]
REVFFN = ["method=revffn", "revffn.coupling=additive", "revffn.adapter_warmup_steps=0",
          "revffn.adapter_init=coordinate"]  # no calibration text
PROMPTS = ["Put commas between: rope ink tea", "Put commas between: a b"]
NEW_TOKENS = 16

# a fresh interpreter that knows nothing but transformers: load, check the class, generate greedily
HF_SIDE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
final, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True, dtype=torch.float32)
width = max(map(len, prompts))
ids = torch.tensor([[model.generation_config.pad_token_id] * (width - len(p)) + p for p in prompts])
mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
print(json.dumps({"pretrained": isinstance(model, PreTrainedModel), "class": type(model).__name__,
                  "cached": isinstance(out.cache, DynamicCache) and out.cache.get_seq_length(),
                  "width": width, "new": out.sequences[:, width:].tolist()}))
"""


# a fresh interpreter, stdin closed: a "[y/N]" prompt would read EOF (and show in the output), never hang
CLIENT_SIDE = """
import json, sys, torch, transformers
from transformers import AutoTokenizer
final, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(final)  # no trust_remote_code
pipe = transformers.pipeline("text-generation", model=final, trust_remote_code=True, dtype=torch.float32)
chats = [[{"role": "user", "content": p}] for p in prompts]
print(json.dumps({"tokenizer": type(tok).__name__,
                  "rendered": [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats],
                  "texts": [pipe(c, max_new_tokens=new, do_sample=False)[0]["generated_text"][-1] for c in chats]}))
"""


def _train(tmp_path: Path, name: str, *extra: str) -> Path:
    run = tmp_path / name
    assert main(["train", f"output_dir={run}", *TRAIN, *extra]) == 0
    return run / "final"


@pytest.fixture(scope="module")
def rev_final(tmp_path_factory) -> Path:
    """One revffn run's final/ for the tests of this module that only read it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(tmp_path_factory.mktemp("hf_remote"), "rev", *REVFFN)
    finally:
        torch.set_num_threads(before)


def _client_env(tmp_path: Path) -> dict[str, str]:
    """A client's environment: offline, its own remote-code module cache, transformers' default verbosity."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    return env


def _nested_copy(final: Path, out: Path) -> Path:
    """`final` as revffn wrote it before config.json was flat: a `revffn` config with the base inside."""
    shutil.copytree(final, out)
    nested = RevFFNConfig.from_pretrained(final).to_diff_dict()
    assert nested["model_type"] == "revffn" and nested["text_config"]["model_type"] == "qwen2_moe"
    (out / "config.json").write_text(json.dumps(nested))
    return out


def _cut(seq: list[int], stop: set[int]) -> list[int]:
    """HF's new tokens as `generate_ids` returns them: up to the first stop token, without it."""
    return next((seq[:i] for i, t in enumerate(seq) if t in stop), seq)


@pytest.mark.integration
def test_revffn_final_loads_with_transformers_and_generates_as_revffn_generate(rev_final, tmp_path, capsys,
                                                                              one_thread):
    final = rev_final
    capsys.readouterr()
    config = json.loads((final / "config.json").read_text())  # flat: the base's keys, then the wrapper's
    assert config["model_type"] == "qwen2_moe" and config["auto_map"] == AUTO_MAP
    assert config["architectures"] == ["RevFFNModelForCausalLM"] and config["hidden_size"] == 64
    assert config["stream_dtype"] == "float32" and "text_config" not in config
    assert all((final / name).is_file() for name in REMOTE_FILES)

    model, tok = _load_for_cli(str(final))  # what `revffn generate` decodes with
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in chat_prompts(PROMPTS, tok)]
    stop = stop_ids(tok)
    ours = generate_ids(model, prompts, NEW_TOKENS, stop, tok.pad_token_id)
    assert ours == generate_ids(model, prompts, NEW_TOKENS, stop, tok.pad_token_id, use_cache=False)
    assert main(["generate", str(final), *[a for p in PROMPTS for a in ("--prompt", p)],
                 "--max-new-tokens", str(NEW_TOKENS)]) == 0
    printed = capsys.readouterr().out.splitlines()

    proc = subprocess.run([sys.executable, "-c", HF_SIDE, str(final), json.dumps(prompts), str(NEW_TOKENS)],
                          capture_output=True, text=True, env=_client_env(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = json.loads(proc.stdout.strip().splitlines()[-1])
    assert hf["pretrained"] and hf["class"] == "RevFFNModelForCausalLM"
    assert hf["cached"] == hf["width"] + NEW_TOKENS - 1  # generate() decoded with the KV cache
    theirs = [_cut(seq, stop) for seq in hf["new"]]
    assert theirs == ours, (theirs, ours)
    assert any(len(set(seq)) > 2 for seq in ours)  # not a degenerate repetition that would match anyway
    assert printed == [tok.decode(seq, skip_special_tokens=True) for seq in theirs]


@pytest.mark.integration
def test_tokenizer_loads_without_remote_code_and_pipeline_generates_as_revffn_generate(rev_final, tmp_path,
                                                                                       one_thread):
    """Before config.json was flat, `AutoTokenizer.from_pretrained(final)` stopped at "Do you wish to run the
    custom code? [y/N]": transformers 5 reads config.json with AutoConfig first, and `revffn` is no
    model_type it knows."""
    model, tok = _load_for_cli(str(rev_final))
    prompts = chat_prompts(PROMPTS, tok)
    ours = generate_ids(model, [tok(t, add_special_tokens=False)["input_ids"] for t in prompts], NEW_TOKENS,
                        stop_ids(tok), tok.pad_token_id)
    proc = subprocess.run([sys.executable, "-c", CLIENT_SIDE, str(rev_final), json.dumps(PROMPTS), str(NEW_TOKENS)],
                          capture_output=True, text=True, env=_client_env(tmp_path), timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for said in ("custom code", "[y/N]", "trust_remote_code", "to instantiate a model of type"):
        assert said not in proc.stdout + proc.stderr, (said, proc.stdout[-2000:], proc.stderr[-2000:])
    client = json.loads(proc.stdout.strip().splitlines()[-1])
    assert client["tokenizer"] == type(tok).__name__ and client["rendered"] == prompts  # the same chat template
    assert [m["role"] for m in client["texts"]] == ["assistant"] * len(PROMPTS)
    assert [m["content"] for m in client["texts"]] == [tok.decode(seq, skip_special_tokens=True) for seq in ours]
    assert all(m["content"].strip() for m in client["texts"])  # it generated text


def test_revffn_loads_its_final_without_transformers_warnings(rev_final, tmp_path, monkeypatch, one_thread):
    """`revffn eval` / `revffn generate` load a final/ (flat config.json, and nested as written before) without
    "You are using a model of type `revffn` to instantiate a model of type ``": AutoTokenizer, with
    trust_remote_code=False, fell back to a bare config on the nested one."""
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    root, verbosity = hf_logging.get_logger("transformers"), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    root.addHandler(handler)
    try:
        for final in (rev_final, _nested_copy(rev_final, tmp_path / "nested")):
            model, tok = _load_for_cli(str(final))
            assert type(model).__name__ == "RevFFNForCausalLM" and tok.eos_token == "<|end|>"
        logging.getLogger("transformers").warning("the capture works")  # transformers' own logger
    finally:
        root.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    assert [r.getMessage() for r in records] == ["the capture works"]


def test_flat_and_nested_config_json_read_the_same(rev_final, tmp_path):
    """RevFFNConfig (what transformers uses with trust_remote_code) reads the flat config.json as the nested
    one written before; both give revffn's `hf_config` the base config."""
    nested = _nested_copy(rev_final, tmp_path / "nested")
    flat, old = RevFFNConfig.from_pretrained(rev_final), RevFFNConfig.from_pretrained(nested)
    for c in (flat, old):
        assert (c.model_type, c.stream_dtype, c.adapter_skip, c.auto_map) == ("revffn", "float32", True, AUTO_MAP)
    assert flat.get_text_config().to_dict() == old.get_text_config().to_dict()
    for d in (rev_final, nested):
        assert (hf_config(str(d)).model_type, hf_config(str(d)).hidden_size) == ("qwen2_moe", 64)
    flat.save_pretrained(tmp_path / "again")  # what the remote model's save_pretrained writes: flat again
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == \
        json.loads((rev_final / "config.json").read_text())


@pytest.mark.integration
def test_baseline_final_stays_a_plain_hf_directory(tmp_path, one_thread):
    final = _train(tmp_path, "full", "method=full")
    config = json.loads((final / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe" and "auto_map" not in config
    assert not any((final / name).exists() for name in REMOTE_FILES)
    hf = AutoModelForCausalLM.from_pretrained(final, local_files_only=True)  # no remote code
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    tok = _load_for_cli(str(final))[1]
    assert set(GenerationConfig.from_pretrained(final).eos_token_id) == stop_ids(tok)  # stops as revffn generate


def test_final_written_before_the_remote_code_format_still_loads(tmp_path, one_thread):
    """Old final/: the base config as config.json (+ revffn.json); new: a `revffn` config.json. Same model."""
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2)).eval()
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    model.config.save_pretrained(old)
    save_model(model, str(old / "model.safetensors"))
    save_converted(model, new)
    for d in (old, new):
        write_manifest(d, format="revffn", method="revffn", stream_dtype="float32", adapter_init="coordinate")
    ids = torch.randint(3, 500, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
        for d in (old, new):
            assert torch.equal(load(str(d))(ids).logits, ref), d
    assert hf_config(str(new)).model_type == "qwen2_moe" and hf_config(str(new)).hidden_size == 64


def test_skip_adapters_round_trip_and_older_directories_load_without_them(tmp_path, one_thread):
    """A model with (trained, non-zero) skip adapters reloads with them; a remote-code directory written
    before the skips existed (no `adapter_skip` in config.json) builds the four-adapter blocks it holds."""
    ids = torch.randint(3, 500, (2, 9))
    for skip in (True, False):
        model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2), adapter_skip=skip).eval()
        with torch.no_grad():
            for p in model.adapter_parameters():
                p.add_(0.01 * torch.randn_like(p))
        out = tmp_path / f"skip-{skip}"
        out.mkdir()
        save_converted(model, out)
        write_manifest(out, format="revffn", method="revffn", stream_dtype="float32", adapter_init="coordinate")
        config = json.loads((out / "config.json").read_text())
        assert config["adapter_skip"] is skip
        if not skip:  # as written before the key existed
            del config["adapter_skip"]
            (out / "config.json").write_text(json.dumps(config))
        loaded = load(str(out))
        assert all((b.p_skip_attn is not None) is skip for b in loaded.blocks)
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_full_width_round_trips_and_older_directories_load_half_width(tmp_path, one_thread):
    """`stream_width: full` is written to config.json and rebuilt on load (revffn and transformers with remote
    code give the saved model's logits); a directory without the key (written before it) builds half width."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 500, (2, 9))
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2), adapter_skip=True, stream_width="full").eval()
    with torch.no_grad():
        for p in model.adapter_parameters():
            p.add_(0.01 * torch.randn_like(p))
        want = model(ids).logits
    out = tmp_path / "full"
    out.mkdir()
    save_converted(model, out)
    write_manifest(out, format="revffn", method="revffn", stream_dtype="float32", adapter_init="coordinate")
    config = json.loads((out / "config.json").read_text())
    assert config["stream_width"] == "full"
    loaded = load(str(out))
    assert all(b.stream_width == "full" and b.p_up_attn is None for b in loaded.blocks)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
        assert torch.allclose(remote(ids).logits, want, atol=1e-6)
    half = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2), adapter_skip=True).eval()
    old = tmp_path / "old"
    old.mkdir()
    save_converted(half, old)
    write_manifest(old, format="revffn", method="revffn", stream_dtype="float32", adapter_init="coordinate")
    config = json.loads((old / "config.json").read_text())
    del config["stream_width"]
    (old / "config.json").write_text(json.dumps(config))
    assert all(b.stream_width == "half" for b in load(str(old)).blocks)


def test_a_buffered_model_round_trips_and_decodes_with_a_cache(tmp_path):
    """`coupling: buffered` is in config.json: revffn's `load` and transformers' remote code build the buffered
    blocks (no adapters) and give the saved model's logits; decoding token by token with a KV cache (the streams are
    per token; each layer's keys and values cached) gives the full forward's last logits."""
    from transformers import AutoModelForCausalLM, DynamicCache

    ids = torch.randint(3, 500, (2, 9))
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=3), coupling="buffered", buffer_bits=3,
                    buffer_momentum="positive").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
        want = model(ids).logits
        cache, steps = DynamicCache(config=model.config), []
        for t in range(ids.shape[1]):
            out = model(ids[:, t : t + 1], attention_mask=torch.ones(2, t + 1, dtype=torch.long), cache=cache)
            steps.append(out.logits[:, -1])
    assert torch.allclose(torch.stack(steps, 1), want, atol=1e-5)
    out = tmp_path / "buffered"
    out.mkdir()
    save_converted(model, out)
    write_manifest(out, format="revffn", method="revffn", stream_dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert (config["coupling"], config["buffer_bits"], config["buffer_momentum"]) == ("buffered", 3, "positive")
    loaded = load(str(out))
    assert loaded.coupling == "buffered" and loaded.buffer_bits == 3 and loaded.adapter_parameters() == []
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
        assert torch.allclose(remote(ids).logits, want, atol=1e-6)
    # a directory written before `buffer_momentum` ran the negative form, and still does, in both loaders (its
    # copied modeling file calls `convert` without the key: the negative form is convert's default)
    assert convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=1), coupling="buffered").buffer_momentum \
        == "negative"
    del config["buffer_momentum"]
    (out / "config.json").write_text(json.dumps(config))
    model.buffer_momentum = "negative"
    old, remote = load(str(out)), AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        want_old = model(ids).logits
        assert old.buffer_momentum == "negative" and not torch.allclose(want_old, want, atol=1e-5)
        assert torch.equal(old(ids).logits, want_old)
        assert torch.allclose(remote(ids).logits, want_old, atol=1e-6)
