"""Bad arguments the subcommands refuse before any work (exit 2, nothing written), and a reader of stdout that
goes away (`| head`): no traceback."""

import subprocess
import sys

from revffn import cli


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


def test_a_closed_stdout_ends_without_a_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "revffn", "estimate", "--model", "qwen1.5-moe-a2.7b", "--method",
                             "revffn", "--gpu-mem", "80GB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `| head` does once it has its lines: every write then fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err
