"""Every config in configs/ validates; each method's tiny config trains through the real CLI, its
loss decreases, and final/ reloads with `revffn.load` and generates."""

from __future__ import annotations

from pathlib import Path

import pytest

from revffn.cli import main
from revffn.data.templates import chat_prompts
from revffn.data.tokenizer import load_tokenizer
from revffn.models.generation import generate_texts
from revffn.models.loading import load
from tests.methods._util import CONFIGS, metrics

ALL = sorted(CONFIGS.glob("*.yaml"))
METHOD_CONFIGS = ["tiny_ckpt", "tiny_lora", "tiny_dora", "tiny_hift", "tiny_refta"]


def test_configs_exist():
    names = {p.stem for p in ALL}
    assert set(METHOD_CONFIGS) <= names, names


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_config_validates(path, capsys, tmp_path):
    import yaml

    cfg = yaml.safe_load(path.read_text())
    extra = []
    if not (cfg["model"].startswith("tiny-") or Path(cfg["model"]).is_dir()):
        # a real-model config (GPU): validate every key and the data with a local stand-in model
        for key in ("data", "eval_data"):
            if cfg.get(key) and not cfg[key].startswith("builtin:") and not Path(cfg[key]).exists():
                extra.append(f"{key}=builtin:quickstart_train")
        extra += ["model=tiny-qwen2-moe", f"output_dir={tmp_path / 'run'}"]
    assert main(["validate", str(path), *extra]) == 0
    assert "config OK" in capsys.readouterr().out
    first = path.read_text().splitlines()[0]
    assert first == f"# revffn train configs/{path.name}", first  # the launch command, verbatim


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
