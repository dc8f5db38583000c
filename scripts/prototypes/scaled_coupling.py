"""[LIMIT=32] [THREADS=2]
    python scripts/prototypes/scaled_coupling.py            # loss and rebuilt embedding per lam
    python scripts/prototypes/scaled_coupling.py depth      # cancelled: the rebuilt b's error k layers down

Prototype behind docs/conversion.md ("A scaled coupling, MEFT's way"): can a coupling keep the pretrained function
by scaling the stream it adds to, instead of fitting adapters? Forward only, no training, no calibration, on the
dense builtin:smollm2, each whole decoder layer L_n (attention then MLP, residuals included) as F:

    lagged:    a' = b,          b' = lam * a + L(b)   (G = 0: b' = L(b) + lam * the state two layers back)
    cancelled: a' = b - b',     b' = lam * a + L(b)   (G = -I: b' = L(b) - lam * the previous layer's update)

Both are Y_1 = lam * X_1 + F(X_2), Y_2 = X_2 + G(Y_1) with (X_1, X_2) = (a, b) and the next block reading
(Y_2, Y_1). b starts at the embedding, a at 0; the head reads b. lam = 0 is the base model exactly, and not
invertible: the inverse is b = a' (lagged) or b = a' + b' (cancelled), then a = (b' - L(b)) / lam, which divides
each layer's rounding by lam. Printed per lam: the held-out loss on the first LIMIT documents of
builtin:pydoc_text (256 tokens each), and the relative error of the embedding rebuilt from the top streams in
fp32 (what a reversible backward would start its last layer from). `depth`: for the cancelled coupling, the
relative error of the rebuilt b after k inverse steps from the top, k = 1..30 (how far apart exact anchors, stored
streams, would have to be).
"""

import json
import os

import torch

from revffn.data.formats import load_examples
from revffn.data.tokenizer import model_tokenizer
from revffn.models.loading import load_hf

LAMS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)


def held_out_layers(name: str = "builtin:smollm2", limit: int = 32):
    """The first `limit` documents of builtin:pydoc_text (256 tokens) through `name`: the embedding h0, `layer(i, x)`
    (decoder layer i, residuals included, on those rows), `loss(h)` (held-out loss of a last hidden state), the number
    of layers and the token ids. Call under torch.no_grad()."""
    from transformers.masking_utils import create_causal_mask

    tok = model_tokenizer(name)
    hf = load_hf(name).eval()
    texts = [r["text"] for r in load_examples("builtin:pydoc_text", "text")[:limit]]
    enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=256)
    ids, keep = enc["input_ids"], enc["attention_mask"].bool()
    m = hf.model
    h0 = m.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    pe = m.rotary_emb(h0, pos)
    mask = create_causal_mask(config=m.config, inputs_embeds=h0, attention_mask=enc["attention_mask"],
                              past_key_values=None, position_ids=pos)

    def layer(i, x):
        out = m.layers[i](x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return out[0] if isinstance(out, tuple) else out

    def loss(h):
        logp = torch.log_softmax(hf.lm_head(m.norm(h))[:, :-1].float(), -1)
        nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
        return float(nll[keep[:, 1:]].mean())

    return h0, layer, loss, len(m.layers), ids


def main(mode: str = "loss") -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    with torch.no_grad():
        h0, layer, loss, n, _ = held_out_layers("builtin:smollm2", int(os.environ.get("LIMIT", "32")))
        if mode == "depth":
            for lam in (0.05, 0.1, 0.2, 0.5, 1.0):
                a, b, states = torch.zeros_like(h0), h0.clone(), []
                for i in range(n):
                    states.append(b)
                    b_new = lam * a + layer(i, b)
                    a, b = b - b_new, b_new
                errs = []
                for i in reversed(range(n)):
                    b_prev = a + b
                    a, b = (b - layer(i, b_prev)) / lam, b_prev
                    errs.append(float(f"{((b - states[i]).norm() / states[i].norm()).item():.3g}"))
                print(json.dumps({"coupling": "cancelled", "lam": lam, "rel_error_after_k_steps": errs}), flush=True)
            return
        for kind in ("lagged", "cancelled"):
            for lam in LAMS:
                a, b = torch.zeros_like(h0), h0.clone()
                for i in range(n):
                    b_new = lam * a + layer(i, b)
                    a, b = (b, b_new) if kind == "lagged" else (b - b_new, b_new)
                row = {"coupling": kind, "lam": lam, "loss": round(loss(b), 4)}
                if lam > 0:  # rebuild the embedding from the top streams, layer by layer, in fp32
                    for i in reversed(range(n)):
                        b_prev = a if kind == "lagged" else a + b
                        a, b = (b - layer(i, b_prev)) / lam, b_prev
                    rel = ((b - h0).norm() / h0.norm()).item()
                    row["rebuilt_embedding_rel_error"] = float(f"{rel:.3g}") if rel == rel else "nan"
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:2])
