"""The README's generated tables: the commands from argparse, the config keys from `SCHEMA`, the method options
from each method's `SCHEMA`. Each sits between its markers (`<!-- NAME:start -->` ... `<!-- NAME:end -->`).

    python scripts/readme_tables.py           # rewrite them in README.md
    python scripts/readme_tables.py --check   # exit 1 when README.md is not current

tests/scripts/test_readme_tables.py checks that README.md holds exactly this output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(key) -> str:
    if key.required:
        return "**required**"
    value = key.default
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else "{}" if value == {} \
        else f"{value:g}" if isinstance(value, float) else str(value)
    return f"`{shown}`"


def commands() -> str:
    """One row per subcommand: its help and its flags, read from argparse itself."""
    from revffn.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    lines = ["| command | what it does | flags |", "|---|---|---|"]
    for name, parser in sub.choices.items():
        positional = " ".join((f"[{a.dest.upper()} ...]" if a.nargs == "*" else f"[{a.dest.upper()}]"
                               if a.nargs == "?" else (a.metavar or a.dest).upper())
                              for a in parser._actions if not a.option_strings)
        flags = " ".join(f"`{a.option_strings[-1]}`" for a in parser._actions if a.option_strings and a.dest != "help")
        lines.append(f"| `revffn {name}{' ' + positional if positional else ''}` | {_cell(helps.get(name, ''))} "
                     f"| {flags} |")
    return "\n".join(lines) + "\n"


def config_keys() -> str:
    """One row per top-level config key."""
    from revffn.training.config import SCHEMA

    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | {_default(key)} | {_cell(key.help)} |" for name, key in SCHEMA.items()]
    return "\n".join(lines) + "\n"


def method_options() -> str:
    """One row per method option, `METHOD.KEY`, in registry order."""
    from revffn.methods import METHODS

    lines = ["| option | default | meaning |", "|---|---|---|"]
    lines += [f"| `{method}.{name}` | {_default(key)} | {_cell(key.help)} |"
              for method, cls in METHODS.items() for name, key in cls.SCHEMA.items()]
    return "\n".join(lines) + "\n"


TABLES = {"commands": commands, "config-keys": config_keys, "method-options": method_options}


def render(text: str) -> str:
    """`text` with every marked table replaced by its current rendering."""
    for name, make in TABLES.items():
        start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
        if start not in text or end not in text:
            raise SystemExit(f"README.md has no {start.strip()} ... {end} markers")
        head, rest = text.split(start, 1)
        text = head + start + make() + end + rest.split(end, 1)[1]
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when README.md is not current; write nothing")
    args = p.parse_args()
    current = README.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("README.md: the generated tables are stale. Fix: python scripts/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
