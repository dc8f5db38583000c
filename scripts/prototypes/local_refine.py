"""python scripts/prototypes/local_refine.py STEPS LR TOKENS     (docs/conversion.md: 20 1e-5 16384; 20 1e-4 16384)

Prototype behind docs/conversion.md ("Calibration levers on SmolLM2"): the closed-form calibration, then a
layer-wise local refinement. Layer by layer, STEPS Adam steps (batches of 8 x 128 tokens) on that layer's adapters so
that its streams (Y_1, Y_2) track the teacher's (a_l, h_{l+1}) from the student's own inputs (relative squared
error of both increments): one layer's memory, no end-to-end backward. Then the held-out loss (first 32 documents
of builtin:pydoc_text).
"""

import json
import sys
import time

import torch

from revffn.conversion.calibrate import _capture_outputs, calibrate
from revffn.conversion.convert import convert
from revffn.conversion.teacher import teacher_context, teacher_layer
from revffn.data.calibration import calibration_rows, row_batches
from revffn.data.tokenizer import model_tokenizer
from revffn.models.loading import load_hf
from revffn.training.evaluate import retention_loss

BATCH = 8


def context(model, ids):
    _, pos, sctx = teacher_context(model, ids, None)
    sctx.aux = None
    return pos, sctx


def refine_layer(model, block, states, steps, lr, gen) -> tuple[float, float]:
    params = [p for m in block.adapters() for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    targets = []
    with torch.no_grad():
        for ids, h, _, _ in states:
            pos, sctx = context(model, ids)
            with _capture_outputs({"attn": getattr(block.base_layer, model.spec.attn)}) as t:
                h_next = teacher_layer(block, h, sctx, pos)
            targets.append(model.stream_targets(h + t["attn"], h_next))
    losses = []
    for _ in range(steps):
        k = int(torch.randint(len(states), (1,), generator=gen))
        ids, _, X1, X2 = states[k]
        a_t, h_t = targets[k]
        _, sctx = context(model, ids)
        Y1 = X1 + block.F(X2, sctx)  # plain autograd through the block's F and G
        Y2 = X2 + block.G(Y1, sctx)
        loss = (((Y1 - a_t) ** 2).sum() / ((a_t - X1) ** 2).sum()
                + ((Y2 - h_t) ** 2).sum() / ((h_t - X2) ** 2).sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    for p in params:
        p.requires_grad_(False)
    return losses[0], losses[-1]


def main(steps: int, lr: float, n_tokens: int) -> None:
    torch.set_num_threads(1)
    t0 = time.time()
    tok = model_tokenizer("builtin:smollm2")
    model = convert(load_hf("builtin:smollm2"), adapter_init="calibrated", adapter_skip=True,
                    stream_width="full").eval()
    rows = calibration_rows("builtin:pydoc_calibration", tok, model, n_tokens, "calibration", 0)
    calibrate(model, row_batches(rows))
    with torch.no_grad():
        calibrated = retention_loss(model, tok, "builtin:pydoc_text", 256, limit=32)
        states = []
        for i in range(0, rows.shape[0], BATCH):
            ids = rows[i : i + BATCH]
            h, _, _ = teacher_context(model, ids, None)
            states.append([ids, h, *model.split(h)])
    print(json.dumps({"calibrated_loss": round(calibrated, 4), "t": round(time.time() - t0)}), flush=True)
    gen = torch.Generator().manual_seed(0)
    for layer, block in enumerate(model.blocks):
        first, last = refine_layer(model, block, states, steps, lr, gen)
        with torch.no_grad():  # the next layer's inputs, through the refined block
            for st in states:
                pos, sctx = context(model, st[0])
                st[2], st[3] = block(st[2], st[3], sctx)
                st[1] = teacher_layer(block, st[1], sctx, pos)
        print(json.dumps({"layer": layer, "first": round(first, 4), "last": round(last, 4),
                          "t": round(time.time() - t0)}), flush=True)
    with torch.no_grad():
        refined = retention_loss(model, tok, "builtin:pydoc_text", 256, limit=32)
    print(json.dumps({"steps": steps, "lr": lr, "refined_loss": round(refined, 4), "t": round(time.time() - t0)}))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
