"""revffn/data/calibration.py: where `self` calibration text starts: bos when the tokenizer prepends one,
else eos (the shipped base packs its corpus with eos).

A ChatML instruct model (SmolLM2, Qwen) ends chat turns with `<|im_end|>`, its eos, and its pretraining
documents with `<|endoftext|>`. Sampling from `<|endoftext|>` was measured on SmolLM2 and not kept: better on
held-out prose by 0.16 nats, worse on the knowledge probes' answers by 0.52 (docs/conversion.md).
"""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from revffn.data.calibration import start_token
from revffn.data.tokenizer import model_tokenizer

VOCAB = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|end|>": 3, "a": 4}


def _tokenizer(eos: str, bos: str | None = "<|im_start|>", prepend_bos: bool = False) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if prepend_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, VOCAB[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, unk_token="<|endoftext|>")


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|end|>", "<|endoftext|>"])
def test_text_starts_at_eos(eos):
    assert start_token(_tokenizer(eos)) == VOCAB[eos]


def test_a_prepended_bos_wins():
    assert start_token(_tokenizer("<|im_end|>", prepend_bos=True)) == VOCAB["<|im_start|>"]


def test_the_shipped_base_starts_at_its_eos():
    tok = model_tokenizer("builtin:base")
    assert start_token(tok) == tok.eos_token_id == tok.convert_tokens_to_ids("<|end|>")
