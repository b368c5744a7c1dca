"""Progress for a terminal and for a log file: a tqdm bar where both stdout and the bar's stream are
terminals, else plain lines (one per :data:`PLAIN_STEP` of the total, and the last), never a carriage return.

``raystudy study ... > study.log 2>&1`` (or under ``nohup``, in CI, through a pipe) thus gets readable lines
instead of a bar redrawn with ``\\r`` hundreds of times.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any

#: a plain progress line every this fraction of the total (and at the end)
PLAIN_STEP = 0.1


def interactive(stream: IO | None = None) -> bool:
    """Whether stdout and ``stream`` (default: stderr, tqdm's stream) are both terminals."""
    streams = (sys.stdout, stream if stream is not None else sys.stderr)
    return all(s is not None and hasattr(s, "isatty") and s.isatty() for s in streams)


class PlainProgress:
    """tqdm's interface (``update``, ``close``, a context manager, iteration) writing one line per
    :data:`PLAIN_STEP` of ``total`` reached: ``desc: n/total unit (p%)``, ending in ``\\n`` only."""

    def __init__(self, iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, disable: bool | None = False, file: IO | None = None, **_ignored):
        self.iterable = iterable
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.desc, self.unit, self.n = desc, unit, int(initial)
        self.disable = True if disable is None else bool(disable)  # tqdm's None: off where no terminal
        self.file = file if file is not None else sys.stderr
        self._shown = self._tenths()  # a resumed bar starts quiet at its initial count

    def _tenths(self) -> int:
        """How many :data:`PLAIN_STEP` steps of the total ``n`` has passed (0 without a total)."""
        return int(self.n / self.total / PLAIN_STEP + 1e-9) if self.total else 0

    def _line(self) -> str:
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        total = f"/{self.total}" if self.total is not None else ""
        return f"{self.desc}: {self.n}{total} {self.unit}{pct}"

    def update(self, n: int = 1) -> None:
        self.n += int(n)
        tenths = self._tenths()
        if not self.disable and tenths > self._shown:
            self._shown = tenths
            print(self._line(), file=self.file, flush=True)

    def close(self) -> None:
        self.disable = True

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(iterable: Iterable | None = None, **kwargs: Any):
    """A progress bar with tqdm's arguments (``total``, ``desc``, ``unit``, ``initial``, ``disable``,
    ``leave``, ...): ``tqdm.auto.tqdm`` on a terminal (:func:`interactive`), else :class:`PlainProgress`."""
    if interactive(kwargs.get("file")):
        from tqdm.auto import tqdm  # the bar only where a terminal draws it

        return tqdm(iterable, **kwargs)
    return PlainProgress(iterable, **kwargs)
