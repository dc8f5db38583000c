"""lm-evaluation-harness scores a revffn final/ through its `hf` model, on a local task written by
`revffn.reports.lm_eval_task`, with the per-example loglikelihoods revffn computes itself; the requests
keep the tokens revffn trains on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from revffn.cli import main
from revffn.data.collate import IGNORE_INDEX, tokenize_dataset
from revffn.data.formats import load_examples
from revffn.data.templates import loglikelihood_request, render_segments
from revffn.data.tokenizer import load_tokenizer
from revffn.errors import UserError
from revffn.models.loading import load
from revffn.reports.lm_eval_task import loglikelihoods, task_rows, write_task
from tests.models.test_hf_remote import REVFFN, TRAIN

ROOT = Path(__file__).resolve().parents[2]
DATA, LIMIT, TOL = "builtin:commas_test", 4, 1e-4

# a fresh interpreter: lm-eval as a user runs it, the task found on its include path, nothing from the Hub
LM_EVAL_SIDE = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
final, include, *names = sys.argv[1:]
out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={final},trust_remote_code=True", tasks=names,
                              task_manager=TaskManager(include_path=include, include_defaults=False),
                              log_samples=True, batch_size=1, device="cpu", bootstrap_iters=0)
print(json.dumps({n: [{"source": s["doc"]["source"], "arguments": s["arguments"][0], "ll": s["resps"][0][0][0]}
                      for s in out["samples"][n]] for n in names}))
"""


def test_request_is_the_trained_text_with_nothing_for_lm_eval_to_move():
    tok = load_tokenizer(None)
    examples = load_examples(DATA, "data")[:LIMIT]
    for example, row, item in zip(examples, task_rows(examples, tok), tokenize_dataset(examples, tok, 512).items):
        context, continuation = loglikelihood_request(example, tok)
        assert (row["context"], row["continuation"]) == (context, continuation)
        assert context == context.rstrip() and context.endswith("<|assistant|>")  # lm-eval moves nothing
        assert context + continuation == "".join(text for text, _ in render_segments(example, tok))
        assert continuation == "\n" + example["answer"] + "<|end|>\n"
        ids, labels = item  # training's tokens: the continuation's are the header newline + the trained ones
        cont = tok(continuation, add_special_tokens=False)["input_ids"]
        assert tok(context, add_special_tokens=False)["input_ids"] + cont == ids
        assert cont[1:] == [t for t in labels if t != IGNORE_INDEX] and labels[len(ids) - len(cont)] == IGNORE_INDEX
    with pytest.raises(UserError, match="plain text"):
        loglikelihood_request({"text": "just text", "messages": None, "source": "x:1"}, tok)


def test_task_yaml_names_a_local_jsonl(tmp_path):
    rows = [{"context": "a", "continuation": " b", "source": "x:1"}]
    task = yaml.safe_load(write_task(rows, tmp_path / "tasks", "t").read_text())
    assert task["dataset_path"] == "json" and task["output_type"] == "loglikelihood"
    data = Path(task["dataset_kwargs"]["data_files"]["test"])
    assert data.is_absolute() and [json.loads(line) for line in data.read_text().splitlines()] == rows
    assert (task["doc_to_text"], task["doc_to_target"]) == ("context", "continuation")


@pytest.mark.integration
def test_lm_eval_loglikelihoods_agree_with_revffn(tmp_path, one_thread, capsys):
    pytest.importorskip("lm_eval")
    run = tmp_path / "rev"
    assert main(["train", f"output_dir={run}", *TRAIN, *REVFFN]) == 0
    final, tok = run / "final", load_tokenizer(str(run / "final"))
    rows = task_rows(load_examples(DATA, "data")[:LIMIT], tok)
    # the trap: the rendered prompt (ending in the header's "\n") and the response; lm-eval moves the "\n"
    naive = [{**r, "context": r["context"] + "\n", "continuation": r["continuation"][1:]} for r in rows]
    write_task(rows, tmp_path / "tasks", "revffn_commas")
    write_task(naive, tmp_path / "tasks", "revffn_commas_naive")
    model = load(str(final))
    ours, ours_naive = loglikelihoods(model, tok, rows), loglikelihoods(model, tok, naive)
    # `revffn eval --loglikelihoods` reports these very numbers
    data = tmp_path / "data.jsonl"
    from revffn.data.formats import BUILTIN_DIR

    raw = (BUILTIN_DIR / (DATA.removeprefix("builtin:") + ".jsonl")).read_text().splitlines(keepends=True)
    data.write_text("".join(raw[:LIMIT]))
    capsys.readouterr()
    assert main(["eval", str(final), "--data", str(data), "--loglikelihoods", "--limit", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loglikelihoods"] == pytest.approx(ours, abs=1e-9)
    assert main(["eval", str(final), "--data", str(data), "--loglikelihoods", "--limit", "0"]) == 0  # the text form
    assert f"mean {sum(ours) / len(ours):.4f} over {len(ours)}, first {ours[0]:.4f}" in capsys.readouterr().out

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "mod"),
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", LM_EVAL_SIDE, str(final), str(tmp_path / "tasks"), "revffn_commas",
                           "revffn_commas_naive"], capture_output=True, text=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = json.loads(proc.stdout.strip().splitlines()[-1])
    theirs = {s["source"]: s for s in samples["revffn_commas"]}
    assert sorted(theirs) == sorted(r["source"] for r in rows)
    for row in rows:
        assert theirs[row["source"]]["arguments"] == [row["context"], row["continuation"]]
    delta = [abs(theirs[r["source"]]["ll"] - ll) for r, ll in zip(rows, ours)]
    print(f"lm-eval vs revffn: max |delta loglikelihood| = {max(delta):.2e} over {len(rows)} examples")
    assert max(delta) < TOL, (delta, ours)
    # lm-eval scored the naive requests' "\n" too: exactly the first task's numbers, not revffn's for them
    theirs_naive = {s["source"]: s["ll"] for s in samples["revffn_commas_naive"]}
    assert all(abs(theirs_naive[r["source"]] - theirs[r["source"]]["ll"]) < TOL for r in rows)
    gap = [abs(theirs_naive[r["source"]] - ll) for r, ll in zip(naive, ours_naive)]
    print(f"naive requests (the prompt ending in its newline): lm-eval and revffn differ by {min(gap):.2f} "
          f"to {max(gap):.2f}")
    assert min(gap) > 1e-3
