"""The `revffn` command (`python -m revffn`, and the console script): `cli.main` after its imports."""

import sys


def console() -> int:
    """`cli.main`, after its imports (seconds: torch, transformers), which a Ctrl-C may cut short with one line
    instead of a traceback."""
    try:
        from revffn.cli import main
    except KeyboardInterrupt:
        print("revffn: interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    raise SystemExit(console())
