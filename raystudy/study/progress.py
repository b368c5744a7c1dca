"""What a running study prints: one line per finished trial and a periodic summary with an ETA.

::

    [demo] ok shift-color-MHA-sgd-lr0.03-s0: test acc 0.412 (41s) | 3/12 done, ETA 4m10s
    [demo] 3/12 done, 2 running, 0 failed, 7 pending (this launch: 3 ok, 0 diverged) | elapsed 2m05s, ETA 4m10s

The ETA (:func:`eta_seconds`) rests on the time between the finishes of each slot's trials: the first trial
of each slot also carries the launch's start-up (Tune's actors starting, the model and the data loaded),
which on the demo took longer than a dozen later trials, so no ETA is printed (``ETA ?``) until more trials
have finished than run at a time. :class:`Progress` reads time from an injectable ``clock``
(``time.monotonic`` by default), so its ETA can be tested without sleeping and does not jump when the wall
clock is adjusted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
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


def eta_seconds(finished: Sequence[float], now: float, remaining: int, slots: int) -> float:
    """Seconds until ``remaining`` more trials have finished, from the clock readings ``finished`` (ascending)
    at which this launch's trials finished, ``now``, and ``slots``, the trials that run at a time (``s``).

    A slot's trials follow each other, so finish ``k + s`` comes one trial's time ``T`` after finish ``k``;
    averaged over the ``n - s`` such pairs (a telescoping sum)::

        T = (sum of the last s finish times - sum of the first s) / (n - s),   ETA = remaining x T / s

    which leaves out the launch's start-up, which only the first trial of each slot waited for. Before that
    (``n <= s``) the estimate would rest on the start-up alone: NaN (unknown). A stall counts: the trial that
    followed the oldest of the last ``s`` finishes has taken at least ``now`` minus that finish, and ``T`` is
    never less. ``0.0`` when nothing remains."""
    if remaining <= 0:
        return 0.0
    n, s = len(finished), max(int(slots), 1)
    if n <= s:
        return math.nan
    per_trial = (sum(finished[n - s:]) - sum(finished[:s])) / (n - s)
    per_trial = max(per_trial, now - finished[n - s])
    return remaining * per_trial / s


@dataclass
class Progress:
    """Counts of the study's trials and an ETA from this launch's throughput (:func:`eta_seconds`).

    ``total`` trials in the study, ``done_before`` of them final before this launch. ``every``: seconds
    between two periodic summaries (:meth:`tick`). ``finished_at``: the clock at each finish of this launch;
    ``slots``: the most trials seen running at once (:meth:`trial_started`).
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
    finished_at: list = field(default_factory=list)
    slots: int = 0

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
        """Seconds left for this launch's trials not yet finished (:func:`eta_seconds`); NaN while unknown."""
        remaining = self.total - self.done_before - self.finished_now
        return eta_seconds(self.finished_at, self.clock(), remaining, self.slots)

    def trial_started(self, trial_id: str) -> None:
        """Count a trial as running (and the most running at once: :attr:`slots`)."""
        self.running.add(trial_id)
        self.slots = max(self.slots, len(self.running))

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
        self.finished_at.append(self.clock())
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
