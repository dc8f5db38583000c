"""Greedy generation: a left-padded batch decodes each prompt exactly as it decodes alone, and the KV
cache changes no token."""

import pytest
import torch
from transformers import DynamicCache

from revffn.conversion.causal_lm import CausalLM
from revffn.conversion.convert import convert
from revffn.data.templates import chat_prompts
from revffn.data.tokenizer import load_tokenizer
from revffn.models.generation import generate_ids
from revffn.models.loading import load_hf
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


def test_generation_ends_where_a_sequence_fills_the_models_positions():
    """Each sequence stops at the context, by its own length (prompts of 3, 9 and 6 tokens, 12 positions), with the
    tokens it would have decoded without the limit, in a batch as alone; a prompt that fills it decodes nothing."""
    model = CausalLM(tiny_model("tiny-qwen2-moe", num_hidden_layers=2)).eval()
    prompts = _prompts()
    free = generate_ids(model, prompts, 8, stop=set(), pad_id=0)
    capped = generate_ids(model, prompts, 8, stop=set(), pad_id=0, context=12)
    assert [len(seq) for seq in capped] == [8, 3, 6]
    assert capped == [ref[: len(seq)] for seq, ref in zip(capped, free)]
    assert capped == [generate_ids(model, [p], 8, stop=set(), pad_id=0, context=12)[0] for p in prompts]
    assert generate_ids(model, prompts, 8, stop=set(), pad_id=0, context=9) == [free[0][:6], [], free[2][:3]]


def _both(name: str):
    """The plain HF model and the converted one (its own weights), eval mode."""
    return (CausalLM(tiny_model(name, num_hidden_layers=2)).eval(),
            convert(tiny_model(name, num_hidden_layers=2)).eval())


@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-mixtral"])
def test_kv_cache_decoding_equals_recomputing_the_prefix(name, one_thread):
    """Left-padded batch, one row stopping early: the cached decode picks the same tokens, and each
    step's logits equal the full recomputation's to float rounding."""
    for model in _both(name):
        prompts = _prompts()
        free = generate_ids(model, prompts, 10, stop=set(), pad_id=0, use_cache=False)
        assert generate_ids(model, prompts, 10, stop=set(), pad_id=0, use_cache=True) == free
        stop = {free[0][3]}  # the first row stops after 3 tokens; the others decode on, masked beside it
        assert (generate_ids(model, prompts, 10, stop=stop, pad_id=0, use_cache=True)
                == generate_ids(model, prompts, 10, stop=stop, pad_id=0, use_cache=False))
        ids = torch.randint(3, 500, (2, 12))
        mask = torch.ones_like(ids)
        mask[1, :4] = 0  # left padding
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            full = model(ids, attention_mask=mask, position_ids=pos).logits
            head = model(ids[:, :9], attention_mask=mask[:, :9], position_ids=pos[:, :9], use_cache=True)
            cache, steps = head.cache, [head.logits]
            for t in range(9, 12):
                out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1], cache=cache)
                steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_converted_model_refuses_a_cache_on_the_reversible_path():
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2)).train()
    with pytest.raises(ValueError, match="plain twin"):
        model(torch.randint(3, 500, (1, 4)), cache=DynamicCache(config=model.config))
    assert model(torch.randint(3, 500, (1, 4)), use_cache=True).cache is None  # the reversible path starts none


def test_kv_cache_decoding_of_the_shipped_base_equals_recomputing(one_thread):
    """builtin:base, converted and plain, a left-padded batch of real chat prompts: the same 24 tokens."""
    tok = load_tokenizer(None)
    texts = chat_prompts(["Put commas between: rope ink tea", "What is 3 + 4?", "Sort: pear fig"], tok)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    for model in (CausalLM(load_hf("builtin:base")).eval(), convert(load_hf("builtin:base")).eval()):
        free = generate_ids(model, prompts, 24, stop=set(), pad_id=tok.pad_token_id, use_cache=False)
        assert generate_ids(model, prompts, 24, stop=set(), pad_id=tok.pad_token_id, use_cache=True) == free


def test_positions_follow_the_configs_rope_scaling():
    """As vLLM's max_model_len: max_position_embeddings times a scaling's factor; no limit under dynamic NTK."""
    from transformers import LlamaConfig, Qwen2MoeConfig

    from revffn.models.generation import positions

    assert positions(Qwen2MoeConfig(max_position_embeddings=4096)) == 4096
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 4096}
    assert positions(LlamaConfig(max_position_embeddings=4096, rope_parameters=yarn)) == 16384
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert positions(LlamaConfig(max_position_embeddings=4096, rope_parameters=dynamic)) is None
    assert positions(None) is None and positions(object()) is None
