"""`rebuild_errors`, the probe behind `revffn.stream_dtype: auto`: it measures what the reversible backward really
rebuilds, and float64 streams rebuild every input bitwise."""

from __future__ import annotations

import torch

from revffn.conversion.convert import convert
from revffn.models.loading import build_hf, config_overrides
from revffn.reports.check import make_batch


def _model(stream_dtype: torch.dtype):
    hf = build_hf("tiny-qwen2-moe", torch.float32, 0, torch.device("cpu"),
                  **config_overrides("tiny-qwen2-moe", 6, None, shipped_vocab=False))
    model = convert(hf, adapter_init="coordinate", adapter_skip=True, stream_width="full", stream_dtype=stream_dtype)
    model.recompute_chunk_tokens = 0  # the backward rebuilds each block whole, as the probe does
    return model.train(), make_batch(hf.config.vocab_size, 2, 32, 0)


def test_the_probe_reads_exactly_what_the_backward_rebuilds():
    """Per layer, the probe's relative error is bitwise the one between the plain forward's inputs and those the
    reversible backward rebuilt (fp32 rounding: small and nonzero on every layer but the top's inputs)."""
    model, (ids, mask, labels) = _model(torch.float32)
    forward, rebuilt = {}, {}
    model.reversible = False
    with torch.no_grad():
        model(ids, attention_mask=mask, return_logits=False,
              probe=lambda i, a, b: forward.__setitem__(i, (a.clone(), b.clone())))
    model.reversible = True
    model(ids, attention_mask=mask, labels=labels, return_logits=False,
          probe=lambda i, a, b: rebuilt.__setitem__(i, (a.clone(), b.clone()))).loss.backward()
    seen = [(max((a - b).abs().max() for a, b in zip(forward[i], rebuilt[i]))
             / max(x.abs().max() for x in forward[i])).item() for i in sorted(forward)]
    probed = model.rebuild_errors(ids, mask)
    assert probed == seen
    assert all(e > 0 for e in probed[:-1]) and max(probed) < 1e-5


def test_float64_streams_rebuild_every_input_bitwise():
    model, (ids, mask, _) = _model(torch.float64)
    assert model.rebuild_errors(ids, mask) == [0.0] * 6
