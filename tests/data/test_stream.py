"""`streaming: true` (revffn/data/stream.py): the stream gives the items the in-memory path gives, each process
its own disjoint shard, and resumes at the exact example, packed or not; a run streams and resumes exactly;
a source that cannot stream exits 2 naming the key. Every dataset is built here, offline."""

import json
import shutil

import datasets
import pytest

from revffn.cli import main
from revffn.data.collate import tokenize_dataset
from revffn.data.formats import _resolve, load_examples
from revffn.data.stream import TokenStream
from revffn.data.tokenizer import model_tokenizer
from revffn.errors import UserError
from tests.methods._util import metrics
from tests.training.test_loop import TINY


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """load_dataset converts files into the datasets cache: keep it in the test's directory."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture(scope="module")
def tok():
    return model_tokenizer("tiny-qwen2-moe", None)


@pytest.fixture
def parquet(tmp_path):
    """builtin:reversal_train's 100 first rows as a parquet file, and those rows."""
    rows = [json.loads(line) for line in _resolve("builtin:reversal_train", "data")[0].read_text().splitlines()][:100]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(path)
    return str(path)


def stream(ref, tok, **kw):
    """Unshuffled unless asked: file order is the in-memory path's, the reference."""
    kw = {"max_seq_length": 24, "seed": 3, "shard": (0, 1), "shuffle_buffer": 0, **kw}
    return TokenStream(ref, tok, kw.pop("max_seq_length"), **kw)


@pytest.mark.parametrize("packing", [False, True])
def test_the_stream_gives_the_in_memory_items_in_file_order_without_shuffling(parquet, tok, packing):
    reference = tokenize_dataset(load_examples(parquet), tok, 24, packing).items
    n = len(reference) - 1 if packing else len(reference)  # packed: the in-memory set's last row is a partial one
    assert stream(parquet, tok, packing=packing).next_items(n) == reference[:n]


@pytest.mark.parametrize("packing,shuffle", [(False, 0), (True, 0), (True, 1000)])
def test_a_resumed_stream_continues_exactly(parquet, tok, packing, shuffle):
    whole = stream(parquet, tok, packing=packing, shuffle_buffer=shuffle).next_items(200)
    first, done = stream(parquet, tok, packing=packing, shuffle_buffer=shuffle), 0
    for taken in (1, 37, 100, 163) if not shuffle else (37, 163):  # in epoch 0, at its end, in epoch 1 (or 2)
        assert first.next_items(taken - done) == whole[done:taken]
        done = taken
        state = json.loads(json.dumps(first.state_dict()))  # as trainer_state.json keeps it
        resumed = stream(parquet, tok, packing=packing, shuffle_buffer=shuffle)
        resumed.load_state_dict(state)
        assert resumed.next_items(20) == whole[taken : taken + 20], taken
    restarted = stream(parquet, tok, packing=packing, shuffle_buffer=shuffle)  # negative control: the epoch's start
    restarted.load_state_dict({**state, "examples": 0})
    assert restarted.next_items(20) != whole[163:183]


def test_each_process_reads_its_own_shard(parquet, tok):
    epoch = sorted(map(str, stream(parquet, tok).next_items(100)))
    shards = [stream(parquet, tok, shard=(r, 2)).next_items(50) for r in range(2)]
    assert not set(map(str, shards[0])) & set(map(str, shards[1]))
    assert sorted(map(str, shards[0] + shards[1])) == epoch
    shuffled = [stream(parquet, tok, seed=seed, shuffle_buffer=1000).next_items(100) for seed in (3, 4)]
    assert shuffled[0] != shuffled[1] and sorted(map(str, shuffled[0])) == epoch  # the seed orders, the set stays


@pytest.mark.parametrize("ref,says", [("builtin:reversal_train", "a built-in set"), ("x.jsonl", "a JSON file"),
                                      ("hf:some/set@train[:100]", "slices its split")])
def test_a_source_that_cannot_stream_is_refused(tok, ref, says):
    with pytest.raises(UserError, match="streaming") as e:
        stream(ref, tok)
    assert says in str(e.value) and "Fix:" in str(e.value)


@pytest.mark.parametrize("shuffle_buffer", [0, 50])
@pytest.mark.parametrize("shard", [(0, 1), (0, 2), (1, 2)])
def test_a_bad_row_deep_in_the_stream_names_the_key_and_its_row_in_the_file(tmp_path, tok, shard, shuffle_buffer):
    """Named as the in-memory path names it (`bad.parquet[71]`), shuffled or not, whichever process reads it
    (one file over 2 processes: every other row; the row a process never reads is not its error)."""
    path = tmp_path / "bad.parquet"
    rows = [{"instruction": f"a{i}", "output": "b"} for i in range(100)]
    rows[71] = {"instruction": "c", "output": None}
    datasets.Dataset.from_list(rows).to_parquet(path)
    read = stream(str(path), tok, shuffle_buffer=shuffle_buffer, shard=shard)
    if 71 % shard[1] != shard[0]:
        assert len(read.next_items(60)) == 60  # its 50 rows, and on into the next epoch
        return
    with pytest.raises(UserError, match=r"^data: .*bad.parquet\[71\]: missing field 'output'"):
        read.next_items(100)
    with pytest.raises(UserError, match=r"^data: .*bad.parquet\[71\]"):  # the in-memory path's name for it
        load_examples(str(path), "data")


def test_a_bad_row_in_a_process_s_whole_files_is_named_by_its_place_in_them(tmp_path, tok):
    data = tmp_path / "data"
    data.mkdir()
    for k in range(2):
        rows = [{"instruction": f"a{i}", "output": "b"} for i in range(10)]
        if k == 1:
            rows[7] = {"instruction": "c", "output": None}
        datasets.Dataset.from_list(rows).to_parquet(data / f"part-{k}.parquet")
    with pytest.raises(UserError, match=r"\[row 7 of the files process 1 of 2 reads\]: missing field 'output'"):
        stream(f"hf:{data}", tok, shuffle_buffer=5, shard=(1, 2)).next_items(20)


@pytest.mark.parametrize("text,says", [("instruction,output\n\"a,b\n", "EOF inside string"),
                                       ("", "No columns to parse from file")])
def test_a_csv_found_unreadable_as_it_streams_is_one_error(tmp_path, tok, text, says):
    """An unclosed quote or an empty file shows only once the stream reads it (pandas raised from inside `datasets`)."""
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(UserError, match=f"data: cannot load '{path}': .*{says}.*Fix: give a valid .csv file"):
        stream(str(path), tok, shuffle_buffer=0).next_items(1)


def test_a_streamed_run_trains_and_resumes_at_the_exact_example(parquet, tmp_path):
    args = [*TINY, f"data={parquet}", "streaming=true", "packing=true", "max_steps=6", "save_steps=3"]
    assert main(["train", *args, f"output_dir={tmp_path / 'ref'}"]) == 0
    state = json.loads((tmp_path / "ref" / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["data_order"]["examples"] > 0 and state["data_order"]["carry_ids"]  # the stream's own position
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    assert main(["train", *args, f"output_dir={tmp_path / 'run'}", "resume=true"]) == 0
    ref, resumed = ({r["step"]: r["loss"] for r in metrics(tmp_path / d)} for d in ("ref", "run"))
    assert sorted(ref) == list(range(1, 7))
    for s in range(4, 7):  # the resumed steps: the same items, so the same losses
        assert abs(resumed[s] - ref[s]) <= 1e-6, (s, resumed[s], ref[s])


def test_a_bad_row_found_part_way_stops_the_run_and_keeps_it_resumable(parquet, tmp_path, capsys):
    rows = datasets.Dataset.from_parquet(parquet).to_list()[:16]  # 8 steps an epoch
    good = rows[13]["output"]
    rows[13]["output"] = None
    datasets.Dataset.from_list(rows).to_parquet(parquet)
    run = tmp_path / "run"
    args = [*TINY, f"data={parquet}", "streaming=true", "max_steps=8", "save_steps=2", f"output_dir={run}"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert f"{parquet}[13]: missing field 'output'" in err and "The run stopped at step" in err, err
    step = int(err.partition("The run stopped at step ")[2].partition(";")[0])
    assert 2 <= step < 8 and f"keeps step-{step - step % 2}: once that is fixed, resume=true" in err
    report = (run / "report.md").read_text()
    assert "status: **error**" in report and not (run / "final").exists()
    assert f"- data: streamed from {parquet}; read by this process: 0 whole epoch(s) and {2 * step} examples" in report
    rows[13]["output"] = good
    datasets.Dataset.from_list(rows).to_parquet(parquet)
    assert main(["train", *args, "resume=true"]) == 0
    assert max(r["step"] for r in metrics(run)) == 8 and (run / "final").is_dir()


def test_streaming_a_json_file_exits_2_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "streaming=true", f"output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "streaming" in err and "Fix:" in err and not run.exists()


def test_a_stream_with_nothing_to_train_on_says_so_instead_of_looping(parquet, tok):
    with pytest.raises(UserError, match="read no trainable example .* max_seq_length=4.*Fix:"):
        stream(parquet, tok, max_seq_length=4).next_items(1)  # every response lies past the prompt's 4 tokens
