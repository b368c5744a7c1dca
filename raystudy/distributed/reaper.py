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


#: a watchdog says this on its standard output once it has recorded the driver's processes a first time
READY = "ready"


def start_reaper(pid: int | None = None, timeout: float = 60.0) -> subprocess.Popen:
    """Start the watchdog of process ``pid`` (default: this one), once per process; returns its handle once
    the watchdog has recorded ``pid``'s processes (or after ``timeout`` seconds): a driver killed right
    after this call still has its Ray processes ended, also on a machine too loaded to start Python fast."""
    import select

    pid = pid or os.getpid()
    if pid in _started and _started[pid].poll() is None:
        return _started[pid]
    proc = subprocess.Popen(
        [sys.executable, "-m", "raystudy.distributed.reaper", str(pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        text=True,
    )
    if select.select([proc.stdout], [], [], timeout)[0]:
        proc.stdout.readline()
    proc.stdout.close()  # the watchdog writes nothing else
    _started[pid] = proc
    return proc


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


def watch(pid: int, period: float = 0.5) -> None:
    """Record ``pid``'s descendants until it ends, then end them; says :data:`READY` after the first record."""
    import psutil

    try:
        driver = psutil.Process(pid)
    except psutil.Error:
        return
    seen: dict[int, float] = {}
    ready = False
    while True:
        try:
            if driver.status() == psutil.STATUS_ZOMBIE:
                break
            seen.update(_descendants(driver))
        except psutil.Error:
            break
        if not ready:
            _say_ready()
            ready = True
        time.sleep(period)
    seen.pop(os.getpid(), None)
    _end(seen)


def _say_ready() -> None:
    try:
        print(READY, flush=True)
        sys.stdout.close()
    except OSError:  # the driver stopped listening
        pass


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]))
