"""Bad arguments the subcommands refuse before any work (exit 2, nothing written), and a reader of stdout that
goes away (`| head`), a full disk under it or a Ctrl-C while the command imports: one line, no traceback."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from revffn import cli
from revffn.models.model_config import grouped_mm_runs


def test_a_prompt_that_is_not_utf8_exits_2_before_loading(capsys):
    # bytes that are not UTF-8 reach Python's argv as surrogates; the tokenizer raised a TypeError on them
    assert cli.main(["generate", "builtin:base", "--prompt", "ok", "--prompt", "\udcff\udcfe bad"]) == 2
    err = capsys.readouterr().err
    assert "--prompt 2: not UTF-8 text (a byte at character 0). Fix:" in err and "Traceback" not in err


def test_bench_out_that_is_a_file_exits_2_before_running(tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    assert cli.main(["bench", "--model", "tiny-qwen2-moe", "--methods", "full", "--out", str(out)]) == 2
    assert f"--out {out}: is a file. Fix:" in capsys.readouterr().err and out.read_text() == "mine"


def test_study_out_that_is_a_file_exits_2_before_running(tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    assert cli.main(["study", "--out", str(out), "--quick"]) == 2  # (it was a FileExistsError from mkdir)
    assert f"--out {out}: is a file. Fix:" in capsys.readouterr().err and out.read_text() == "mine"
    assert cli.main(["bench", "--model", "tiny-qwen2-moe", "--methods", "full", "--out", str(out / "sub")]) == 2
    assert f"cannot be a directory: {out} is a file. Fix:" in capsys.readouterr().err


def test_a_closed_stdout_ends_without_a_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "revffn", "estimate", "--model", "qwen1.5-moe-a2.7b", "--method",
                             "revffn", "--gpu-mem", "80GB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `| head` does once it has its lines: every write then fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_full_disk_under_stdout_is_one_line():
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "revffn", "estimate", "--model", "tiny-qwen2-moe"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 1 and "a write failed: no space left on the device" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Fix:" in proc.stderr


def test_ctrl_c_while_the_command_imports_is_one_line():
    """`import revffn` loads neither torch nor transformers; the command's imports (over a second) answer a Ctrl-C."""
    cheap = subprocess.run([sys.executable, "-c", "import sys, revffn; print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert cheap.stdout.strip() == "False", cheap.stderr
    proc = subprocess.Popen([sys.executable, "-m", "revffn", "estimate", "--model", "tiny-qwen2-moe"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.monotonic() + 60
    while "libtorch" not in maps.read_text() and time.monotonic() < deadline:  # (inside `console`: importing torch)
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    # 130, or Python's own exit by SIGINT (-2: it re-raises an interrupt that reached its top level, 1 in ~40 runs)
    assert proc.returncode in (130, -signal.SIGINT) and "interrupted" in err and "Traceback" not in err, err


def test_check_refuses_a_width_the_model_cannot_run_and_a_converted_model(tmp_path, capsys):
    """Both were tracebacks (torch's grouped_mm on hidden 33; `.model` of a RevFFNForCausalLM)."""
    assert cli.main(["check", "--model", "tiny-qwen2-moe", "--layers", "1", "--hidden", "36", "--device", "cpu"]) == 2
    assert "--hidden 36: the attention heads would be 9 wide" in capsys.readouterr().err
    out = tmp_path / "rev"
    assert cli.main(["convert", "tiny-qwen2-moe", "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["check", "--model", str(out), "--device", "cpu"]) == 2
    assert "is converted to RevFFN already" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["estimate", "--model", "tiny-qwen2-moe", "--method", "revffn", "--hidden", "33"],
     "--hidden 33: hidden_size=33 is not a multiple of num_attention_heads=4."),
    (["estimate", "--model", "qwen1.5-moe-a2.7b", "--method", "revffn", "--hidden", "2050"],
     "(Here: e.g. --hidden 2080.)"),  # 2064 / 16 heads: 129-wide heads, odd
    (["bench", "--model", "tiny-qwen2-moe", "--methods", "full", "--hidden", "36"],
     "--hidden 36: the attention heads would be 9 wide"),
    (["bench", "--model", "tiny-qwen2-moe", "--methods", "full", "--sweep", "hidden=32,33"],
     "--sweep hidden=33: hidden_size=33 is not a multiple of num_attention_heads=4. Fix:"),
], ids=["estimate", "estimate_suggests", "bench", "sweep"])
def test_a_width_train_would_refuse_is_refused_before_estimating_or_benching(tmp_path, capsys, argv, says):
    """estimate printed figures for a shape train refuses; bench ran every method into the same per-run error."""
    out = ["--out", str(tmp_path / "b")] if argv[0] == "bench" else []
    assert cli.main([*argv, *out]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "b").exists()


@pytest.mark.skipif(not grouped_mm_runs("cpu"), reason="no grouped_mm on this torch's CPU: transformers loops")
@pytest.mark.parametrize("argv,says", [
    (["estimate", "--model", "tiny-qwen3-moe", "--method", "revffn"], "multiple of 8 in bfloat16"),  # its default
    (["estimate", "--model", "tiny-qwen3-moe", "--method", "revffn", "--dtype", "float32"], "and 22 is not"),
    (["check", "--model", "tiny-qwen3-moe", "--layers", "1"], "multiple of 4 in float32"),
    (["bench", "--model", "tiny-qwen3-moe", "--methods", "full", "--dtype", "bfloat16"], "multiple of 8 in bfloat16"),
], ids=["estimate", "estimate_fp32", "check", "bench"])
def test_a_width_grouped_mm_cannot_take_is_refused_in_the_commands_dtype(tmp_path, capsys, argv, says):
    """tiny-qwen3-moe's expert width is half its hidden_size: at 44, 22 (88 bytes in fp32), and 44 in bf16."""
    out = ["--out", str(tmp_path / "b")] if argv[0] == "bench" else []
    assert cli.main([*argv, "--hidden", "44", *out]) == 2
    err = capsys.readouterr().err
    assert "--hidden 44: the experts' weight model.layers.0.mlp.experts." in err and says in err
    assert "(Here: e.g. --hidden 48.)" in err and not (tmp_path / "b").exists()


def test_a_model_directory_without_safetensors_and_outputs_that_are_directories(tmp_path, capsys):
    """Each was a traceback: from_pretrained's OSError, and write_text on a directory (archs --out, study --docs)."""
    from revffn.models.loading import check_model_ref
    from revffn.models.presets import tiny_model

    dense = tmp_path / "dense"
    tiny_model("tiny-qwen2-moe", num_hidden_layers=1).save_pretrained(dense)
    for f in dense.glob("*.safetensors"):
        f.unlink()
    assert cli.main(["validate", f"model={dense}", "data=builtin:reversal_train", f"output_dir={tmp_path / 'r'}"]) == 2
    assert f"model: {str(dense)!r} holds no weights (*.safetensors, or pytorch_model*.bin)" in capsys.readouterr().err
    (dense / "pytorch_model.bin").write_bytes(b"")  # PyTorch's weights: from_pretrained reads them
    check_model_ref(str(dense))
    gguf = tmp_path / "gguf"  # a directory holding one GGUF file (and no config.json): a model, read from the GGUF
    gguf.mkdir()
    (gguf / "model.gguf").write_bytes(b"GGUF")
    check_model_ref(str(gguf))  # (names no file it reads yet)
    taken = tmp_path / "taken"
    taken.mkdir()
    assert cli.main(["archs", "--types", "qwen2_moe", "--out", str(taken)]) == 2
    assert f"--out {taken}: is a directory. Fix:" in capsys.readouterr().err
    assert cli.main(["study", "--out", str(tmp_path / "s"), "--quick", "--docs", str(taken)]) == 2
    assert f"--docs {taken}: is a directory. Fix:" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_a_file_size_limit_hit_inside_safetensors_is_one_line(tmp_path):
    """safetensors reports it as its own error (not an OSError): it was a traceback."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (300 * 1024, 300 * 1024))

    proc = subprocess.run([sys.executable, "-m", "revffn", "convert", "tiny-qwen2-moe", "--out", str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert proc.returncode == 1 and "a write failed: file too large for the file-size limit" in proc.stderr, \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "c").exists()


@pytest.mark.parametrize("argv,says", [
    (["eval", "m", "--data", "d", "--limit", "abc"], "argument --limit: must be 0 or more, got 'abc'"),
    (["convert", "m", "--out", "o", "--buffer-bits", "abc"], "argument --buffer-bits: must be a positive integer"),
    (["generate", "m"], "the following arguments are required: --prompt"),
    (["estimate", "--model", "m", "--batch", "0"], "argument --batch: must be a positive integer, got 0"),
    (["eval", "m", "--data", "d", "--match", "fuzzy"], "argument --match: invalid choice: 'fuzzy'"),
])
def test_a_flag_the_parser_refuses_is_one_line_with_its_fix(capsys, argv, says):
    """argparse's own errors: the usage block and no fix before; an internal name for a non-number (`_positive`)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith(f"revffn {argv[0]}: error: {says}") and f"Fix: `revffn {argv[0]} --help`" in err, err


def test_max_new_tokens_past_the_models_positions_exits_2_before_decoding(capsys):
    # 100000 new tokens on a 1024-position model ran for more than 300 s at positions it was never trained on
    assert cli.main(["generate", "builtin:base", "--prompt", "say ok", "--max-new-tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 100000: the longest prompt is" in err and "1024 positions" in err
    room = int(err.split("so at most ")[1].split()[0])
    assert 0 < room < 1024 and f"Fix: give --max-new-tokens {room} or less." in err
    assert "Loading weights" not in err  # checked from the config, before the weights are read


def test_eval_max_new_tokens_that_leaves_no_position_for_a_prompt(tmp_path, capsys):
    """Over a data set, one long prompt does not refuse the rest (its generation ends at the positions): only a value
    no prompt fits beside is refused."""
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"instruction": "say ok", "output": "ok"}) + "\n")
    assert cli.main(["eval", "builtin:base", "--data", str(data), "--max-new-tokens", "1024"]) == 2
    assert ("--max-new-tokens 1024: the model has 1024 positions (max_position_embeddings, times any RoPE scaling "
            "factor), prompt included. Fix: --max-new-tokens 1023 or less (e.g. 48).") in capsys.readouterr().err


def test_the_context_check_admits_exactly_what_fits():
    from revffn.errors import UserError
    from revffn.models.generation import check_context

    check_context(1024, [24, 1000], 24, "--max-new-tokens")  # 1000 + 24 = 1024 positions: fits
    check_context(None, [5000], 10**6, "--max-new-tokens")  # a model with no max_position_embeddings: no check
    with pytest.raises(UserError, match="at most 23 new tokens fit. Fix: give --max-new-tokens 23 or less"):
        check_context(1024, [1001], 24, "--max-new-tokens")
    with pytest.raises(UserError, match="at most 0 new tokens fit. Fix: shorten that prompt"):
        check_context(1024, [1024], 1, "--max-new-tokens")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path, capsys):
    """eval, generate and convert ended in "IndexError: index out of range in self" from the embedding; train too."""
    from transformers import AutoModelForCausalLM

    from revffn.data.tokenizer import load_tokenizer
    from revffn.models.loading import hf_config

    model = tmp_path / "small-vocab"
    AutoModelForCausalLM.from_config(hf_config("tiny-mixtral", vocab_size=512, num_hidden_layers=1)).save_pretrained(
        model)
    load_tokenizer(None).save_pretrained(model)  # the shipped tokenizer: 2048 tokens
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "say ok", "output": "ok"}) + "\n")
    says = "its tokenizer has 2048 tokens but the model's config.json has vocab_size 512: the ids from 512 on have no"
    for argv, key in ((["eval", str(model), "--data", str(data)], "MODEL_DIR"),
                      (["generate", str(model), "--prompt", "hi"], "MODEL_DIR"),
                      (["convert", str(model), "--out", str(tmp_path / "out")], "MODEL"),
                      (["validate", "", f"model={model}", f"data={data}", "method=full",
                        f"output_dir={tmp_path / 'run'}"], "model")):
        assert cli.main(argv) == 2
        assert f"error: {key}: {says}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()
