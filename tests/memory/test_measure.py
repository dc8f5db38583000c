"""`memory.measure`: the RSS peak the bench reports on CPU can be restarted once the model is built, as CUDA's is."""

import subprocess
import sys

import pytest
import torch

from revffn.memory.measure import peak_rss_bytes, reset_rss_peak

MIB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs is Linux's")
def test_the_rss_peak_restarts_at_the_rss_now():
    big = torch.ones(256 * MIB // 4)  # 256 MiB, touched (mmapped by malloc: returned to the kernel when freed)
    big.add_(1)
    high = peak_rss_bytes()
    del big
    assert reset_rss_peak()
    after = peak_rss_bytes()
    assert after < high - 128 * MIB  # the freed 256 MiB no longer count
    small = torch.ones(128 * MIB // 4)
    small.add_(1)
    assert peak_rss_bytes() > after + 64 * MIB  # and what follows does


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the inherited high-water mark is Linux's")
def test_a_child_does_not_report_the_peak_of_the_process_that_spawned_it():
    """getrusage's ru_maxrss in a child started by subprocess holds the parent's size at the start; the peak does
    not: a child of this process, grown by 512 MiB, reports its own few hundred MiB."""
    big = torch.ones(512 * MIB // 4)
    big.add_(1)
    parent = peak_rss_bytes()
    code = "from revffn.memory.measure import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    del big
    assert child < parent - 384 * MIB  # ru_maxrss read the parent's size here (Linux 6.x, Python 3.11)
