"""python scripts/prototypes/self_text.py START TEMP TOKENS [THREADS] [LIMIT]

Prototype behind docs/conversion.md ("`self` text on an instruct model"): which sampled text calibrates the dense
builtin:smollm2 best. START: eos (the tokenizer's eos, `<|im_end|>` on this instruct model) | doc (`<|endoftext|>`,
the pretraining corpus's document separator). TEMP: the sampling temperature. The model is converted at full width
with the skips, calibrated in closed form on TOKENS sampled tokens (`conversion.calibrate`), and scored on
builtin:pydoc_text (LIMIT 32: its first 32 documents, base 3.002; all: every one, base 2.940).
"""

import json
import sys
import time

import torch

from revffn.conversion.convert import convert
from revffn.conversion.teacher import sample_self
from revffn.data.calibration import SEQ_LEN, row_batches
from revffn.data.tokenizer import model_tokenizer
from revffn.models import calibrate as C
from revffn.models.loading import load_hf
from revffn.training.evaluate import retention_loss


def main(start: str, temp: float, n_tokens: int, threads: int, limit: str) -> None:
    torch.set_num_threads(threads)
    tok = model_tokenizer("builtin:smollm2")
    model = convert(load_hf("builtin:smollm2"), adapter_init="calibrated", adapter_skip=True,
                    stream_width="full").eval()
    first = {"eos": tok.eos_token_id, "doc": tok.convert_tokens_to_ids("<|endoftext|>")}[start]
    t0 = time.time()
    rows = sample_self(model, n_tokens // SEQ_LEN, SEQ_LEN, first, temperature=temp, seed=0)
    sample_s = time.time() - t0
    report = C.calibrate(model, row_batches(rows))
    with torch.no_grad():
        loss = retention_loss(model, tok, "builtin:pydoc_text", 256, limit=None if limit == "all" else int(limit))
    print(json.dumps({"start": start, "temp": temp, "tokens": n_tokens, "limit": limit, "loss": round(loss, 4),
                      "sample_s": round(sample_s), "calibration_s": report["wall_s"]}))
    print(repr(tok.decode(rows[1])[:300]))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], float(a[1]), int(a[2]), int(a[3]) if len(a) > 3 else 1, a[4] if len(a) > 4 else "32")
