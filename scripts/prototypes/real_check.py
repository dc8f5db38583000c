"""[SD=float32|float64]
    python scripts/prototypes/real_check.py CALIBRATION_TOKENS

Probe behind docs/conversion.md ("The reversible gradient on the real depth"): `revffn check`'s comparison on the
dense builtin:smollm2 with the *calibrated* adapters (CALIBRATION_TOKENS of builtin:stdlib_text; 0: coordinate)
and real text (documents 40-41 of builtin:pydoc_text, 128 tokens each): the reversible gradient against the plain
twin's, and each layer's rebuilt input against the forward's, with SD streams.
"""

import json
import os
import sys

import torch

from revffn.conversion import calibrate as C
from revffn.conversion.convert import convert
from revffn.data.calibration import calibration_rows, row_batches
from revffn.data.formats import load_examples
from revffn.data.tokenizer import model_tokenizer
from revffn.models.loading import load_hf
from revffn.reports.check import _step, grad_error


def main(n_tokens: int) -> None:
    torch.set_num_threads(2)
    tok = model_tokenizer("builtin:smollm2")
    model = convert(load_hf("builtin:smollm2"), adapter_init="calibrated", adapter_skip=True, stream_width="full",
                    stream_dtype=getattr(torch, os.environ.get("SD", "float32")))
    if n_tokens:
        C.calibrate(model, row_batches(calibration_rows("builtin:stdlib_text", tok, model, n_tokens, "calibration", 0)))
    model.train()
    texts = [r["text"] for r in load_examples("builtin:pydoc_text", "text")[40:42]]
    enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=128)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    cached, rebuilt = {}, {}
    loss_plain, g_plain, _, _ = _step(model, ids, mask, labels, False, cached, 0)
    loss_rev, g_rev, _, _ = _step(model, ids, mask, labels, True, rebuilt, 0)
    by_layer = {i: max((a - b).abs().max().item() for a, b in zip(cached[i], rebuilt[i])) for i in sorted(cached)}
    rel, worst = grad_error(g_plain, g_rev)
    print(json.dumps({"calibration_tokens": n_tokens, "stream_dtype": os.environ.get("SD", "float32"),
                      "loss_plain": loss_plain, "loss_reversible": loss_rev,
                      "stream_scale": max(a.abs().max().item() for i in cached for a in cached[i]),
                      "max_rel_grad_error": rel, "worst_param": worst,
                      "rebuilt_input_max_abs_error_by_layer": {k: float(f"{v:.2g}") for k, v in by_layer.items()}}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
