"""Tabular data through Hugging Face `datasets`: hub datasets, `save_to_disk` directories, parquet,
arrow and csv files. `formats.load_examples` normalises their rows exactly as it does JSON records.

    hf:NAME[:CONFIG][@SPLIT]  datasets.load_dataset(NAME, CONFIG, split=SPLIT or "train"); NAME is a hub
                              dataset ID or a local directory of data files; SPLIT may slice (train[:1000])
    DIR[@SPLIT]               a directory written by Dataset.save_to_disk, or DatasetDict.save_to_disk
                              (its `train` split unless @SPLIT names another)
    FILE.parquet|.arrow|.csv  datasets.load_dataset("parquet" | "arrow" | "csv", data_files=FILE)

The table is memory-mapped Arrow (a hub or file source is converted once into the `datasets` cache,
~/.cache/huggingface/datasets); `rows` reads it a batch at a time. A hub dataset is downloaded as
`load_dataset` does, unless HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) is set: then the cached copy alone
loads. CSV has no types, so every CSV
column is read as text (else an answer "007" would arrive as the integer 7); it holds only the flat
formats (alpaca, prompt/completion with strings, text), since a cell cannot hold a list of turns.

`datasets` is imported on first use: it costs about a second, and JSON data never needs it.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from revffn.errors import UserError

HF_PREFIX = "hf:"
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}  # file suffix -> datasets builder
SOURCES_HELP = ("hf:NAME[:CONFIG][@SPLIT] (a hub dataset ID or a local directory of data files), a directory "
                "written by save_to_disk (DIR[@SPLIT]), a .parquet, .arrow, .csv, .json or .jsonl file, or "
                "builtin:NAME")


def _saved_dir(ref: str) -> tuple[Path, str | None] | None:
    """(directory, split) when `ref` is DIR or DIR@SPLIT of an existing directory, else None."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path, None
    base, at, split = ref.rpartition("@")
    if at and base and Path(base).expanduser().is_dir():
        return Path(base).expanduser(), split
    return None


def is_table(ref: str) -> bool:
    """True for the sources read here; the others are JSON files and `builtin:` sets."""
    return ref.startswith(HF_PREFIX) or Path(ref).suffix.lower() in BUILDERS or _saved_dir(ref) is not None


def load_table(ref: str, key: str, streaming: bool = False):
    """The `datasets.Dataset` that `ref` names (see the module docstring for the forms); with `streaming`, the
    `datasets.IterableDataset` that reads it as it goes (`data.stream`; a save_to_disk directory is memory-mapped
    already, and streamed over its Arrow files).

    Raises:
        UserError: naming `key`, when the source is missing, cannot be read, or lacks the split.
    """
    import datasets

    quiet = logging.getLogger("datasets")  # its own error log would repeat the reason this raises as one line
    level, quiet.level = quiet.level, logging.CRITICAL
    bars = datasets.is_progress_bar_enabled()
    if not ref.startswith(HF_PREFIX):  # a local file: its "Generating train split" bar is noise beside the run's
        datasets.disable_progress_bars()  # own (a Hub download keeps its bars)
    try:
        if ref.startswith(HF_PREFIX):
            name, config, split = _hf_args(ref)
            if not name.strip("/"):
                raise UserError(f"{key}: {ref!r} names no dataset. Fix: hf:NAME[:CONFIG][@SPLIT], e.g. "
                                "hf:tatsu-lab/alpaca, or hf:DIR for a local directory of data files.")
            return datasets.load_dataset(name, config, split=split, streaming=streaming)
        saved = _saved_dir(ref)
        if saved is not None:
            table = _split_of(datasets.load_from_disk(str(saved[0])), saved[1], ref, key)
            return table.to_iterable_dataset(num_shards=len(table.cache_files) or 1) if streaming else table
        file = Path(ref).expanduser()
        if not file.is_file():
            raise missing_file(ref, key)
        builder = BUILDERS[file.suffix.lower()]
        features = _text_features(file) if builder == "csv" else None
        return datasets.load_dataset(builder, data_files=str(file), split="train", features=features,
                                     streaming=streaming)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise UserError(_load_failure(ref, key, e)) from None
    finally:
        quiet.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def read_rows(table, ref: str, key: str) -> Iterator[dict]:
    """The rows of a streamed table, as it reads them: a source that turns out unreadable part way (a CSV with an
    unclosed quote, an empty file) raises the UserError `load_table` would have."""
    import datasets

    rows = iter(table)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
            raise UserError(_load_failure(ref, key, e)) from None
        yield row


def missing_file(ref: str, key: str) -> UserError:
    """The error for a data file that does not exist (JSON ones included)."""
    return UserError(f"{key}: file {ref!r} not found. Fix: give an existing file (relative to the working "
                     f"directory), or another source: {SOURCES_HELP}.")


def _hf_args(ref: str) -> tuple[str, str | None, str]:
    """(NAME, CONFIG or None, SPLIT, default train) of hf:NAME[:CONFIG][@SPLIT]."""
    rest, _, split = ref.removeprefix(HF_PREFIX).partition("@")
    name, _, config = rest.partition(":")
    return name, config or None, split or "train"


def _split_of(loaded, split: str | None, ref: str, key: str):
    """The Dataset of a `load_from_disk` result: a DatasetDict's `split` (default train), or the Dataset."""
    if not hasattr(loaded, "keys"):  # a single Dataset
        if split:
            raise UserError(f"{key}: {ref!r} is a single Dataset with no splits. Fix: drop '@{split}'.")
        return loaded
    want = split or "train"
    if want not in loaded:
        base = ref.rpartition("@")[0] if split else ref
        raise UserError(f"{key}: {ref!r} has no split {want!r}; it has {', '.join(loaded)}. Fix: name one, "
                        f"e.g. {base}@{next(iter(loaded))}.")
    return loaded[want]


def _text_features(file: Path):
    """Every column of a CSV file as text: CSV carries no types, and every field of every format is a string."""
    import datasets

    with open(file, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({column: datasets.Value("string") for column in header}) if header else None


def _load_failure(ref: str, key: str, error: Exception) -> str:
    """One line for a source `datasets` could not load: its reason, and the fix for that form of source. A data
    file that does not parse in a local hf:DIR is named with its line, as a JSON file given directly would be."""
    import datasets

    reading = isinstance(error, datasets.exceptions.DatasetGenerationError)  # the files, not the reference
    if reading and error.__cause__ is not None:
        error = error.__cause__  # "An error occurred while generating the dataset": the reason is its cause
    lines = str(error).strip().splitlines()
    reason = (lines[0] if lines else type(error).__name__).rstrip(".")
    local = Path(_hf_args(ref)[0]).expanduser() if ref.startswith(HF_PREFIX) else None
    if reading and local is not None and local.is_dir() and (bad := _bad_json_line(local)):
        return (f"{key}: {ref!r}: {bad}. Fix: make each line of a .jsonl file one JSON object (a .json file: one "
                "JSON list or object), or move the file out of the directory.")
    if "column names don't match" in str(error):  # datasets reads a source's files as one table
        return (f"{key}: cannot load {ref!r}: its data files do not all have the same columns (datasets reads them "
                "as one table). Fix: one format in every file of the source, or give each file as its own source.")
    if ref.startswith(HF_PREFIX) and isinstance(error, ConnectionError):
        if datasets.config.HF_HUB_OFFLINE:
            return (f"{key}: {ref!r} is neither a local directory nor in the datasets cache, and downloading is "
                    "off (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE). Fix: run once with network and without them "
                    "to download it into the cache, or give a directory written by save_to_disk.")
        return (f"{key}: cannot load {ref!r}: the Hub is not reachable ({reason}). Fix: download it once where it "
                f"is, e.g. python -c \"import datasets; datasets.load_dataset('{_hf_args(ref)[0]}')\", then run "
                "again; or give a directory written by save_to_disk.")
    if ref.startswith(HF_PREFIX):
        fix = "check NAME, CONFIG and SPLIT of hf:NAME[:CONFIG][@SPLIT] (NAME: a hub dataset ID or a local directory)"
    elif _saved_dir(ref) is not None:
        fix = ("give a directory written by Dataset.save_to_disk or DatasetDict.save_to_disk, or hf:DIR for a "
               "directory of data files")
    else:
        fix = f"give a valid {Path(ref).suffix} file (the suffix decides how it is read)"
    return f"{key}: cannot load {ref!r}: {reason}. Fix: {fix}."


def _bad_json_line(directory: Path) -> str | None:
    """FILE:LINE and the reason of the first JSON data file under `directory` that does not parse, or None; as
    `datasets` reads them: hidden and `_` paths skipped, a .json file one document or JSON Lines. Lines are read one
    at a time (an error path over what may be gigabytes)."""
    files = sorted(p for p in directory.rglob("*") if p.suffix.lower() in (".json", ".jsonl") and p.is_file()
                   and not any(part.startswith((".", "_")) for part in p.relative_to(directory).parts))
    for file in files:
        try:
            if file.suffix.lower() == ".json":
                try:
                    json.loads(file.read_text(encoding="utf-8"))
                    continue
                except json.JSONDecodeError as e:
                    whole = f"{file}:{e.lineno}: invalid JSON ({e.msg})"
                with open(file, encoding="utf-8") as f:
                    first = next((line for line in f if line.strip()), "")
                if not _parses(first):
                    return whole
            with open(file, encoding="utf-8") as f:  # JSON Lines (a .json file of them included)
                for n, line in enumerate(f, 1):
                    try:
                        line.strip() and json.loads(line)
                    except json.JSONDecodeError as e:
                        return f"{file}:{n}: invalid JSON ({e.msg})"
        except (OSError, UnicodeDecodeError) as e:
            return f"{file}: unreadable ({e})"
    return None


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def rows(table) -> Iterator[dict]:
    """Each row of `table` as the object it was written from.

    A table's columns are shared by all its rows, so a row of one format carries the other formats'
    columns, and the optional fields it left out, as null: those keys are dropped, because the format
    is recognised by which keys a record has.
    """
    for batch in table.iter(batch_size=1024):
        columns = list(batch)
        for values in zip(*batch.values()):
            yield {column: value for column, value in zip(columns, values) if value is not None}
