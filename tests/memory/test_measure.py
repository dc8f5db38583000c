"""`memory.measure`: the RSS peak the bench reports on CPU can be restarted once the model is built, as CUDA's is."""

import sys

import pytest
import torch

from revffn.memory.measure import current_rss_bytes, peak_rss_bytes, reset_rss_peak

MIB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs is Linux's")
def test_the_rss_peak_restarts_at_the_rss_now():
    big = torch.ones(256 * MIB // 4)  # 256 MiB, touched
    big.add_(1)
    high = peak_rss_bytes()
    del big
    assert reset_rss_peak()
    now = current_rss_bytes()
    assert peak_rss_bytes() >= now  # never below the RSS now
    assert peak_rss_bytes() < high - 128 * MIB  # the freed 256 MiB no longer count
    small = torch.ones(64 * MIB // 4)
    small.add_(1)
    assert peak_rss_bytes() >= now + 32 * MIB  # and what follows does
