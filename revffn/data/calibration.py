"""Text for calibration and heal: `self` (sampled from the unconverted model), a data file or a `builtin:` set.

Both need general text: adapters fitted or healed on a narrow task distribution lose more of the
base model than doing nothing (docs/conversion.md). `self` needs no data at all: sequences of
`SEQ_LEN` tokens sampled at temperature 1 from the pretrained model itself (`conversion.teacher.sample_self`),
each starting at the document boundary (`start_token`). A file's examples are rendered as training renders them
(text + eos; chats through the template), shuffled, concatenated and cut into rows of `SEQ_LEN`.

    rows = calibration_rows("self", tokenizer, model, n_tokens=32768, key="revffn.calibration_data")
"""

from __future__ import annotations

import random

import torch

from revffn.conversion.teacher import sample_self
from revffn.data.collate import CHARS_PER_TOKEN_CAP, _encode
from revffn.data.formats import load_examples
from revffn.errors import UserError

SELF = "self"
SEQ_LEN = 128  # tokens per calibration / heal row
SAMPLE_BATCH = 64  # rows sampled at once for a `self` heal


def start_token(tokenizer) -> int:
    """The document-boundary token a sampled sequence starts from: bos when the tokenizer prepends one to
    every text, else eos (packed corpora separate documents with it; the shipped base's does). On a ChatML
    instruct model eos is `<|im_end|>`, and the samples continue a chat; starting them at the pretraining
    separator `<|endoftext|>` instead was measured and not kept (docs/conversion.md, "`self` text on an
    instruct model": 0.16 nats better on held-out prose, 0.52 worse on the knowledge probes' answers)."""
    ids = tokenizer("a")["input_ids"]
    if tokenizer.bos_token_id is not None and ids and ids[0] == tokenizer.bos_token_id:
        return tokenizer.bos_token_id
    return tokenizer.eos_token_id


def is_task_data(examples: list[dict]) -> bool:
    """True when the examples are conversations (instruction, chat, prompt/completion), not plain text."""
    return any(e.get("text") is None for e in examples)


def file_rows(source: str, tokenizer, n_tokens: int | None, key: str, seed: int = 0,
              seq_len: int = SEQ_LEN, budget_key: str = "the token budget") -> torch.Tensor:
    """(rows, seq_len) token ids from a data file or builtin set: the first `n_tokens` (None: all whole rows).

    Raises:
        UserError: naming `key`, when the source holds no text or fewer than `n_tokens` tokens.
    """
    examples = load_examples(source, key)
    random.Random(seed).shuffle(examples)
    need = n_tokens if n_tokens is not None else seq_len
    cap = need * CHARS_PER_TOKEN_CAP if n_tokens is not None else None  # a huge row costs the budget, not its size
    flat = [t for e in examples for t in _encode(e, tokenizer, cap)[0]]
    if len(flat) < need:
        raise UserError(f"{key}: {source!r} holds {len(flat)} tokens, fewer than the {need} needed"
                        + (f" ({budget_key}={n_tokens})" if n_tokens else "")
                        + f". Fix: give more text, lower the token budget to at most {len(flat)}, or use {SELF} "
                        "(text sampled from the model itself, no data needed).")
    seq = min(seq_len, need)
    n = (need if n_tokens is not None else len(flat)) // seq
    return torch.tensor(flat[: n * seq], dtype=torch.long).view(n, seq)


def calibration_rows(source: str, tokenizer, model, n_tokens: int, key: str, seed: int = 0,
                     seq_len: int = SEQ_LEN, budget_key: str = "the token budget") -> torch.Tensor:
    """(rows, seq_len) token ids, n_tokens in all (rounded down to whole rows): sampled from `model`
    (a converted model; its teacher path) when `source` is ``self``, else from the file."""
    if source == SELF:
        seq = min(seq_len, n_tokens)
        return sample_self(model, max(n_tokens // seq, 1), seq, start_token(tokenizer), seed=seed)
    return file_rows(source, tokenizer, n_tokens, key, seed, seq_len, budget_key)


class StepRows:
    """`n_rows` rows of heal text for any training step, a function of (seed, step) alone, so a resumed
    run heals on the same text: for ``self`` pools of `SAMPLE_BATCH` rows sampled from the model
    (batched decoding is cheaper per token), one pool per run of steps it covers; for a file, rows
    drawn at random with a generator seeded by (seed, step).

        rows = StepRows("self", tokenizer, n_rows=8, key="revffn.heal_data")(model, step)   # (8, SEQ_LEN)
    """

    def __init__(self, source: str, tokenizer, n_rows: int, key: str, seed: int = 0, seq_len: int = SEQ_LEN,
                 rows: torch.Tensor | None = None):
        self.source, self.n_rows, self.seed, self.seq_len = source, n_rows, seed, seq_len
        self.start_id = start_token(tokenizer)
        self.rows = rows if rows is not None or source == SELF else file_rows(source, tokenizer, None, key, seed,
                                                                                  seq_len)
        self.per_pool = max(1, max(SAMPLE_BATCH, n_rows) // n_rows)  # steps one sampled pool serves
        self._pool: tuple[int, torch.Tensor] | None = None

    def __call__(self, model, step: int) -> torch.Tensor:
        if self.rows is not None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            return self.rows[torch.randint(0, self.rows.shape[0], (self.n_rows,), generator=gen)]
        k, i = divmod(step, self.per_pool)
        if self._pool is None or self._pool[0] != k:
            pool = sample_self(model, self.per_pool * self.n_rows, self.seq_len, self.start_id,
                               seed=self.seed * 1_000_003 + k + 1)
            self._pool = (k, pool)
        return self._pool[1][i * self.n_rows : (i + 1) * self.n_rows]


def row_batches(rows: torch.Tensor, batch_size: int = 32):
    """A re-iterable source of (input_ids, None) batches over `rows` (what `conversion.calibrate` passes over)."""
    return lambda: ((rows[i : i + batch_size], None) for i in range(0, rows.shape[0], batch_size))
