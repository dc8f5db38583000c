"""[RIDGE=1e-3] [RMODE=mean|diag] [LIMIT=32|all] [BIAS_C=1] [CAL=builtin:pydoc_calibration]
    python scripts/prototypes/skip_features.py VARIANT TOKENS THREADS

Prototype behind docs/conversion.md ("Calibration levers on SmolLM2"): what the full-width skips read, and the
ridge. VARIANT: raw (the skip reads the stream X, as built) | norm ([X, X/rms(X)]) | onlynorm (X/rms(X)) | bias
([X, BIAS_C]: a bias path) | normbias. The dense builtin:smollm2 is converted at full width, calibrated in closed
form on TOKENS of CAL (`conversion.calibrate`, which reads a skip's `features`), and scored on builtin:pydoc_text
(LIMIT=32: the first 32 documents; all: every one).
"""

import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as Fn

from revffn.conversion import calibrate as C
from revffn.conversion.convert import convert
from revffn.data.calibration import calibration_rows, row_batches
from revffn.data.tokenizer import model_tokenizer
from revffn.models.loading import load_hf
from revffn.training.evaluate import retention_loss

RIDGE, RMODE = float(os.environ.get("RIDGE", "1e-3")), os.environ.get("RMODE", "mean")
BIAS_C = float(os.environ.get("BIAS_C", "1"))  # the constant feature's value: its scale against the ridge


class FeatSkip(nn.Module):
    """A skip whose weight multiplies `features(x)` (what `conversion.calibrate` fits it on)."""

    def __init__(self, d: int, kind: str):
        super().__init__()
        self.kind, self.out_features = kind, d
        self.in_features = d * ((not kind.startswith("only")) + ("norm" in kind)) + ("bias" in kind)
        self.weight = nn.Parameter(torch.zeros(d, self.in_features))

    def features(self, x):
        parts = [] if self.kind.startswith("only") else [x]
        if "norm" in self.kind:
            parts.append(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        if "bias" in self.kind:
            parts.append(torch.full_like(x[..., :1], BIAS_C))
        return torch.cat(parts, -1)

    def forward(self, x):
        return Fn.linear(self.features(x), self.weight.to(x.dtype))


def solve_diag(self, ridge):
    """RMODE=diag: lambda x diag(XᵀX) (scale-free per column) instead of lambda x mean(diag) x I."""
    W = torch.linalg.solve(self.xtx + ridge * torch.diag(self.xtx.diagonal().clamp(min=1e-12)), self.xty)
    rss = self.yy - 2 * (W * self.xty).sum() + (W * (self.xtx @ W)).sum()
    return W.T.contiguous(), float(rss / self.yy.clamp(min=1e-30))


def main(variant: str, n_tokens: int, threads: int) -> None:
    torch.set_num_threads(threads)
    if RMODE == "diag":
        C.RidgeFit.solve = solve_diag
    tok = model_tokenizer("builtin:smollm2")
    model = convert(load_hf("builtin:smollm2"), adapter_init="calibrated", adapter_skip=True,
                    stream_width="full").eval()
    if variant != "raw":
        for b in model.blocks:
            d = b.p_down_attn.out_features
            b.p_skip_attn, b.p_skip_moe = FeatSkip(d, variant), FeatSkip(d, variant)
    rows = calibration_rows(os.environ.get("CAL", "builtin:pydoc_calibration"), tok, model, n_tokens, "calibration", 0)
    report = C.calibrate(model, row_batches(rows), ridge=RIDGE)
    with torch.no_grad():
        loss = retention_loss(model, tok, "builtin:pydoc_text", 256,
                              limit=None if os.environ.get("LIMIT") == "all" else 32)
    print(json.dumps({"variant": variant, "ridge": RIDGE, "rmode": RMODE, "tokens": n_tokens, "loss": round(loss, 4),
                      "calibration_s": report["wall_s"]}))
    print(json.dumps({k: round(v, 3) for k, v in report["residuals"].items()}))


if __name__ == "__main__":
    t0 = time.time()
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2)
