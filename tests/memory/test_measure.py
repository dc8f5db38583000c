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


def test_the_cgroup_room_is_the_tightest_limit_less_what_is_used_plus_the_reclaimable_cache(tmp_path):
    """psutil reads the host's memory: in a container (a 16 GiB pod on a 512 GiB node) `refuse_beyond_free` would
    let 500 GiB through. The room under the cgroup limits caps it (v2: this cgroup and its ancestors; v1)."""
    from revffn.memory.measure import cgroup_room

    def cgroup(d, limit, used, inactive, v2=True):
        d.mkdir(parents=True, exist_ok=True)
        (d / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(f"{limit}\n")
        (d / ("memory.current" if v2 else "memory.usage_in_bytes")).write_text(f"{used}\n")
        (d / "memory.stat").write_text(f"anon 1\n{'inactive_file' if v2 else 'total_inactive_file'} {inactive}\n")

    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    proc.write_text("0::/kubepods/pod1\n")
    cgroup(root / "kubepods" / "pod1", "max", 5 * 2**30, 0)  # no limit of its own
    cgroup(root / "kubepods", 16 * 2**30, 10 * 2**30, 2**30)  # the pod's parent: 16 GiB, 10 used, 1 reclaimable
    assert cgroup_room(str(proc), str(root)) == 7 * 2**30
    cgroup(root / "kubepods" / "pod1", 8 * 2**30, 5 * 2**30, 0)  # a tighter one below it
    assert cgroup_room(str(proc), str(root)) == 3 * 2**30
    proc.write_text("12:memory:/slurm/job7\n11:cpu,cpuacct:/slurm/job7\n")  # v1's memory controller
    cgroup(root / "memory" / "slurm" / "job7", 4 * 2**30, 3 * 2**30, 2**29, v2=False)
    cgroup(root / "memory" / "slurm", 2**63 - 4096, 0, 0, v2=False)  # "unlimited"
    assert cgroup_room(str(proc), str(root)) == 3 * 2**29
    proc.write_text("0::/\n")
    assert cgroup_room(str(proc), str(root)) is None  # the root cgroup: no memory.max
    assert cgroup_room(str(tmp_path / "none"), str(root)) is None
