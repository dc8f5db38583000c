"""Pretrain the shipped base model (`builtin:base`) from scratch, offline, on the CPU.

    python scripts/pretrain_base.py            # ~25-35 min on 2 CPU cores; rewrites revffn/assets/base/

Corpus (built here, nothing downloaded; see `corpus.pretraining_corpus`): the
docstrings of the Python standard library and the reference-manual help topics that ship with
the interpreter, in ~600-character pieces, plus paragraphs about a small fictional world (fixed
facts in varied sentences). Every 40th Python-docs piece and a separately seeded set of world
paragraphs are held out; they are written to `revffn/assets/data/retention_test.jsonl`, the
retention set that measures forgetting. The corpus is deterministic for a given seed and Python
version (docstrings differ between Python versions).

Training goes through the one training loop (`revffn train`, method `full`, packed 256-token rows).
The result is saved in bf16 with the shipped tokenizer, and its held-out loss (bf16 weights,
fp32 compute) is recorded in `revffn/assets/base/base.json` and `docs/base.md`.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from corpus import pretraining_corpus  # noqa: E402

from revffn.data.formats import BUILTIN_DIR  # noqa: E402
from revffn.models.loading import SHIPPED_MODELS  # noqa: E402

# The base: qwen2_moe with a shared expert, 4 layers, hidden 256, 8 routed experts (top-2).
MODEL_CONFIG = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "intermediate_size": 512,
                "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 1024}

TRAIN = {  # keys of the training config (see README 'Config keys')
    "model": "tiny-qwen2-moe", "method": "full", "max_steps": 1000, "per_device_train_batch_size": 16,
    "max_seq_length": 256, "packing": True, "learning_rate": 3e-3, "lr_scheduler_type": "cosine",
    "warmup_steps": 50, "min_lr_ratio": 0.1, "weight_decay": 0.1, "max_grad_norm": 1.0,
    "router_aux_loss_coef": 0.01, "save_steps": 250, "eval_steps": 250, "logging_steps": 25, "dtype": "float32",
}


# docs/base.md from this heading on (the SmolLM2 figures) is not generated here; write_docs keeps it.
KEPT_SECTION = "## SmolLM2-135M-Instruct (builtin:smollm2)"


def write_docs(info: dict, metrics_file: Path, docs: Path) -> None:
    """docs/base.md: how the base was made, its held-out loss and its training curve (keeps `KEPT_SECTION`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    plot = docs.parent / "base_pretrain.png"
    fig.savefig(plot, dpi=110)
    plt.close(fig)
    cfg = ", ".join(f"{k}={v}" for k, v in MODEL_CONFIG.items())
    old = docs.read_text() if docs.is_file() else ""
    kept = old[old.index(KEPT_SECTION):] if KEPT_SECTION in old else ""  # written by hand, not by this script
    docs.write_text(f"""# The shipped base model (`builtin:base`)

Regenerate: `{info['command']}` (rewrites `revffn/assets/base/` and `revffn/assets/data/retention_test.jsonl`).

- Architecture: HF `Qwen2MoeForCausalLM` with a shared expert; {cfg}; vocabulary {info['vocab_size']}
  (the shipped tokenizer). {info['params'] / 1e6:.2f} M parameters, {info['size_bytes'] / 2**20:.1f} MiB of
  bf16 safetensors.
- Corpus (built offline by the script): Python standard-library docstrings and the reference-manual help
  topics shipped with the interpreter (Python {info['python']}), in ~600-character pieces, plus
  {info['n_world']} paragraphs about a small fictional world (24 people, 12 towns; fixed facts in varied
  wording). {info['train_documents']} training documents, {info['train_tokens']} tokens. No task data:
  the fine-tuning tasks (mini-GSM, word reversal) never occur in it (tested).
- Training: the one training loop, method `full`, {info['max_steps']} steps of 16 packed 256-token rows,
  AdamW lr 3e-3 (cosine to 3e-4, 50 warm-up steps), weight decay 0.1, router load-balancing loss 0.01,
  seed {info['seed']}, fp32, {info['threads']} CPU threads: {info['wall_s'] / 60:.1f} min wall-clock
  (torch {info['torch']}).
- **Held-out loss: {info['heldout_loss']:.4f} nats/token** on `builtin:retention_test`
  ({info['heldout_documents']} held-out documents: every 40th Python-docs piece and separately drawn
  world paragraphs), computed from the shipped bf16 weights in fp32. The same set is the study's
  retention set. Converted to RevFFN (coordinate adapter init, no training) the loss is
  {info['converted_heldout_loss']:.4f}. `tests/models/test_base.py` checks both within 1 %.

![pretraining loss](base_pretrain.png)
""" + ("\n" + kept if kept else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/pretrain_base", help="training run directory (default: %(default)s)")
    parser.add_argument("--out", default=str(SHIPPED_MODELS["builtin:base"]), help="where the base is written")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=TRAIN["max_steps"])
    parser.add_argument("--n-world", type=int, default=20000, help="fictional-world paragraphs in the corpus")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run in --work")
    parser.add_argument("--docs", default=str(ROOT / "docs" / "base.md"), help="where the description goes")
    parser.add_argument("--docs-only", action="store_true", help="only rewrite --docs from --out and --work")
    args = parser.parse_args()
    if args.docs_only:
        info = json.loads((Path(args.out) / "base.json").read_text())
        write_docs(info, Path(args.work) / "run" / "metrics.jsonl", Path(args.docs))
        return

    from revffn.conversion.convert import convert
    from revffn.data.tokenizer import load_tokenizer
    from revffn.models.loading import load
    from revffn.training.config import load_config
    from revffn.training.evaluate import retention_loss
    from revffn.training.loop import run

    t0 = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    train_docs, heldout = pretraining_corpus(args.seed, args.n_world)
    corpus = work / "corpus_train.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in train_docs))
    retention = BUILTIN_DIR / "retention_test.jsonl"
    retention.write_text("".join(json.dumps({"text": d}) + "\n" for d in heldout))
    print(f"corpus: {len(train_docs)} training documents, {len(heldout)} held out -> {retention}")

    cfg_file = work / "pretrain.yaml"
    cfg_file.write_text(yaml.safe_dump({**TRAIN, "model_config": MODEL_CONFIG, "data": str(corpus),
                                        "eval_data": "builtin:retention_test", "output_dir": str(work / "run"),
                                        "seed": args.seed, "max_steps": args.max_steps, "resume": args.resume,
                                        "overwrite": not args.resume}, sort_keys=False))
    summary = run(load_config(str(cfg_file)))

    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = load(summary["final_dir"])
    model.hf.to(torch.bfloat16).save_pretrained(tmp)
    tok = load_tokenizer(summary["final_dir"])
    tok.save_pretrained(tmp)
    shipped = load(str(tmp))  # bf16 on disk -> fp32 compute, exactly what users get
    loss = retention_loss(shipped, tok)
    params = sum(p.numel() for p in shipped.parameters())
    converted = convert(shipped.hf).eval()  # RevFFN at init (coordinate adapters), before any training
    info = {
        "heldout_loss": loss, "heldout_set": "builtin:retention_test", "seed": args.seed,
        "max_steps": args.max_steps, "n_world": args.n_world, "train_documents": len(train_docs),
        "train_tokens": summary["train_stats"]["n_tokens"], "heldout_documents": len(heldout),
        "converted_heldout_loss": retention_loss(converted, tok), "vocab_size": len(tok),
        "size_bytes": (tmp / "model.safetensors").stat().st_size,
        "params": params, "wall_s": round(time.time() - t0, 1),
        "threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
        "command": "python scripts/pretrain_base.py" + (f" --seed {args.seed}" if args.seed else ""),
    }
    (tmp / "base.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    write_docs(info, Path(summary["final_dir"]).parent / "metrics.jsonl", Path(args.docs))
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
