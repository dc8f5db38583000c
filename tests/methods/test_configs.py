"""Every config in configs/ validates; each method's tiny config trains through the real CLI, its
loss decreases, and final/ reloads with `revffn.load` and generates; every real-model preset has a config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from revffn.cli import main
from revffn.data.templates import chat_prompts
from revffn.data.tokenizer import load_tokenizer
from revffn.models.generation import generate_texts
from revffn.models.loading import GEOMETRY_DIR, config_presets, load
from tests.methods._util import CONFIGS, metrics

ALL = sorted(CONFIGS.glob("*.yaml"))
METHOD_CONFIGS = ["tiny_ckpt", "tiny_lora", "tiny_dora", "tiny_hift", "tiny_refta"]


def test_configs_exist():
    names = {p.stem for p in ALL}
    assert set(METHOD_CONFIGS) <= names, names


@pytest.mark.parametrize("preset", config_presets())
def test_every_real_model_preset_has_a_config_naming_its_hub_id(preset):
    """`revffn estimate --model PRESET` -> configs/PRESET_revffn.yaml trains the model it describes, by the
    Hub ID its geometry was copied from (`_source` in revffn/models/geometries/PRESET.json)."""
    import yaml

    source = json.loads((GEOMETRY_DIR / f"{preset}.json").read_text())["_source"].split()[0]
    assert yaml.safe_load((CONFIGS / f"{preset}_revffn.yaml").read_text())["model"] == source


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_config_validates(path, capsys, tmp_path, monkeypatch):
    """Headed by its launch command, verbatim (`revffn train configs/X.yaml`, or torchrun's for a sharded one:
    validated then in the environment torchrun gives rank 0); a real model's config with a local stand-in."""
    import yaml

    first = path.read_text().splitlines()[0]
    launch = re.fullmatch(rf"# (?:torchrun --nproc-per-node (\d+) -m revffn|revffn) train configs/"
                          rf"{re.escape(path.name)}", first)
    assert launch, first
    if launch[1]:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", launch[1])
    cfg = yaml.safe_load(path.read_text())
    extra = []
    if not (cfg["model"].startswith("tiny-") or Path(cfg["model"]).is_dir()):
        # a real-model config (GPU): validate every key and the data with a local stand-in model
        for key in ("data", "eval_data"):
            if cfg.get(key) and not cfg[key].startswith("builtin:") and not Path(cfg[key]).exists():
                extra.append(f"{key}=builtin:reversal_train")
        extra += ["model=tiny-qwen2-moe", f"output_dir={tmp_path / 'run'}"]
    assert main(["validate", str(path), *extra]) == 0
    assert "config OK" in capsys.readouterr().out


@pytest.mark.parametrize("name", METHOD_CONFIGS)
def test_config_trains_and_reloads(name, tmp_path):
    run = tmp_path / "run"
    steps = 6
    rc = main(["train", str(CONFIGS / f"{name}.yaml"), f"max_steps={steps}", f"output_dir={run}",
               "eval_data=null", "save_steps=0", "per_device_train_batch_size=4", "max_seq_length=48"])
    assert rc == 0
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-2:]) / 2
    assert last < first, [r["loss"] for r in rows]
    model = load(str(run / "final"))
    tok = load_tokenizer(str(run / "final"))
    out = generate_texts(model, tok, chat_prompts(["What is 3 + 4?"], tok), max_new_tokens=4)
    assert len(out) == 1 and isinstance(out[0], str)
