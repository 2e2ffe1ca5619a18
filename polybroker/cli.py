"""The ``polybroker`` command line: one subcommand per process kind."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from polybroker import __version__


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="polybroker", description=__doc__)
    parser.add_argument("--version", action="version", version=f"polybroker {__version__}")
    parser.add_subparsers(dest="command", required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
