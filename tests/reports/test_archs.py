"""The architecture sweep (`revffn archs`): every HF causal LM, MoE and dense, tiny, reversible vs plain.

`TODAY` is the sweep's result on the current engine (transformers 5.25), per family. The test is a
ratchet: an `exact` type must stay exact; any other type may only stay as it is or become exact or
refused; a type not listed (a dense type refused today, or a newer transformers) must be exact or
refused. The committed docs/architectures.json is held to the same ratchet, and a fresh sweep must
keep every type it calls exact. Issue 11's goal is no `wrong`, `unfaithful`, `crash` or
`build-error` at all: shrink `TODAY` as the engine learns.
"""

import json
from pathlib import Path

import pytest
import torch
import transformers

from revffn import cli
from revffn.models.tiny_any import dense_model_types, model_families, moe_model_types, stochastic_keys, tiny_config_for
from revffn.reports.archs import grad_error, run_archs, sweep_one
from revffn.reports.render.archs import render_markdown, summary
from tests.conftest import needs_model_types

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "architectures.json"

EXACT = ("afmoe aria_text axk1 axk2 bailing_hybrid cohere2_moe dbrx deepseek_v2 deepseek_v3 deepseek_v32 dots1 "
         "dots3_note_text ernie4_5_moe exaone_moe flex_olmo flint glm4_moe glm4_moe_lite glm_moe_dsa gpt_oss "
         "granitemoe granitemoe_swa granitemoehybrid granitemoeshared hunyuan_v1_moe hy_v3 jamba jetmoe "
         "kimi_linear kolibri1 laguna lara_mini lfm2_moe llama4_text mellum mimo_v2_flash minicpm5_moe minimax_m2 "
         "minimax_m3_vl_text mixtral olmoe param2moe phimoe qwen2_moe qwen3_5_moe_text qwen3_moe qwen3_next "
         "sarvam_mla sarvam_moe solar_open").split()
MOE_TODAY = {
    **dict.fromkeys(EXACT, "exact"),
    **dict.fromkeys(("beam deepseek_v4 doge ergo gemma4_text hy_v4 inkling2_loop_text inkling2_text inkling_text "
                     "kolibri1_1 longcat_flash minimax nemotron_h qwen4_exp_text zaya").split(), "refused"),
}
DENSE_EXACT = ("arcee bitnet cwm diffllama emu3 ernie4_5 exaone gemma glm helium hunyuan_v1_dense internlm3 "
               "iquestcoder jais2 llama ministral mistral nemotron phi3 qwen2 qwen3 seed_oss smollm3 stablelm "
               "starcoder2 youtu").split()
DENSE_TODAY = {  # the dense types refused today (gpt2, bert, gemma2, ...) are not listed: refused or exact is allowed
    **dict.fromkeys(DENSE_EXACT, "exact"),
    # the final norm has no weight (olmo); the attention needs position_ids beside the position embeddings
    **dict.fromkeys(("ministral3 olmo").split(), "crash"),
    **dict.fromkeys(("cohere_compass_text dory gemma3n gemma3n_text gemma4_assistant gemma4_unified_assistant "
                     "musicgen musicgen_melody zamba").split(), "build-error"),
}
TODAY = {**MOE_TODAY, **DENSE_TODAY}
FAMILY = {**dict.fromkeys(MOE_TODAY, "moe"), **dict.fromkeys(DENSE_TODAY, "dense")}
# the five tiny presets' types and a few others: one of each layout family, seconds in all; dense
# llama, mistral, qwen2, qwen3, gemma, and gemma2 (refused by name)
FAST = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss", "hunyuan_v1_moe",
        "ernie4_5_moe", "jamba", "doge", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def allowed(model_type: str) -> set[str]:
    today = TODAY.get(model_type)
    if today == "exact":
        return {"exact"}
    return {"exact", "refused"} | ({today} if today else set())


def _check(rows: list[dict]) -> list[str]:
    """What breaks the ratchet: a status `TODAY` does not allow, or a type in another family than today."""
    return [f"{r['model_type']} ({r.get('family')}): {r['status']} ({r['reason'][:200]}), allowed "
            f"{sorted(allowed(r['model_type']))} in family {FAMILY.get(r['model_type'], r.get('family'))}"
            for r in rows if r["status"] not in allowed(r["model_type"])
            or r.get("family") != FAMILY.get(r["model_type"], r.get("family"))]


def _exact(data: dict, family: str) -> set[str]:
    return {r["model_type"] for r in data["results"] if r["status"] == "exact" and r["family"] == family}


def test_fast_subset_keeps_its_status():
    rows = [sweep_one(t, timeout=120) for t in FAST]
    assert not _check(rows), _check(rows)
    assert {r["model_type"] for r in rows if r["status"] == "exact"} == set(FAST) - {"doge", "gemma2"}
    doge = next(r for r in rows if r["model_type"] == "doge")
    assert "cannot convert model_type='doge'" in doge["reason"] and "`input_residual`" in doge["reason"]
    gemma2 = next(r for r in rows if r["model_type"] == "gemma2")
    assert gemma2["status"] == "refused" and "gemma2" in gemma2["reason"], gemma2["reason"]
    assert {r["family"] for r in rows if r["model_type"] in ("llama", "gemma2")} == {"dense"}


def test_committed_sweep_holds_the_ratchet():
    """docs/architectures.json (what the README and docs/architectures.md cite) is held to `TODAY`:
    both families, every type of this transformers, exactly the exact types `TODAY` lists."""
    data = json.loads(COMMITTED.read_text())
    assert not _check(data["results"]), _check(data["results"])
    committed = {r["model_type"]: r["family"] for r in data["results"]}
    if data["meta_info"]["transformers"] == transformers.__version__:  # every type of this transformers
        assert committed == model_families()
    else:  # swept on another release: the types it shares with this one (the live sweep below covers the rest)
        assert {t: f for t, f in model_families().items() if t in committed} == \
            {t: f for t, f in committed.items() if t in model_families()}
    assert (_exact(data, "moe"), _exact(data, "dense")) == (set(EXACT), set(DENSE_EXACT))
    assert data["family_counts"]["moe"]["exact"] == len(EXACT)
    md = render_markdown(data)  # both families: a header each + one row per type, failures included
    assert md.count("\n| ") == len(data["results"]) + 2 and md.count("\n## ") == 2
    assert "MoE: " in summary(data) and "; dense: " in summary(data)


@pytest.mark.parametrize("family", ["moe", "dense"])  # one test per family: the two share the workers
def test_full_sweep_ratchet(family):
    """Every causal-LM type of the family: exact ones (here and in the committed sweep) stay exact, nothing new
    fails (about 10-15 s a family: the sweep runs on one CPU thread). Held on the transformers release the committed
    sweep ran on: model implementations change between releases (5.17 builds exaone / internlm3 / iquestcoder
    differently, and inkling_text / qwen3_5_moe_text crash there)."""
    swept = json.loads(COMMITTED.read_text())["meta_info"]["transformers"]
    if transformers.__version__ != swept:
        pytest.skip(f"docs/architectures.json was swept on transformers {swept}, this is {transformers.__version__}")
    data = run_archs([t for t, f in model_families().items() if f == family], timeout=120)
    assert not _check(data["results"]), _check(data["results"])
    assert {r["family"] for r in data["results"]} == {family}
    lost = _exact(json.loads(COMMITTED.read_text()), family) - _exact(data, family)
    assert not lost, f"{family}: exact in docs/architectures.json, not now: {sorted(lost)}"
    assert data["family_counts"][family]["exact"] >= len(EXACT if family == "moe" else DENSE_EXACT)
    md = render_markdown(data)
    assert md.count("\n| ") == len(data["results"]) + 1  # the family's header + one row per type, failures included
    assert md.count("\n## ") == 1


def test_randomness_under_an_unlisted_key_is_replayed():
    """phimoe draws router and input jitter under keys no spec lists: every variant (each stochastic key
    alone, all on) is exact, because the engine replays whatever a sub-block drew."""
    row = sweep_one("phimoe", timeout=120)
    assert row["status"] == "exact", row["reason"]
    assert {"router_jitter_noise", "input_jitter_noise", "all"} <= set(row["variants"])
    assert all(v["max_rel_grad_error"] <= 1e-5 for v in row["variants"].values()), row["variants"]


@needs_model_types("kolibri1")
def test_fp32_stream_rounding_is_told_apart_by_fp64_streams():
    """kolibri1's post-normed branches are ~50x its tiny embeddings: fp32 streams rebuild X_1 = Y_1 - F(X_2)
    to a ~4e-5 gradient error, fp64 streams exactly. The sweep rechecks such a setting with fp64
    streams and calls it exact, keeping the fp32 figure in the row."""
    row = sweep_one("kolibri1", timeout=120)
    assert row["status"] == "exact", row["reason"]
    assert 1e-5 < row["fp32_rounding"] == row["max_rel_grad_error"] <= 1e-3
    assert row["fp64_stream_error"] <= 1e-5
    assert "fp32-stream rounding" in render_markdown({"counts": {"exact": 1}, "results": [row], "run_info": {
        "wall_s": 0, "batch": 2, "seq": 16}, "meta_info": {"transformers": "", "torch": ""}})


def test_model_families_and_tiny_configs():
    types = moe_model_types()
    assert {"qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "dbrx"} <= set(types)
    assert len(types) >= 50
    dense = dense_model_types()
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gpt2", "gemma3"} <= set(dense)
    assert not set(types) & set(dense) and len(dense) >= 100
    families = model_families()
    for wrapper in ("llama4", "qwen3_5_moe", "gemma4"):  # an MoE text_config: swept as its *_text MoE type
        assert wrapper not in families and families[f"{wrapper}_text"] == "moe"
    gemma3 = tiny_config_for("gemma3")  # a multimodal wrapper: its nested text and vision configs are tiny too
    assert gemma3.text_config.hidden_size == 64 and gemma3.vision_config.hidden_size == 64
    assert gemma3.text_config.layer_types == ["sliding_attention", "full_attention"]  # both kinds, 2 layers
    gpt2 = tiny_config_for("gpt2")  # GPT-2 key names
    assert (gpt2.n_embd, gpt2.n_head, gpt2.n_layer, gpt2.resid_pdrop) == (64, 4, 2, 0.1)
    jamba = tiny_config_for("jamba")
    assert jamba.hidden_size == 64 and jamba.num_hidden_layers == 4
    assert set(jamba.layers_block_type) == {"attention", "mamba"}  # every layer kind of the full model appears
    v3 = tiny_config_for("deepseek_v3")
    assert v3.first_k_dense_replace == 1 and v3.num_hidden_layers >= 2 and v3.n_routed_experts == 4
    assert v3.attention_dropout > 0
    assert stochastic_keys("mixtral") == ["attention_dropout", "router_jitter_noise"]
    only = tiny_config_for("mixtral", {"router_jitter_noise": 0.1})
    assert only.router_jitter_noise == 0.1 and only.attention_dropout == 0.0


def test_grad_error_floor_and_missing():
    g = {"a": torch.ones(4), "tiny": torch.full((4,), 1e-10)}
    noisy = {"a": torch.ones(4), "tiny": torch.full((4,), -1e-10)}
    assert grad_error(g, noisy)[0] < 1e-5  # a zero-up-to-rounding gradient is not judged on its noise
    assert grad_error(g, {"a": torch.ones(4) * 1.01, "tiny": g["tiny"]}) == (pytest.approx(0.01, rel=1e-3), "a")
    assert grad_error(g, {"a": g["a"]}) == (float("inf"), "tiny")


def test_archs_cli_json(capsys):
    assert cli.main(["archs", "--types", "mixtral,llama", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["model_type"], r["family"], r["status"]) for r in data["results"]] == [
        ("mixtral", "moe", "exact"), ("llama", "dense", "exact")]
    assert data["family_counts"]["dense"]["exact"] == data["family_counts"]["moe"]["exact"] == 1


def test_archs_cli_failing_dense_type_exit_1(capsys):
    """A dense row fails the sweep as an MoE one does (olmo crashes today: exit 1)."""
    rc = cli.main(["archs", "--types", "olmo", "--json"])
    [status] = [r["status"] for r in json.loads(capsys.readouterr().out)["results"]]
    assert rc == (1 if status in ("wrong", "unfaithful", "crash", "build-error") else 0)


def test_archs_cli_one_file_for_the_page_and_the_json_exit_2(capsys, tmp_path):
    page = tmp_path / "archs.md"
    assert cli.main(["archs", "--types", "mixtral", "--out", str(page), "--json-out", str(page)]) == 2
    assert "--out and --json-out name the same file" in capsys.readouterr().err and not page.exists()


def test_archs_cli_bad_type_exit_2(capsys):
    assert cli.main(["archs", "--types", "not_a_type"]) == 2
    err = capsys.readouterr().err
    assert "causal-LM model types of this transformers (MoE or dense). Fix: a model_type" in err and len(err) < 400
    assert cli.main(["archs", "--types", "mixtrl"]) == 2
    assert "Did you mean 'mixtral'?" in capsys.readouterr().err


def test_every_choice_on_values_is_recorded():
    """The types whose choices the backward used to take afresh (a router at `mlp.router`, an
    indexer's top-k in attention, a `max(dim)` sparse mixer, a sink's max): the engine now records
    every one of them; the same forward on the plain twin shows that the choices are there."""
    from revffn.conversion.convert import convert
    from revffn.models.tiny_any import tiny_model_for
    from revffn.reports.archs import _step
    from revffn.reports.check import make_batch

    for model_type in ("aria_text", "gpt_oss", "phimoe", "axk2", "deepseek_v32", "glm_moe_dsa", "afmoe"):
        model = convert(tiny_model_for(model_type))
        model.train()
        ids, mask, labels = make_batch(model.config.vocab_size, 2, 16, 0)
        plain = _step(model, ids, mask, labels, False, 0, count_discrete=True)[3]
        reversible = _step(model, ids, mask, labels, True, 0, count_discrete=True)[3]
        assert (plain > 0, reversible) == (True, 0), (model_type, plain, reversible)
