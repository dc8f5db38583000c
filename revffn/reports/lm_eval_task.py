"""lm-evaluation-harness on a revffn model: a local loglikelihood task written from a data file, and
revffn's own per-example loglikelihood of the same requests, to hold one against the other.

    python -m revffn.reports.lm_eval_task runs/quickstart/final --data builtin:commas_test --out lm_tasks
    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval --model hf \\
        --model_args pretrained=runs/quickstart/final,trust_remote_code=True,dtype=float32 \\
        --include_path lm_tasks --tasks revffn_commas_test --log_samples --output_path lm_out

The task (`write_task`) is a YAML file over a JSONL file beside it: one row per example, `context` and
`continuation` as `data.templates.loglikelihood_request` renders them (the chat-rendered prompt without
its trailing whitespace; that whitespace, the response and its end-of-turn), `output_type:
loglikelihood`. lm-eval's context then has no trailing whitespace to move, and it tokenizes
context + continuation as revffn does (each apart: `write_task` checks that joining them changes no
token). Each logged sample's loglikelihood is the row's `revffn_loglikelihood` (`--score`):
`loglikelihoods`, the teacher-forced loss sum of `evaluate` over the continuation, negated.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import yaml

from revffn.data.collate import IGNORE_INDEX
from revffn.data.templates import loglikelihood_request
from revffn.errors import UserError


def task_rows(examples: list[dict], tokenizer) -> list[dict]:
    """One `{"context", "continuation", "source"}` row per example (`loglikelihood_request`).

    Raises:
        UserError: naming the example, when tokenizing context + continuation together gives other tokens
            than tokenizing them apart (lm-eval does the first, revffn's training the second).
    """
    rows = []
    for example in examples:
        context, continuation = loglikelihood_request(example, tokenizer)
        apart = tokenizer(context, add_special_tokens=False)["input_ids"] + \
            tokenizer(continuation, add_special_tokens=False)["input_ids"]
        if tokenizer(context + continuation, add_special_tokens=False)["input_ids"] != apart:
            raise UserError(f"{example.get('source', '?')}: the tokenizer merges tokens across the end of the prompt "
                            f"({context[-20:]!r} + {continuation[:20]!r}), so lm-eval would score other tokens "
                            "than revffn trains on. Fix: leave this example out, or use a chat template whose "
                            "prompt ends in a special token or a newline.")
        rows.append({"context": context, "continuation": continuation, "source": example.get("source")})
    return rows


def write_task(rows: list[dict], out_dir: str | Path, name: str) -> Path:
    """Write `NAME.jsonl` (the rows) and `NAME.yaml` (the lm-eval task over it) into `out_dir`; returns the
    YAML's path. lm-eval finds the task with `--include_path OUT_DIR --tasks NAME`."""
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "loglikelihood",
            "doc_to_text": "context", "doc_to_target": "continuation",  # column names: the text as it is
            "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                            {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0}}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path


@torch.no_grad()
def loglikelihoods(model, tokenizer, rows: list[dict]) -> list[float]:
    """Summed log-probability of each row's continuation given its context: minus the loss sum of the
    model's own forward with labels on the continuation only (`evaluate`'s loss), one row at a time.
    Context and continuation are tokenized apart, without special tokens, as training tokenizes segments."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    scores = []
    for row in rows:
        context = tokenizer(row["context"], add_special_tokens=False)["input_ids"]
        continuation = tokenizer(row["continuation"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([context + continuation], device=device)  # (1, T)
        labels = torch.tensor([[IGNORE_INDEX] * len(context) + continuation], device=device)
        out = model(ids, labels=labels, return_logits=False)
        scores.append(-out.loss_sum.double().item())
    model.train(was_training)
    return scores


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (Fix: e.g. --limit 100)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} examples: at least 1 (Fix: leave it out for every example)")
    return value


def main(argv: list[str] | None = None) -> int:
    from revffn.data.formats import load_examples
    from revffn.data.tokenizer import load_tokenizer
    from revffn.models.cache import file_in_the_way
    from revffn.models.loading import check_model_ref, load
    from revffn.progress import quiet_known_noise

    quiet_known_noise()
    p = argparse.ArgumentParser(prog="python -m revffn.reports.lm_eval_task",
                                description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    p.add_argument("model_dir", help="a run's final/ (or any model directory revffn loads)")
    p.add_argument("--data", required=True, help="examples to score (a file or builtin:NAME)")
    p.add_argument("--out", required=True, help="directory for NAME.yaml and NAME.jsonl (lm-eval's --include_path)")
    p.add_argument("--name", help="task name (default: revffn_ + the data file's stem)")
    p.add_argument("--limit", type=_positive, help="first N examples only (at least 1)")
    p.add_argument("--score", action="store_true", help="add revffn's own loglikelihood to each row")
    args = p.parse_args(argv)
    name = args.name if args.name is not None else "revffn_" + Path(args.data.removeprefix("builtin:")).stem
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        p.error(f"--name {name!r}: a task name is letters, digits, '_', '.' and '-' (it names NAME.yaml and "
                "NAME.jsonl inside --out), starting with a letter or digit. Fix: e.g. --name revffn_mytask")
    if (blocker := file_in_the_way(Path(args.out))) is not None:
        p.error(f"--out {args.out}: {'is a file' if blocker == Path(args.out) else f'{blocker} is a file'}. Fix: a "
                "directory for NAME.yaml and NAME.jsonl.")
    try:
        check_model_ref(args.model_dir, "MODEL_DIR")
        tokenizer = load_tokenizer(args.model_dir)
        examples = load_examples(args.data, "data")[: args.limit]
        rows = task_rows(examples, tokenizer)
        if args.score:
            for row, score in zip(rows, loglikelihoods(load(args.model_dir), tokenizer, rows)):
                row["revffn_loglikelihood"] = score
    except UserError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    path = write_task(rows, args.out, name)
    print(f"wrote {path} ({len(rows)} requests). Run:\n  HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval --model hf "
          f"--model_args pretrained={args.model_dir},trust_remote_code=True,dtype=float32 --include_path "
          f"{path.parent} --tasks {name} --log_samples --output_path lm_out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
