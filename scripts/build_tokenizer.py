"""Train the shipped byte-level BPE tokenizer into revffn/assets/tokenizer/ (offline, deterministic).

Corpus: docstrings of the Python standard library (`python_doc_corpus`) plus text from the task
generators (so the task words and numbers become single tokens). Special tokens, ids and the chat
template are defined in `revffn.data.tokenizer`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from corpus import python_doc_corpus
from tasks import format_task, mini_gsm, reversal
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from revffn.data.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, SHIPPED_TOKENIZER, SPECIAL_TOKENS

VOCAB_SIZE = 2048


def task_corpus(n: int = 2000, seed: int = 99) -> list[str]:
    """Prompts and answers of the synthetic tasks (a separate seed from the shipped data files).

    Fields are joined by newlines as in the chat template, so words that start a line (the first
    word of an answer) are learned as tokens too, not only their space-prefixed forms.
    """
    out = []
    for ex in mini_gsm(n, seed) + format_task(n, seed) + reversal(n // 2, seed):
        out.append("\n".join(filter(None, (ex["instruction"], ex["input"], ex["output"]))))
    return out


def build(vocab_size: int = VOCAB_SIZE, max_doc_chars: int = 1_000_000) -> PreTrainedTokenizerFast:
    """Train the tokenizer and wrap it as a transformers tokenizer with the chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(python_doc_corpus(max_doc_chars) + task_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=SHIPPED_TOKENIZER, help="output directory (default: %(default)s)")
    args = parser.parse_args()
    tok = build()
    tok.save_pretrained(args.out)
    for path in sorted(Path(args.out).iterdir()):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    print(f"vocab {len(tok)}; special: " + ", ".join(f"{t}={tok.convert_tokens_to_ids(t)}" for t in SPECIAL_TOKENS))


if __name__ == "__main__":
    main()
