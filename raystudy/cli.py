"""The ``raystudy`` command line.

Every module in :mod:`raystudy.commands` adds its sub-command(s) through ``register(subparsers)`` and sets
``func`` on its parser; heavy imports (torch, Ray) happen inside the command functions, so ``--help`` is
instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

import raystudy.commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raystudy",
        description="Ray-distributed studies of how transformer components adapt during finetuning.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(raystudy.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"raystudy.commands.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError) as e:
        # Bad input: one clear line naming the file, row or parameter, no traceback.
        if args.verbose:
            raise
        print(f"raystudy {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
