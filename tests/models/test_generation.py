"""Greedy generation: a left-padded batch decodes each prompt exactly as it decodes alone."""

import torch

from revffn.models.causal_lm import CausalLM
from revffn.models.convert import convert
from revffn.models.generation import generate_ids
from revffn.models.presets import tiny_model


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 9, 6)]


def test_batched_left_padded_generation_equals_unbatched():
    for model in (CausalLM(tiny_model("tiny-qwen2-moe", num_hidden_layers=2)).eval(),
                  convert(tiny_model("tiny-mixtral", num_hidden_layers=2)).eval()):
        prompts = _prompts()
        alone = [generate_ids(model, [p], 8, stop=set(), pad_id=0)[0] for p in prompts]
        batched = generate_ids(model, prompts, 8, stop=set(), pad_id=0)
        assert batched == alone
        assert all(len(seq) == 8 for seq in alone)


def test_generation_stops_per_sequence_at_a_stop_token():
    model = CausalLM(tiny_model("tiny-qwen2-moe", num_hidden_layers=2)).eval()
    prompts = _prompts()
    free = generate_ids(model, prompts, 8, stop=set(), pad_id=0)
    stop = free[1][2]  # the third token of the second prompt's continuation
    out = generate_ids(model, prompts, 8, stop={stop}, pad_id=0)
    first = free[1].index(stop)
    assert out[1] == free[1][:first]  # cut at the stop token, which is dropped
    for seq, ref in zip(out, free):  # the others continue as before until their own stop
        assert seq == ref[: ref.index(stop)] if stop in ref else seq == ref
