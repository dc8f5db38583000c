"""[LIMIT=32] [THREADS=2] [MODEL=builtin:smollm2] [KS=3,4,5,6]
    python scripts/prototypes/buffered_coupling.py

Prototype behind docs/conversion.md ("The cancelled coupling with a bit buffer"). stop 45's scaled coupling
(`scaled_coupling.py`) keeps SmolLM2 within 0.07 nats with no fitting, b' = lam*a + L(b), a' = b - b', but its
inverse divides by lam, so its rounding grows 1/lam a layer. Made exact the way MacKay et al. (2018, "Reversible
recurrent neural networks") make a forgetting RNN exact: the streams are fixed point (int64, FRAC bits of fraction),
lam = 2^-k is an arithmetic shift, and the k low bits the shift drops are kept in a buffer (k bits per coordinate per
layer). Then

    forward:  lost = a & (2^k - 1);   b' = (a >> k) + q(L(b));   a' = b - b'
    inverse:  b = a' + b';            a = ((b' - q(L(b))) << k) + lost

is integer arithmetic, exact whatever the depth, as long as q(L(b)) (L in floating point on the exact b, rounded to
the fixed point grid) is recomputed bitwise. Printed per k: the held-out loss on the first LIMIT documents of
builtin:pydoc_text (256 tokens), whether the embedding rebuilt from the top streams is bitwise the forward's, and the
buffer's bytes against bf16 checkpoints of every layer input.
"""

import json
import os

import torch
from scaled_coupling import held_out_layers  # the same held-out rows and layer calls

FRAC = 32  # fraction bits: resolution 2.3e-10, range +-2^31


def q(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x.double() * 2.0 ** FRAC).to(torch.int64)


def dq(x: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (x.double() * 2.0 ** -FRAC).to(dtype)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    limit = int(os.environ.get("LIMIT", "32"))
    name = os.environ.get("MODEL", "builtin:smollm2")
    ks = [int(k) for k in os.environ.get("KS", "3,4,5,6").split(",")]
    with torch.no_grad():
        h0, layer, loss, n, ids = held_out_layers(name, limit)
        b = h0
        for i in range(n):
            b = layer(i, b)
        print(json.dumps({"model": name, "base_loss": round(loss(b), 4)}), flush=True)
        for k in ks:
            a, b = torch.zeros_like(h0, dtype=torch.int64), q(h0)
            lost, inputs = [], []
            for i in range(n):
                inputs.append((a, b))
                lost.append((a & ((1 << k) - 1)).to(torch.uint8))
                b_new = (a >> k) + q(layer(i, dq(b)))
                a, b = b - b_new, b_new
            row = {"k": k, "lam": 2.0 ** -k, "loss": round(loss(dq(b)), 4),
                   "max_abs_stream": float(max(dq(a).abs().max(), dq(b).abs().max()))}
            exact = True
            for i in reversed(range(n)):
                b_prev = a + b
                a, b = ((b - q(layer(i, dq(b_prev)))) << k) + lost[i].to(torch.int64), b_prev
                exact &= torch.equal(a, inputs[i][0]) and torch.equal(b, inputs[i][1])
            row["rebuilt_bitwise"] = bool(exact and torch.equal(b, q(h0)))
            tokens = ids.numel()
            row["buffer_bytes_per_token"] = k * h0.shape[-1] * n / 8
            row["bf16_checkpoints_bytes_per_token"] = 2 * h0.shape[-1] * n
            row["tokens"] = tokens
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
