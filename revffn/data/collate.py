"""Tokenise examples into (input_ids, labels) items, pad them into batches, and order them resumably.

Each rendered segment (see `templates.render_segments`) is tokenised on its own with
`add_special_tokens=False` and the pieces are concatenated, so the label mask lines up exactly with
the segment boundaries. Labels are the input ids on trained tokens and -100 elsewhere; the loss
shifts them by one position itself.

Packing (`packing=True`) is the standard "naive" packing (as in TRL's packing without
position-id resets): examples are concatenated in order and cut into rows of exactly
`max_seq_length` tokens (the last row may be shorter). Attention crosses example boundaries inside
a row; each example ends with its end token, so the model still sees where one stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from revffn.data.templates import render_segments
from revffn.errors import UserError

IGNORE_INDEX = -100


@dataclass
class TokenizedDataset:
    """Training items `(input_ids, labels)` and counts describing how they were made."""

    items: list[tuple[list[int], list[int]]]
    stats: dict = field(default_factory=dict)


CHARS_PER_TOKEN_CAP = 64  # a segment is cut at this many characters per token of max_seq_length before tokenizing


def _encode(example: dict, tokenizer, max_chars: int | None = None) -> tuple[list[int], list[int]]:
    """(ids, labels) of one example; each rendered segment cut to `max_chars` first, so that a huge row (a 50 MB
    line) costs memory bounded by the cap, not by the row, and truncates to the same first tokens (a token is
    far fewer than CHARS_PER_TOKEN_CAP characters)."""
    segments = render_segments(example, tokenizer)
    pieces = tokenizer([text[:max_chars] for text, _ in segments], add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    labels: list[int] = []
    for (_, train), piece in zip(segments, pieces):
        ids += piece
        labels += piece if train else [IGNORE_INDEX] * len(piece)
    return ids, labels


def has_trained_token(labels: list[int]) -> bool:
    """Position 0 is never predicted (labels shift by one), so a lone trained first token does not count."""
    return any(t != IGNORE_INDEX for t in labels[1:])


def encode_truncated(example: dict, tokenizer, max_seq_length: int) -> tuple[list[int], list[int], int]:
    """(ids, labels, what truncation took) of one example cut to `max_seq_length` tokens: 0 nothing, 1 untrained
    tokens only, 2 some it trains on (a response's end, a document's)."""
    ids, labels = _encode(example, tokenizer, max_seq_length * CHARS_PER_TOKEN_CAP)
    cut = 0 if len(ids) <= max_seq_length else 2 if any(t != IGNORE_INDEX for t in labels[max_seq_length:]) else 1
    return ids[:max_seq_length], labels[:max_seq_length], cut


def _pack(items: list[tuple[list[int], list[int]]], length: int) -> list[tuple[list[int], list[int]]]:
    """Concatenate items and cut rows of `length`; rows with no predicted trained token are left out."""
    ids = [t for item_ids, _ in items for t in item_ids]
    labels = [t for _, item_labels in items for t in item_labels]
    rows = [(ids[s : s + length], labels[s : s + length]) for s in range(0, len(ids), length)]
    return [row for row in rows if has_trained_token(row[1])]


def tokenize_dataset(examples: list[dict], tokenizer, max_seq_length: int, packing: bool = False,
                     key: str = "data") -> TokenizedDataset:
    """Tokenise normalised examples into training items, truncating to `max_seq_length`.

    Examples left with no trained token after truncation are dropped; a UserError names `key` when
    nothing is left. `stats` holds n_examples, n_truncated, n_cut (truncated inside what they train on, the
    dropped ones included), n_dropped, n_items, n_tokens, n_train_tokens.
    """
    if max_seq_length < 2:
        raise UserError(f"max_seq_length: must be at least 2, got {max_seq_length}. Fix: use e.g. 512.")
    items, n_truncated, n_cut, n_dropped = [], 0, 0, 0
    for example in examples:
        ids, labels, cut = encode_truncated(example, tokenizer, max_seq_length)
        n_truncated += cut > 0
        n_cut += cut == 2
        if not has_trained_token(labels):
            n_dropped += 1
            continue
        items.append((ids, labels))
    if not items and not n_truncated:
        raise UserError(f"{key}: no trainable example: none of the {len(examples)} examples has a token to train on "
                        "(its response, or its text, is empty). Fix: give each example a non-empty output, "
                        "assistant turn, completion or text.")
    if not items:
        raise UserError(f"{key}: no trainable example left: all {len(examples)} examples lost their response to "
                        f"truncation at max_seq_length={max_seq_length} ({n_truncated} truncated, {n_dropped} "
                        "dropped). Fix: raise max_seq_length, or shorten the prompts.")
    if packing:
        items = _pack(items, max_seq_length)
    stats = {
        "n_examples": len(examples), "n_truncated": n_truncated, "n_cut": n_cut, "n_dropped": n_dropped,
        "n_items": len(items),
        "n_tokens": sum(len(ids) for ids, _ in items),
        "n_train_tokens": sum(t != IGNORE_INDEX for _, labels in items for t in labels),
    }
    return TokenizedDataset(items=items, stats=stats)


def collate(items: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch: input_ids (pad_id), attention_mask (0 on padding), labels (-100 on padding)."""
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(items):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[row, : len(lab)] = torch.tensor(lab, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def data_shard() -> tuple[int, int]:
    """(rank, world size) of this process's share of every global batch: (0, 1) unless a
    `torch.distributed` process group is up (data-parallel training). A global micro-batch holds
    `per_device_train_batch_size x world` rows, drawn in one order for all ranks; rank r trains on
    rows r x per_device .. (r + 1) x per_device of it (`shard_rows`)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_rows(rows: list, per_device: int) -> list:
    """This process's `per_device` rows of a global micro-batch (`data_shard`)."""
    rank, _ = data_shard()
    return rows[rank * per_device : (rank + 1) * per_device]


class DataOrder:
    """Deterministic, resumable order over `n` items: epoch e walks randperm(n) seeded with seed + e.

    `state_dict()` after any number of `next_indices` calls, restored into a fresh DataOrder with the
    same (n, seed, shuffle), continues with exactly the indices the uninterrupted run would produce.
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        if n < 1:
            raise ValueError("DataOrder needs at least one item")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = 0, 0
        self._perm: list[int] | None = None

    def _permutation(self) -> list[int]:
        if self._perm is None:  # cached per epoch; dropped when the epoch changes
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(self.n, generator=gen).tolist()
            else:
                self._perm = list(range(self.n))
        return self._perm

    def next_indices(self, batch_size: int) -> list[int]:
        """The next `batch_size` indices; a batch may run over into the next epoch."""
        out: list[int] = []
        while len(out) < batch_size:
            take = min(batch_size - len(out), self.n - self.position)
            out += self._permutation()[self.position : self.position + take]
            self.position += take
            if self.position == self.n:
                self.epoch, self.position, self._perm = self.epoch + 1, 0, None
        return out

    def state_dict(self) -> dict:
        """{"epoch", "position"}: enough to continue exactly (n, seed and shuffle come from the config)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()`."""
        self.epoch, self.position, self._perm = int(state["epoch"]), int(state["position"]), None
