"""revffn/data/calibration.py: where `self` calibration text starts.

A ChatML instruct model (SmolLM2, Qwen) ends chat turns with `<|im_end|>`, its eos; sampled after it, the
model writes the next chat turn. Its pretraining documents are separated by `<|endoftext|>`, where it writes
web text, code and maths. `self` text starts half its rows at each (docs/conversion.md). Every other
tokenizer keeps its rule: bos when prepended, else eos (the shipped base packs its corpus with eos).
"""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from revffn.data.calibration import start_tokens
from revffn.data.tokenizer import model_tokenizer
from revffn.models.convert import convert
from revffn.models.presets import tiny_model
from revffn.models.teacher import sample_self

VOCAB = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|end|>": 3, "a": 4}


def _tokenizer(eos: str, bos: str | None = "<|im_start|>", prepend_bos: bool = False) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if prepend_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, VOCAB[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, unk_token="<|endoftext|>")


def test_chatml_instruct_text_starts_at_the_document_separator_and_at_the_turn_end():
    assert start_tokens(_tokenizer("<|im_end|>")) == (VOCAB["<|endoftext|>"], VOCAB["<|im_end|>"])


@pytest.mark.parametrize("eos", ["<|end|>", "<|endoftext|>"])
def test_other_tokenizers_start_at_eos(eos):
    assert start_tokens(_tokenizer(eos)) == (VOCAB[eos],)


def test_a_prepended_bos_wins():
    assert start_tokens(_tokenizer("<|im_end|>", prepend_bos=True)) == (VOCAB["<|im_start|>"],)


def test_the_shipped_base_starts_at_its_eos():
    tok = model_tokenizer("builtin:base")
    assert start_tokens(tok) == (tok.eos_token_id,) == (tok.convert_tokens_to_ids("<|end|>"),)


def test_sampled_rows_take_the_starts_in_turn_across_batches():
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2))
    rows = sample_self(model, 5, 4, (7, 9), batch_size=2)
    assert rows.shape == (5, 4)
    assert rows[:, 0].tolist() == [7, 9, 7, 9, 7]
    assert torch.equal(sample_self(model, 3, 4, 7), sample_self(model, 3, 4, (7,)))
