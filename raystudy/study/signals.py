"""SIGTERM in a study's driver: a clean stop (Ray shut down, the study lock released), not Ray's abort."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from raystudy.study.progress import Echo
from raystudy.study.progress import echo as _echo


class Terminated(SystemExit):
    """Raised in the driver's main thread by SIGTERM, so that ``finally`` blocks run: Ray is shut down and
    the study lock released."""


@contextmanager
def sigterm_exits(echo: Echo = _echo, prefix: str = "study") -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` (exit status 143) in the main thread.

    Ray's own handler (installed by ``ray.init``) kills the local Ray processes from inside the signal
    handler and exits; the driver then aborts half-way, without releasing what it holds.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        echo(f"[{prefix}] SIGTERM: stopping (run the same command again to resume)")
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
