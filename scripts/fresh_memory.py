"""What a sharded rank's read costs on this host: `os.preadv` of a cached checkpoint's bytes into fresh host
memory, as `revffn.models.sharded` reads a rank's shards, with and without the transparent-huge-page advice
(`models.sharded.huge_pages`), each in a fresh process, a few reads a process; and the speed of writing memory
the process touches for the first time.

    python scripts/fresh_memory.py --mib 750 --repeat 3 --touch-gib 4

On a host whose hypervisor backs guest memory on first touch, the first read into huge pages pays for that
(docs/multi_gpu.md, stop 66). The file defaults to `builtin:smollm2-moe`'s (built once into revffn's cache).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

READ = """
import json, os, sys, time, torch
from revffn.models.sharded import huge_pages
path, nbytes, repeat, advise = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
fd, times = os.open(path, os.O_RDONLY), []
for _ in range(repeat):
    t = torch.empty(nbytes, dtype=torch.uint8)
    if advise:
        huge_pages(t)
    view, done, t0 = memoryview(t.numpy()), 0, time.perf_counter()
    while done < nbytes:
        done += os.preadv(fd, [view[done:done + 2**26]], done)
    times.append(time.perf_counter() - t0)
    del t, view
print(json.dumps(times))
"""

TOUCH = """
import json, sys, time, torch
t0 = time.perf_counter()
torch.empty(int(sys.argv[1]), dtype=torch.uint8).fill_(1)
print(json.dumps(time.perf_counter() - t0))
"""


def run(code: str, *args) -> object:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # as `revffn bench` runs its CPU workers
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", help="a file at least --mib long (default: builtin:smollm2-moe's safetensors)")
    ap.add_argument("--mib", type=int, default=750, help="bytes read a process (a rank's share of smollm2-moe)")
    ap.add_argument("--repeat", type=int, default=3, help="reads a process")
    ap.add_argument("--processes", type=int, default=3, help="fresh processes for each setting, in turn")
    ap.add_argument("--touch-gib", type=float, default=0, help="also time writing this much fresh memory, twice")
    args = ap.parse_args(argv)
    if args.file is None:
        from revffn.models.loading import resolve_model_ref

        args.file = os.path.join(resolve_model_ref("builtin:smollm2-moe", "--file"), "model.safetensors")
    nbytes = args.mib * 2**20
    if os.path.getsize(args.file) < nbytes:
        ap.error(f"--file {args.file} holds fewer than --mib {args.mib} MiB")
    run("import sys; open(sys.argv[1], 'rb').read(); print(0)", args.file)  # into the page cache
    rows = {"huge pages advised": [], "not advised": []}
    for _ in range(args.processes):
        for label, advise in (("huge pages advised", 1), ("not advised", 0)):
            rows[label].append(run(READ, args.file, nbytes, args.repeat, advise))
    for label, runs in rows.items():
        print(f"{label}: " + "; ".join(", ".join(f"{t:.3f}" for t in times) + " s" for times in runs)
              + f"  ({args.mib} MiB a read, {args.repeat} reads a process)")
    if args.touch_gib:
        n = int(args.touch_gib * 2**30)
        print(f"writing {args.touch_gib:g} GiB of fresh memory: "
              + ", ".join(f"{run(TOUCH, n):.2f}" for _ in range(2)) + " s (two processes, one after the other)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
