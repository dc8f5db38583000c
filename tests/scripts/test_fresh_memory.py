"""scripts/fresh_memory.py: every read it times is a whole read of the bytes asked for, in each setting."""

import re

import fresh_memory
import pytest


@pytest.mark.integration
def test_it_times_each_read_in_fresh_processes_with_and_without_the_advice(tmp_path, capsys):
    data = tmp_path / "weights.bin"
    data.write_bytes(bytes(range(256)) * 4096 * 3)  # 3 MiB
    assert fresh_memory.main(["--file", str(data), "--mib", "2", "--repeat", "2", "--processes", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("huge pages advised", "not advised"):
        line = next(x for x in out.splitlines() if x.startswith(label + ":"))
        assert len(re.findall(r"\d+\.\d{3}", line.split("(")[0])) == 2, line  # 2 reads in 1 process
    with pytest.raises(SystemExit):  # a file shorter than the reads
        fresh_memory.main(["--file", str(data), "--mib", "4"])
