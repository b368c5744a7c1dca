"""SIGTERM and Ctrl-C in a study's driver: a clean stop (Ray shut down, the study lock released), not Ray's
abort, and never an exit status that says the study succeeded."""

from __future__ import annotations

import logging
import shlex
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from raystudy.study.progress import Echo
from raystudy.study.progress import echo as _echo


class Terminated(SystemExit):
    """Raised in the driver's main thread by SIGTERM, so that ``finally`` blocks run: Ray is shut down and
    the study lock released."""


@contextmanager
def sigterm_exits(echo: Echo = _echo, prefix: str = "study", line: str | None = None) -> Iterator[None]:
    """While the block runs, SIGTERM prints ``line`` (default: ``[prefix] SIGTERM: stopping (run the same
    command again to resume)``) and raises :class:`Terminated` (exit status 143) in the main thread.

    Ray's own handler (installed by ``ray.init``) kills the local Ray processes from inside the signal
    handler and exits; the driver then aborts half-way, without releasing what it holds.
    """
    line = line or f"[{prefix}] SIGTERM: stopping (run the same command again to resume)"
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    received: list[int] = []

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        received.append(signum)
        echo(line)
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except BaseException:
        # raised inside a wait of Ray's core worker, Terminated comes out as Ray's own SystemExit(1)
        if received:
            raise Terminated(128 + received[0]) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def analysis_interrupted(study_dirs: Sequence[str], out: str | None = None) -> str:
    """What SIGTERM during the analysis of ``study_dirs`` (written to ``out``, if given) says: it was
    interrupted, the studies' results are kept, and the commands that redo it."""
    args = " ".join(shlex.quote(str(d)) for d in study_dirs) + (f" --out {shlex.quote(str(out))}" if out else "")
    return (f"SIGTERM: the analysis was interrupted; the study's results are kept; redo it with "
            f"`raystudy analyze {args}` (or `raystudy report {args}`)")


class Interrupted(KeyboardInterrupt):
    """Raised in the driver when Ctrl-C (SIGINT) stopped the study: a Tune launch (Tune ended its trials
    gracefully, their checkpoints are kept) or any other stage (:func:`ctrl_c_named`); the study stops there,
    without analysing its partial results, and the command line exits with status 130 printing the message."""


@dataclass
class Stage:
    """What the study's driver is doing now, in words (``the pretraining``): what the line of a Ctrl-C names."""

    now: str = "the start-up"


@contextmanager
def ctrl_c_named(prefix: str, stage: Stage, resume: Callable[[], str]) -> Iterator[None]:
    """A Ctrl-C (a bare ``KeyboardInterrupt``) in the block comes out as :class:`Interrupted` saying what it
    interrupted (``stage.now``), that what had finished is kept, and how to resume (``resume()``: how, in
    words); an :class:`Interrupted` (a Tune launch's, which says more) passes as it is."""
    try:
        yield
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise Interrupted(f"[{prefix}] interrupted (Ctrl-C) during {stage.now}: nothing that had finished is lost; "
                          f"{resume()}") from None


@contextmanager
def sigint_noticed() -> Iterator[Callable[[], bool]]:
    """While the block runs (a Tune launch), ``interrupted()`` (the yielded function) tells whether Ctrl-C
    stopped it.

    ``Tuner.fit`` installs its own SIGINT handler, which ends the experiment gracefully and then puts back
    the handler it found: the one installed here, which acts as Python's default (a second Ctrl-C raises
    KeyboardInterrupt at once). Found back in place after ``fit``, it shows that Tune was interrupted.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, previous)


#: the logger of Ray Tune's ``tune.run`` (what ``Tuner.fit`` runs), which says how Tune itself would resume
TUNE_RUN_LOGGER = "ray.tune.tune"
#: the starts of its lines about a Ctrl-C: the stop notice, the list of the trials it ended, and the advice to
#: resume with ``Tuner.restore(...)``, which restores one Tune launch but does not continue a study
TUNE_STOP, TUNE_UNFINISHED, TUNE_RESTORE = ("Stop signal received", "Trials did not complete",
                                            "Experiment has been interrupted")


class TuneInterruptLines(logging.Filter):
    """Ray Tune's lines about a Ctrl-C replaced by the study's: its stop notice by one line of ``echo`` (the
    trials are ended, their checkpoints kept), the list of trials it did not complete dropped after it, and its
    ``Tuner.restore(...)`` advice dropped (the study's own line says how to resume: :class:`Interrupted`)."""

    def __init__(self, echo: Echo, prefix: str):
        super().__init__()
        self.echo, self.prefix, self.stopping = echo, prefix, False

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        if message.startswith(TUNE_STOP):
            self.stopping = True
            self.echo(f"[{self.prefix}] Ctrl-C: ending the running trials (their checkpoints are kept; Ctrl-C "
                      "again stops at once)")
            return False
        return not (message.startswith(TUNE_RESTORE) or (self.stopping and message.startswith(TUNE_UNFINISHED)))


@contextmanager
def tune_interrupt_lines(echo: Echo = _echo, prefix: str = "study") -> Iterator[TuneInterruptLines]:
    """While the block runs (a Tune launch), Ray Tune's lines about a Ctrl-C are the study's
    (:class:`TuneInterruptLines`)."""
    logger = logging.getLogger(TUNE_RUN_LOGGER)
    lines = TuneInterruptLines(echo, prefix)
    logger.addFilter(lines)
    try:
        yield lines
    finally:
        logger.removeFilter(lines)
