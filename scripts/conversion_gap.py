"""Conversion gap of a trained model: its loss before and after RevFFN conversion, per adapter init.

    revffn train method=full output_dir=runs/qs-full      # a trained (non-random) model
    python scripts/conversion_gap.py runs/qs-full/final builtin:quickstart_test
"""

import copy
import sys

import torch

from revffn import convert
from revffn.data.collate import collate, tokenize_dataset
from revffn.data.formats import load_examples
from revffn.data.tokenizer import load_tokenizer
from revffn.models.loading import load


def main(model_dir: str, data: str) -> None:
    model, tok = load(model_dir), load_tokenizer(model_dir)
    batch = collate(tokenize_dataset(load_examples(data), tok, 512).items, tok.pad_token_id)
    with torch.no_grad():
        base = model(**batch, return_logits=False).loss.item()
        print(f"unconverted loss on {data}: {base:.4f}")
        for init in ("coordinate", "zero", "random"):
            torch.manual_seed(0)
            conv = convert(copy.deepcopy(model.hf), adapter_init=init).eval()
            loss = conv(**batch, return_logits=False).loss.item()
            print(f"  adapter_init={init:<10} converted loss {loss:.4f}  (gap {loss - base:+.4f})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
