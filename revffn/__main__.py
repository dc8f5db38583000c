"""The `revffn` command (`python -m revffn`, and the console script): `cli.main` after its imports."""

import signal
import sys


def console() -> int:
    """`cli.main`, after its imports (seconds: torch, transformers). A Ctrl-C while they run is noted, not raised
    (raised inside an import it may surface as another error, or be swallowed by the import machinery), and the
    command then ends with one line, exit 130, as `cli.main` does for one that comes later."""
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    try:
        from revffn.cli import main
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        print("revffn: interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    raise SystemExit(console())
