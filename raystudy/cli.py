"""The ``raystudy`` command line (also ``python -m raystudy``).

Every module in :mod:`raystudy.commands` adds its sub-command(s) through ``register(subparsers)`` and sets
``func`` on its parser; heavy imports (torch, Ray) happen inside the command functions, so ``--help`` and
``--version`` are instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

import raystudy
import raystudy.commands
from raystudy.cpu_kernels import pin_cpu_kernels
from raystudy.distributed.cluster import quiet_ray_logs  # logging only, no Ray import


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the problem and where to read more), not the usage
    of every flag; its sub-command parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="raystudy",
        description="Ray-distributed studies of how transformer components adapt during finetuning.",
    )
    parser.add_argument("--version", action="version", version=f"raystudy {raystudy.__version__}")
    # Its own dest: a sub-command may define -v too, and a sub-parser's default would overwrite this one.
    parser.add_argument("-v", "--verbose", dest="global_verbose", action="store_true",
                        help="debug logging and Ray's own logs (default: Ray's logs at WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(raystudy.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"raystudy.commands.{info.name}")
        module.register(sub)
    return parser


def setup_logging(verbose: bool) -> None:
    """raystudy's own messages at INFO (DEBUG with ``-v``); Ray's loggers at WARNING unless ``-v``."""
    handler = logging.StreamHandler()
    handler.setFormatter(_LevelPrefix())
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    quiet_ray_logs(verbose)


class _LevelPrefix(logging.Formatter):
    """Progress messages (INFO) as plain lines; warnings and errors prefixed with their level."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if record.levelno == logging.INFO else f"{record.levelname} {message}"


def main(argv: list[str] | None = None) -> int:
    """The ``raystudy`` command line. Run from the shell (``argv`` None), it first pins the CPU kernels
    (:func:`raystudy.cpu_kernels.pin_cpu_kernels`: the same numbers on every x86-64 CPU); called from Python
    with ``argv``, it leaves the caller's environment alone."""
    if argv is None:
        pin_cpu_kernels()
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose = bool(getattr(args, "verbose", False) or args.global_verbose)
    setup_logging(args.verbose)
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
    except KeyboardInterrupt as e:
        return interrupted(f"raystudy {args.command}", e)


#: the exit status of a command stopped by Ctrl-C (128 + SIGINT), as a shell reports it
INTERRUPTED_STATUS = 130


def interrupted(prog: str, e: KeyboardInterrupt) -> int:
    """Ctrl-C: one line on stderr (what was stopped, how to resume: the interrupt's message, else that the
    command was interrupted) and exit status 130, never 0."""
    print(f"{prog}: {str(e) or 'interrupted (Ctrl-C)'}", file=sys.stderr)
    return INTERRUPTED_STATUS


if __name__ == "__main__":
    sys.exit(main())
