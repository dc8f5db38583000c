"""Regenerate the builtin task datasets in revffn/assets/data/ (deterministic; no network)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tasks import write_builtin

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "revffn" / "assets" / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output directory (default: %(default)s)")
    args = parser.parse_args()
    for path in write_builtin(args.out):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
