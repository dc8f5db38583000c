"""Greedy generation with and without the KV cache: seconds for N new tokens, and the same tokens.

    python scripts/generate_speed.py --out docs/generate_speed.json

Decodes `--new-tokens` greedy tokens (no stop token: every row runs to the end) from the quickstart
prompt (19 tokens), in batches of each of `--batches` copies of it, through `revffn generate`'s own
loop (`models.generation.generate_ids`), once recomputing the whole prefix every step and once with
the KV cache, for `--model` converted to RevFFN (what a revffn run's final/ holds) and as the plain
HF model (a baseline's). Batch 1 is `revffn generate` with one prompt; 16 is `revffn eval`'s default
batch. Each time is the median of `--repeats` runs after one warm-up; the script fails if the two
decodes differ by a token. Threads: `--threads` (1 by default: steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import transformers

from revffn.conversion.causal_lm import CausalLM
from revffn.conversion.convert import convert
from revffn.data.templates import chat_prompts
from revffn.data.tokenizer import load_tokenizer
from revffn.models.generation import generate_ids
from revffn.models.loading import load_hf
from revffn.models.presets import TINY_PRESETS

PROMPT = "Put commas between: rope ink tea"


def timed(model, prompts: list[list[int]], new_tokens: int, pad_id: int, use_cache: bool,
          repeats: int) -> tuple[float, list[list[int]]]:
    """(median seconds, the tokens) of `repeats` decodes after one warm-up."""
    out = generate_ids(model, prompts, new_tokens, set(), pad_id, use_cache=use_cache)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate_ids(model, prompts, new_tokens, set(), pad_id, use_cache=use_cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(name: str, model, prompt: list[int], batch: int, args, pad_id: int) -> dict:
    no_cache_s, ref = timed(model, [prompt] * batch, args.new_tokens, pad_id, False, args.repeats)
    cache_s, out = timed(model, [prompt] * batch, args.new_tokens, pad_id, True, args.repeats)
    if out != ref:
        raise SystemExit(f"{name}, batch {batch}: the cached decode differs from the recomputed one: {out} vs {ref}")
    row = {"model": name, "batch": batch, "no_cache_s": round(no_cache_s, 3), "cache_s": round(cache_s, 3),
           "speedup": round(no_cache_s / cache_s, 1), "same_tokens": True}
    print(json.dumps(row))
    return row


def summary(result: dict) -> str:
    """docs/outputs.md's sentence for the converted model, from the JSON this script writes."""
    info = result["run_info"]
    rows = [r for r in result["results"] if r["model"] == "revffn (converted)"]
    parts = [f"batch {r['batch']}: {r['no_cache_s']:.2f} s without the cache, {r['cache_s']:.2f} s with it "
             f"({r['speedup']:.1f}×)" for r in rows]
    return (f"{info['new_tokens']} new tokens on {info['model']} ({info['prompt_tokens']}-token prompt, "
            f"{result['meta_info']['threads']} CPU thread): " + "; ".join(parts))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:base", help="builtin:base, a tiny preset or a local HF directory")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="copies of the prompt decoded together")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(None)
    prompt = tok(chat_prompts([PROMPT], tok)[0], add_special_tokens=False)["input_ids"]
    overrides = {"vocab_size": len(tok)} if args.model in TINY_PRESETS else {}  # a preset gets the shipped vocab
    models = {"revffn (converted)": convert(load_hf(args.model, **overrides)).eval(),
              "plain HF": CausalLM(load_hf(args.model, **overrides)).eval()}
    rows = [measure(name, model, prompt, batch, args, tok.pad_token_id)
            for name, model in models.items() for batch in args.batches]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                     for k, v in vars(args).items() if v is not None)
    result = {"run_info": {"model": args.model, "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
                           "batches": args.batches, "repeats": args.repeats, "git_commit": commit or None,
                           "command": f"python scripts/generate_speed.py {flags}"},
              "results": rows,
              "meta_info": {"threads": args.threads, "cores": os.cpu_count(), "device": "cpu",
                            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                            "transformers": transformers.__version__}}
    print(summary(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
