"""Data through `datasets` (revffn/data/tables.py): hf:, save_to_disk directories, parquet, arrow and csv
give the same examples as JSONL of the same rows; and the errors. Every dataset is built here, offline."""

import json

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.feather
import pyarrow.parquet as pq
import pytest
import yaml

from revffn import cli
from revffn.data.formats import load_examples
from revffn.errors import UserError
from tests.data.test_formats import FORMATS
from tests.training.test_loop import TINY

ROWS = {  # two rows of each of the five formats
    "alpaca": [FORMATS["alpaca"][0], {"instruction": "Say hi.", "output": "hi"}],  # row 1: `input`, `system` null
    **{name: [FORMATS[name][0]] * 2 for name in ("sharegpt", "messages", "prompt_completion")},
    "text": [{"text": "prose"}, {"text": "more"}],
}
MIXED = [rows[0] for rows in ROWS.values()]  # one table of every format: each row has the others' columns null


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """load_dataset converts files into the datasets cache: keep it in the test's directory."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def _table(rows):
    """pandas unions the rows' keys into columns (datasets and pyarrow take the first row's only)."""
    return pa.Table.from_pandas(pd.DataFrame(rows), preserve_index=False)


def _strip(examples):
    return [{k: v for k, v in e.items() if k != "source"} for e in examples]


def _same_as_jsonl(source, rows, write_jsonl):
    examples = load_examples(source)
    assert _strip(examples) == _strip(load_examples(write_jsonl(rows)))
    return examples


@pytest.mark.parametrize("name", ROWS)
def test_parquet_of_each_format(name, tmp_path, write_jsonl):
    path = tmp_path / f"{name}.parquet"
    pq.write_table(_table(ROWS[name]), path)
    examples = _same_as_jsonl(str(path), ROWS[name], write_jsonl)
    assert [e["source"] for e in examples] == [f"{path}[0]", f"{path}[1]"]


def test_a_local_file_reads_without_datasets_progress_bar(tmp_path, capfd):
    """datasets' "Generating train split" bar over a local file is off while revffn reads it, and as it was after."""
    path = tmp_path / "rows.parquet"
    pq.write_table(_table(ROWS["alpaca"]), path)
    assert datasets.is_progress_bar_enabled()
    load_examples(str(path), "data")
    assert "Generating" not in capfd.readouterr().err and datasets.is_progress_bar_enabled()


def test_parquet_of_mixed_formats(tmp_path, write_jsonl):
    path = tmp_path / "mixed.parquet"
    pq.write_table(_table(MIXED), path)
    assert len(_same_as_jsonl(str(path), MIXED, write_jsonl)) == len(ROWS)


def test_hf_local_directory_with_splits(tmp_path, write_jsonl):
    root = tmp_path / "mydata"
    root.mkdir()
    pq.write_table(_table(MIXED), root / "train.parquet")
    pq.write_table(_table(ROWS["messages"]), root / "test.parquet")
    examples = _same_as_jsonl(f"hf:{root}", MIXED, write_jsonl)
    assert examples[0]["source"] == f"hf:{root}[0]"
    _same_as_jsonl(f"hf:{root}@test", ROWS["messages"], write_jsonl)
    _same_as_jsonl(f"hf:{root}@train[:2]", MIXED[:2], write_jsonl)
    msg = _error(f"hf:{root}@validation")
    assert msg.startswith(f"data: cannot load 'hf:{root}@validation': ") and 'Unknown split "validation"' in msg
    assert "Fix: check NAME, CONFIG and SPLIT" in msg


def test_save_to_disk_dataset_and_dataset_dict(tmp_path, write_jsonl):
    mixed, messages = (datasets.Dataset(_table(rows)) for rows in (MIXED, ROWS["messages"]))
    mixed.save_to_disk(str(tmp_path / "one"))
    _same_as_jsonl(str(tmp_path / "one"), MIXED, write_jsonl)
    datasets.DatasetDict({"train": mixed, "validation": messages}).save_to_disk(str(tmp_path / "dict"))
    _same_as_jsonl(str(tmp_path / "dict"), MIXED, write_jsonl)
    _same_as_jsonl(f"{tmp_path / 'dict'}@validation", ROWS["messages"], write_jsonl)
    assert "has no split 'test'; it has train, validation. Fix: " in _error(f"{tmp_path / 'dict'}@test")
    assert "single Dataset with no splits. Fix: drop '@train'" in _error(f"{tmp_path / 'one'}@train")
    assert "neither a `Dataset` directory" in _error(str(tmp_path))


def test_arrow_and_csv_files(tmp_path, write_jsonl):
    pyarrow.feather.write_feather(_table(MIXED), tmp_path / "mixed.arrow")  # Arrow IPC file format
    _same_as_jsonl(str(tmp_path / "mixed.arrow"), MIXED, write_jsonl)
    flat = [*ROWS["alpaca"], {"instruction": "Pad.", "output": "007"}, *ROWS["prompt_completion"], *ROWS["text"]]
    pd.DataFrame(flat).to_csv(tmp_path / "flat.csv", index=False)
    examples = _same_as_jsonl(str(tmp_path / "flat.csv"), flat, write_jsonl)
    assert examples[2]["answer"] == "007"  # read as text, not the integer 7


def test_bad_row_names_source_and_index(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(_table([{"instruction": "i", "output": "o"}, {"instruction": "no output"}]), path)
    assert _error(str(path), "eval_data").startswith(f"eval_data: {path}[1]: missing field 'output'. Fix: ")


def _error(source, key="data"):
    with pytest.raises(UserError) as info:
        load_examples(source, key)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_missing_files_name_every_source():
    for name in ("missing.parquet", "missing.jsonl"):
        msg = _error(name)
        assert msg.startswith(f"data: file '{name}' not found. Fix: ") and "hf:NAME[:CONFIG][@SPLIT]" in msg


@pytest.mark.parametrize("ref", ["hf:", "hf:@train", "hf::config"])
def test_an_hf_reference_without_a_name(ref):
    assert _error(ref) == (f"data: {ref!r} names no dataset. Fix: hf:NAME[:CONFIG][@SPLIT], e.g. hf:tatsu-lab/alpaca, "
                           "or hf:DIR for a local directory of data files.")


def test_hf_columns_of_no_format(tmp_path, capsys):
    root = tmp_path / "qa"
    root.mkdir()
    pq.write_table(_table([{"question": "q", "answer": "a"}]), root / "train.parquet")
    msg = _error(f"hf:{root}")
    assert msg.startswith(f"data: 'hf:{root}' has columns ['question', 'answer'], none of which any format reads. ")
    for columns in ("{instruction, input?, output, system?}", "{conversations: [{from, value}], system?, tools?}",
                    "{messages: [{role, content, tool_calls?}], tools?}", "{prompt, completion}", "{text}"):
        assert columns in msg
    assert cli.main(["train", "", *TINY, f"data=hf:{root}", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err  # datasets' progress bar, then the error on one line
    assert err.count("error") == 1 and err.splitlines()[-1].startswith("revffn train: error: data: 'hf:")
    assert "Fix: rename its columns" in err.splitlines()[-1]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("files,says", [
    ({"train.jsonl": '{"text": "a"}\n{"text": "b"}\n{"text": }\n'}, "/train.jsonl:3: invalid JSON (Expecting value)"),
    ({"train.json": '[{"text": "a"},\n {"text": }]'}, "/train.json:2: invalid JSON (Expecting value)"),
    ({"a.jsonl": '{"text": "a"}\n', "b.jsonl": '{"instruction": "i", "output": "o"}\n'},
     "its data files do not all have the same columns (datasets reads them as one table). Fix:"),
    # JSON Lines in a .json file, which datasets reads: the bad file is the other one
    ({"a.json": '{"text": "a"}\n{"text": "b"}\n', "b.jsonl": '{"text": "a"}\n{"text": }\n'},
     "/b.jsonl:2: invalid JSON (Expecting value)"),
    ({"a.json": '{"text": "a"}\n{"text": "b"}\n', "b.jsonl": '{"instruction": "i", "output": "o"}\n'},
     "its data files do not all have the same columns"),
    ({"a.jsonl": '{"text": "a"}\n', "_skip/b.jsonl": "not json", ".hidden.jsonl": "not json", "c.jsonl": "{"},
     "/c.jsonl:1: invalid JSON"),  # (datasets skips _ and hidden paths)
], ids=["jsonl", "json", "columns", "json_lines_in_json", "json_lines_columns", "skipped_paths"])
def test_hf_local_directory_of_json_that_does_not_parse(tmp_path, files, says):
    """It was "An error occurred while generating the dataset", with the fix for a misspelled hub name."""
    root = tmp_path / "mydata"
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_text(text)
    msg = _error(f"hf:{root}")
    assert msg.startswith("data: ") and says in msg and "check NAME, CONFIG and SPLIT" not in msg


def test_hf_local_directory_of_json_lines_in_a_json_file(tmp_path):
    """datasets reads JSON Lines in a .json file; an error that is not about parsing keeps its own reason."""
    root = tmp_path / "mydata"
    root.mkdir()
    (root / "a.json").write_text('{"text": "a"}\n{"text": "b"}\n')
    assert [e["text"] for e in load_examples(f"hf:{root}")] == ["a", "b"]
    msg = _error(f"hf:{root}@validation")
    assert 'Unknown split "validation"' in msg and "invalid JSON" not in msg


def test_hf_name_offline_and_not_cached(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    msg = _error("hf:revffn-tests/not-a-dataset@train", "eval_data")
    assert msg.startswith("eval_data: 'hf:revffn-tests/not-a-dataset@train' is neither a local directory nor in "
                          "the datasets cache, and downloading is off")
    assert "Fix: run once with network" in msg and "save_to_disk" in msg


def test_train_on_parquet(tmp_path, capsys):
    pq.write_table(_table([{"instruction": f"say {i}", "output": f"ok {i}"} for i in range(8)]),
                           tmp_path / "train.parquet")
    out = tmp_path / "run"
    assert cli.main(["train", "", *TINY, f"data={tmp_path / 'train.parquet'}", "max_steps=2",
                     f"output_dir={out}"]) == 0, capsys.readouterr().err
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert yaml.safe_load((out / "config.yaml").read_text())["data"] == str(tmp_path / "train.parquet")
