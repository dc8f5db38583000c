"""The `revffn` command line: one subcommand per job.

    revffn check --model tiny-qwen2-moe --layers 4 [--dtype bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

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
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        print(f"revffn {args.command}: error: {e}", file=sys.stderr)
        return 2
