"""Streaming training data (`streaming: true`): an `hf:` or table source read as a `datasets.IterableDataset`,
each process reading its own shard and tokenizing (and packing) as it trains, so a corpus never has to fit
in any process's RAM.

    stream = TokenStream("hf:allenai/c4:en", tokenizer, max_seq_length=2048, packing=True, seed=0)
    items = stream.next_items(8)      # (input_ids, labels) pairs, as in TokenizedDataset.items
    state = stream.state_dict()       # {"epoch", "examples", "carry_ids", "carry_labels"}

Order: epoch e reads this process's shard (`datasets.distributed.split_dataset_by_node`: whole files when
their number divides by the processes, else every world-th example), files in their order, through a shuffle
buffer of `shuffle_buffer` examples seeded by (seed, e) (`buffer_shuffle`), and the next epoch starts when the
shard ends. Each
example is truncated to `max_seq_length` and dropped without a trained token, as `collate.tokenize_dataset`
does; with packing the examples are then concatenated into rows of `max_seq_length`, the rest carried
over (across epochs too).

Resume is exact: `load_state_dict(state)` on a fresh stream with the same arguments reads past the
`examples` of the epoch already taken (reading them, not tokenizing them) and restores the packing carry,
so the next items are the ones the uninterrupted stream would have given (tests/data/test_stream.py).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from revffn.data import tables
from revffn.data.collate import data_shard, encode_truncated, has_trained_token
from revffn.data.formats import FORMAT_KEYS, FORMATS_HELP, normalise
from revffn.errors import UserError

SHUFFLE_BUFFER = 1000  # examples; 0 reads each shard in file order


def check_streamable(ref: str, key: str = "data") -> None:
    """Refuse, before anything loads, a source that `datasets` cannot stream: JSON and `builtin:` sets are
    read whole (the formats' own file:line errors), a split slice (train[:1000]) has no streaming form."""
    if not tables.is_table(ref):
        raise UserError(f"streaming: reads hf: and table sources (parquet, arrow, csv, save_to_disk directories); "
                        f"{key}={ref!r} is {'a built-in set' if ref.startswith('builtin:') else 'a JSON file'}, "
                        "loaded whole. Fix: streaming=false, or write it as parquet "
                        "(datasets.load_dataset('json', data_files=FILE)['train'].to_parquet('data.parquet')).")
    if ref.startswith(tables.HF_PREFIX) and "[" in ref.partition("@")[2]:
        raise UserError(f"streaming: {key}={ref!r} slices its split, which a stream cannot. Fix: drop the slice "
                        "(the run's max_steps bounds what it reads), or streaming=false.")


class TokenStream:
    """This process's training items from a streamed source, in a resumable order (see the module docstring)."""

    def __init__(self, ref: str, tokenizer, max_seq_length: int, packing: bool = False, seed: int = 0,
                 key: str = "data", shuffle_buffer: int = SHUFFLE_BUFFER, shard: tuple[int, int] | None = None):
        check_streamable(ref, key)
        self.ref, self.tokenizer, self.length, self.packing = ref, tokenizer, max_seq_length, packing
        self.seed, self.key, self.shuffle_buffer = seed, key, shuffle_buffer
        self.shard = shard  # (rank, world); None: this process's, once the process group is up (`data_shard`)
        self.epoch, self.examples = 0, 0
        self.carry: tuple[list[int], list[int]] = ([], [])
        self._items: Iterator | None = None

    def _dataset(self):
        from datasets.distributed import split_dataset_by_node

        ds = tables.load_table(self.ref, self.key, streaming=True)
        columns = ds.column_names  # None when the stream's features are not known before reading
        if columns is not None and not FORMAT_KEYS & set(columns):
            raise UserError(f"{self.key}: {self.ref!r} has columns {columns}, none of which any format reads. Fix: "
                            f"rename its columns to fit one of the {FORMATS_HELP}.")
        rank, world = self.shard
        self._by_files = world > 1 and ds.num_shards % world == 0  # `split_dataset_by_node`'s "auto" rule
        return split_dataset_by_node(ds, rank=rank, world_size=world)

    def _row(self, j: int) -> str:
        """Where the `j`-th row this process reads (in file order, before the shuffle) is in the source: its
        row there, as the in-memory path names it, or where a process reads whole files, its place in them."""
        rank, world = self.shard
        if self._by_files:
            return f"{self.ref}[row {j} of the files process {rank} of {world} reads]"
        return f"{self.ref}[{j * world + rank}]"  # every world-th row from the rank-th

    def _examples(self) -> Iterator[dict]:
        """The normalised examples of this epoch from `self.examples` on."""
        rows = enumerate(tables.read_rows(self._dataset(), self.ref, self.key))  # (j, row): j names it
        if self.shuffle_buffer:
            rows = buffer_shuffle(rows, self.shuffle_buffer, random.Random(self.seed * 1_000_003 + self.epoch))
        for j, row in itertools.islice(rows, self.examples, None):
            where = self._row(j)
            try:
                yield normalise({k: v for k, v in row.items() if v is not None}, where)
            except UserError as e:  # name the config key, as `formats.load_examples` does
                raise UserError(f"{self.key}: {e}") from None

    def _generate(self) -> Iterator[tuple[list[int], list[int]]]:
        while True:
            took, resumed_within = False, self.examples > 0  # took: an example this epoch kept a trained token
            for example in self._examples():
                self.examples += 1
                ids, labels, _ = encode_truncated(example, self.tokenizer, self.length)
                if not has_trained_token(labels):
                    continue
                took = True
                if not self.packing:
                    yield ids, labels
                    continue
                carry_ids, carry_labels = self.carry[0] + ids, self.carry[1] + labels
                row = None
                if len(carry_ids) >= self.length:  # one example adds at most `length`: at most one row
                    row = carry_ids[: self.length], carry_labels[: self.length]
                    carry_ids, carry_labels = carry_ids[self.length :], carry_labels[self.length :]
                self.carry = (carry_ids, carry_labels)
                if row is not None and has_trained_token(row[1]):
                    yield row
            if not took and not resumed_within:
                raise UserError(f"{self.key}: process {self.shard[0]} of {self.shard[1]} read no trainable example "
                                f"from {self.ref!r} in a whole epoch (each lost its response to truncation at "
                                f"max_seq_length={self.length}, or its shard is empty). Fix: raise max_seq_length, "
                                "or give more data (at least one example, or file, per process).")
            self.epoch, self.examples = self.epoch + 1, 0

    def next_items(self, n: int) -> list[tuple[list[int], list[int]]]:
        """The next `n` training items of this process."""
        if self._items is None:
            self.shard = self.shard or data_shard()
            self._items = self._generate()
        return [next(self._items) for _ in range(n)]

    def state_dict(self) -> dict:
        """Where the next item comes from: enough, with the same arguments, to continue exactly."""
        return {"epoch": self.epoch, "examples": self.examples, "carry_ids": list(self.carry[0]),
                "carry_labels": list(self.carry[1])}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.examples = int(state["epoch"]), int(state["examples"])
        self.carry = (list(state["carry_ids"]), list(state["carry_labels"]))
        self._items = None

    @property
    def stats(self) -> dict:
        return {"streaming": True, "source": self.ref, "epoch": self.epoch, "examples": self.examples}


def buffer_shuffle(rows: Iterator, size: int, rng: random.Random) -> Iterator:
    """`rows` in a seeded random order through a buffer of `size`: each row read replaces, and sends on, a random
    one of the buffer (the shuffle `datasets.IterableDataset.shuffle` does; its own pass over a local file waits
    5 s as it ends, `datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN`, at each epoch and each resume)."""
    buffer = []
    for row in rows:
        if len(buffer) < size:
            buffer.append(row)
            continue
        i = rng.randrange(size)
        yield buffer[i]
        buffer[i] = row
    rng.shuffle(buffer)
    yield from buffer
