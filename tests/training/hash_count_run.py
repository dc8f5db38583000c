"""`revffn train` under torchrun that records every file it hashes (run by tests/training/test_distributed.py):

    torchrun --nproc-per-node 2 tests/training/hash_count_run.py key=value ...

Each rank appends the path of each file `training.manifest.sha256_file` reads to $HASH_OUT.RANK, one a line.
"""

from __future__ import annotations

import os
import sys

from revffn.cli import main
from revffn.training import manifest

_hash = manifest.sha256_file


def _counted(path):
    with open(f"{os.environ['HASH_OUT']}.{os.environ['RANK']}", "a") as f:
        f.write(f"{path}\n")
    return _hash(path)


manifest.sha256_file = _counted

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
