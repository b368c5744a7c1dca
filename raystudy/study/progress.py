"""What a running study prints: one line per finished trial and a periodic summary with an ETA.

::

    [demo] ok shift-color-MHA-sgd-lr0.03-s0: test acc 0.412 (41s) | 3/12 done, ETA 4m10s
    [demo] 3/12 done, 2 running, 0 failed, 7 pending (this launch: 3 ok, 0 diverged) | elapsed 2m05s, ETA 4m10s

:class:`Progress` reads time from an injectable ``clock`` (``time.monotonic`` by default), so its ETA can
be tested without sleeping and does not jump when the wall clock is adjusted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Where a study's lines go: :func:`echo` by default, a list's ``append`` in tests.
Echo = Callable[[str], object]


def echo(msg: str) -> None:
    """The study's terminal output: one flushed line."""
    print(msg, flush=True)


def fmt_seconds(s: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``; ``?`` when unknown."""
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


@dataclass
class Progress:
    """Counts of the study's trials and an ETA from this launch's throughput (finished trials per second).

    ``total`` trials in the study, ``done_before`` of them final before this launch. ``every``: seconds
    between two periodic summaries (:meth:`tick`).
    """

    total: int
    done_before: int
    echo: Callable[[str], Any] = echo
    prefix: str = "study"
    clock: Callable[[], float] = time.monotonic
    every: float = 60.0
    running: set = field(default_factory=set)
    counts: dict = field(default_factory=lambda: {"ok": 0, "diverged": 0, "failed": 0})
    t0: float | None = None
    last_shown: float | None = None
    device_warned: bool = False  # a trial that asked for GPUs ran on the CPU: said once per launch

    def __post_init__(self) -> None:
        if self.t0 is None:
            self.t0 = self.clock()
        if self.last_shown is None:
            self.last_shown = self.t0

    @property
    def finished_now(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> int:
        return self.done_before + self.counts["ok"] + self.counts["diverged"]

    def eta(self) -> float:
        """Seconds left: (time per finished trial of this launch) x (trials left); NaN before the first."""
        n = self.finished_now
        remaining = self.total - self.done_before - n
        if n == 0 or remaining <= 0:
            return math.nan if remaining > 0 else 0.0
        return (self.clock() - self.t0) / n * remaining

    def line(self, event: str = "") -> str:
        c = self.counts
        pending = self.total - self.done - c["failed"] - len(self.running)
        return (
            f"[{self.prefix}] {self.done}/{self.total} done, {len(self.running)} running, {c['failed']} failed, "
            f"{max(pending, 0)} pending (this launch: {c['ok']} ok, {c['diverged']} diverged)"
            f" | elapsed {fmt_seconds(self.clock() - self.t0)}, ETA {fmt_seconds(self.eta())}"
            + (f" | {event}" if event else "")
        )

    def show(self, event: str = "") -> None:
        """Print the summary line now."""
        self.last_shown = self.clock()
        self.echo(self.line(event))

    def tick(self) -> bool:
        """Print the summary line if ``every`` seconds passed since the last one; ``True`` if printed."""
        if self.clock() - self.last_shown < self.every:
            return False
        self.show()
        return True

    def trial_finished(self, trial_id: str, row: dict) -> None:
        """Count a finished trial (its ``trials.parquet`` row) and print its one line."""
        self.running.discard(trial_id)
        status = row["status"]
        self.counts[status] += 1
        acc = row.get("test_acc")
        acc = f"test acc {acc:.3f}" if isinstance(acc, float) and math.isfinite(acc) else "no test acc"
        wall = row.get("wall_seconds")
        took = f" ({fmt_seconds(wall)})" if isinstance(wall, float) else ""
        detail = f": {row['error']}" if status == "failed" and row.get("error") else ""
        skipped = row.get("checkpoints_skipped")
        if isinstance(skipped, int) and skipped > 0:
            first = row.get("checkpoint_warning")
            detail += (f" ({skipped} unusable checkpoint(s) moved aside{f', the first: {first}' if first else ''}; "
                       f"checkpoint_warnings in trials/{trial_id}/summary.json)")
        self.echo(f"[{self.prefix}] {status} {trial_id}: {acc}{took}{detail} | {self.done}/{self.total} done, "
                  f"ETA {fmt_seconds(self.eta())}")
        warning = row.get("device_warning")
        if isinstance(warning, str) and warning and not self.device_warned:
            self.device_warned = True
            self.echo(f"[{self.prefix}] note: {trial_id}: {warning} (every trial it happened to: device_warning "
                      "in trials.parquet; this note is not repeated)")
