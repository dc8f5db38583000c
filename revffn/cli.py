"""The `revffn` command line: one subcommand per job.

    revffn train [CONFIG.yaml] [key=value ...]      fine-tune (no CONFIG: the built-in quickstart)
    revffn validate CONFIG.yaml [key=value ...]     check config and data without training
    revffn generate MODEL_DIR --prompt TEXT         greedy generation
    revffn eval MODEL_DIR --data FILE [--json]      loss, perplexity, exact match
    revffn check --model tiny-qwen2-moe --layers 4  reversible vs plain gradients

Exit codes: 0 ok, 1 failed (check over tolerance, training diverged or crashed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from revffn.errors import UserError


def _positive(s: str) -> int:
    v = int(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return v


def cmd_check(args) -> int:
    from revffn.check import format_report, run_check
    from revffn.models.loading import check_model_ref, parse_dtype

    check_model_ref(args.model, "--model")
    parse_dtype(args.dtype, "--dtype")
    report = run_check(args.model, args.layers, args.dtype, args.batch, args.seq, args.seed, args.adapter_init)
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["passed"] else 1


def cmd_train(args) -> int:
    from revffn.training.config import load_config
    from revffn.training.loop import TrainingDiverged, run

    cfg = load_config(args.config, args.overrides)
    try:
        summary = run(cfg)
    except TrainingDiverged as e:
        print(f"revffn train: diverged: {e}", file=sys.stderr)
        return 1
    print(f"revffn train: done. {summary['steps']} steps; final model in {summary['final_dir']}; "
          f"report in {cfg.output_dir}/report.md")
    return 0


def cmd_validate(args) -> int:
    from revffn.training.config import load_config
    from revffn.training.setup import prepare_run

    cfg = load_config(args.config, args.overrides)
    plan = prepare_run(cfg)
    s = plan.train_set.stats
    print(f"config OK: method={cfg.method} model={cfg.model} device={plan.device}; data: {s['n_examples']} examples, "
          f"{s['n_truncated']} truncated, {s['n_dropped']} dropped, {s['n_train_tokens']} trained tokens"
          + (f"; eval_data: {plan.eval_set.stats['n_examples']} examples" if plan.eval_set else ""))
    return 0


def _load_for_cli(model_dir: str, seed: int = 0):
    """A final/ directory, any HF directory, or a tiny preset (random init, shipped tokenizer)."""
    from revffn.data.tokenizer import load_tokenizer
    from revffn.inference import load
    from revffn.models.causal_lm import CausalLM
    from revffn.models.loading import check_model_ref, load_hf
    from revffn.models.presets import TINY_PRESETS

    check_model_ref(model_dir, "MODEL_DIR")
    if model_dir in TINY_PRESETS:
        tok = load_tokenizer(None)
        return CausalLM(load_hf(model_dir, seed=seed, vocab_size=len(tok))).eval(), tok
    return load(model_dir), load_tokenizer(model_dir)


def cmd_generate(args) -> int:
    from revffn.inference import generate

    model, tok = _load_for_cli(args.model_dir)
    for text in generate(model, tok, args.prompt, max_new_tokens=args.max_new_tokens):
        print(text)
    return 0


def cmd_eval(args) -> int:
    from revffn.data.formats import load_examples
    from revffn.evaluate import evaluate

    model, tok = _load_for_cli(args.model_dir)
    examples = load_examples(args.data, "--data")
    report = evaluate(model, tok, examples, args.max_seq_length, args.batch_size, args.max_new_tokens, args.limit)
    report["model"], report["data"] = args.model_dir, args.data
    if args.json:
        print(json.dumps(report))
    else:
        em = "n/a" if report["exact_match"] is None else f"{100 * report['exact_match']:.1f}%"
        print(f"{args.model_dir} on {args.data}: loss {report['loss']:.4f}, perplexity {report['perplexity']:.2f}, "
              f"exact match {em} ({report['n_scored']} scored of {report['n_examples']})")
        for s in report["samples"]:
            print(f"  prompt: {s['prompt']!r}\n    reference:  {s['reference']!r}\n    prediction: {s['prediction']!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="revffn", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="consistency check: reversible vs plain-autograd gradients")
    c.add_argument("--model", default="tiny-qwen2-moe", help="preset name or local HF directory")
    c.add_argument("--layers", type=_positive, default=None, help="override num_hidden_layers")
    c.add_argument("--dtype", default="float32", help="float32 | bfloat16 (compute; streams stay fp32)")
    c.add_argument("--batch", type=_positive, default=2)
    c.add_argument("--seq", type=_positive, default=32)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--adapter-init", default="coordinate", choices=["coordinate", "zero", "random"])
    c.add_argument("--json", action="store_true", help="print exactly one JSON object")
    c.set_defaults(fn=cmd_check)

    t = sub.add_parser("train", help="fine-tune a model from a YAML config (no config: the quickstart)")
    t.add_argument("config", nargs="?", default=None, help="YAML config; omit for the built-in quickstart")
    t.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys reach method sections)")
    t.set_defaults(fn=cmd_train)

    v = sub.add_parser("validate", help="check a config and its data without training")
    v.add_argument("config", nargs="?", default=None)
    v.add_argument("overrides", nargs="*")
    v.set_defaults(fn=cmd_validate)

    g = sub.add_parser("generate", help="greedy generation from a trained model")
    g.add_argument("model_dir", help="a run's final/ directory, an HF directory, or a tiny preset")
    g.add_argument("--prompt", action="append", required=True, help="user prompt (repeatable)")
    g.add_argument("--max-new-tokens", type=_positive, default=64)
    g.set_defaults(fn=cmd_generate)

    e = sub.add_parser("eval", help="loss, perplexity and exact-match accuracy on a data file")
    e.add_argument("model_dir")
    e.add_argument("--data", required=True, help="JSON/JSONL file or builtin:NAME")
    e.add_argument("--json", action="store_true")
    e.add_argument("--limit", type=int, default=None, help="score at most N examples by exact match")
    e.add_argument("--batch-size", type=_positive, default=16)
    e.add_argument("--max-new-tokens", type=_positive, default=48)
    e.add_argument("--max-seq-length", type=_positive, default=512)
    e.set_defaults(fn=cmd_eval)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train", "validate") and len(argv) > 1 and "=" in argv[1]:
        argv.insert(1, "")  # `revffn train key=value`: overrides on the quickstart
    args = parser.parse_args(argv)
    if getattr(args, "config", None) == "":
        args.config = None
    try:
        return args.fn(args)
    except UserError as e:
        print(f"revffn {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"revffn {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print(f"revffn {args.command}: failed (see the traceback above)", file=sys.stderr)
        return 1
