"""A watchdog that ends a local Ray instance when the driver that started it is killed.

A driver that ends normally (or on SIGTERM, see :func:`raystudy.study.tune.sigterm_exits`) shuts its local
Ray down. One killed with SIGKILL cannot: its raylet and GCS server go with it, but Ray's dashboard agent
and runtime-env agent keep running for ever (their parent check reports the dead raylet to the dead GCS and
blocks there). :func:`start_reaper` starts a small process, in its own session so that a Ctrl-C of the
terminal does not end it first, that records the driver's descendants every ``period`` seconds and, once
the driver is gone, terminates those still running (then kills those that ignore SIGTERM).

Run as ``python -m raystudy.distributed.reaper <driver pid>``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

_started: dict[int, subprocess.Popen] = {}


def start_reaper(pid: int | None = None) -> subprocess.Popen:
    """Start the watchdog of process ``pid`` (default: this one), once per process; returns its handle."""
    pid = pid or os.getpid()
    if pid in _started and _started[pid].poll() is None:
        return _started[pid]
    _started[pid] = subprocess.Popen(
        [sys.executable, "-m", "raystudy.distributed.reaper", str(pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    return _started[pid]


def _descendants(driver) -> dict[int, float]:
    """``{pid: create_time}`` of every live descendant of ``driver`` (a ``psutil.Process``)."""
    import psutil

    out = {}
    for child in driver.children(recursive=True):
        try:
            out[child.pid] = child.create_time()
        except psutil.Error:
            pass
    return out


def _end(processes: dict[int, float], grace: float = 3.0) -> None:
    """SIGTERM every recorded process still running (same PID and start time), SIGKILL after ``grace``."""
    import psutil

    alive = []
    for pid, created in processes.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:
                p.terminate()
                alive.append(p)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(alive, timeout=grace)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass


def watch(pid: int, period: float = 1.0) -> None:
    """Record ``pid``'s descendants until it ends, then end them."""
    import psutil

    try:
        driver = psutil.Process(pid)
    except psutil.Error:
        return
    seen: dict[int, float] = {}
    while True:
        try:
            if driver.status() == psutil.STATUS_ZOMBIE:
                break
            seen.update(_descendants(driver))
        except psutil.Error:
            break
        time.sleep(period)
    seen.pop(os.getpid(), None)
    _end(seen)


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]))
