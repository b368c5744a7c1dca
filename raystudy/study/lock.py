"""One driver per study directory: a lock file naming its holder.

Two drivers on one ``--out`` would both launch the whole grid and break each other's checkpoints.
:class:`StudyLock` is taken by :func:`raystudy.study.tune.run_study` before it touches the directory and
released when it ends (also on an exception or a SIGTERM, which the driver turns into an exception).

The lock is the file ``<out>/study.lock`` holding ``{"host", "pid", "started", "pid_start"}`` (JSON). On a
local path it is created with ``O_CREAT | O_EXCL``, so of two drivers starting together exactly one wins.
A lock whose holder is dead (same host, PID not running, or running but a different process: its start
time differs from ``pid_start``) is stale: it is taken over, and the takeover is announced. A lock held
from another host cannot be checked from here: it is refused like a live one, and the message says which
file to delete if that driver is known to be gone. On object stores (URIs) there is no atomic create:
the lock is written after a check, which still refuses a second driver started seconds later.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable

from raystudy.storage import exists, filesystem, is_uri, join, move_aside, read_text, write_json_atomic

LOCK_FILE = "study.lock"


class StudyLocked(ValueError):
    """The study directory is held by another driver (the message names it). A ``ValueError``, so every
    command reports it on one line."""


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc``), ``None`` where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def holder_alive(holder: dict) -> bool | None:
    """``True``/``False`` whether the lock's holder runs; ``None`` when it cannot be told (another host)."""
    if holder.get("host") != socket.gethostname():
        return None
    try:
        pid = int(holder["pid"])
        os.kill(pid, 0)
    except (KeyError, TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:  # a process of another user: it exists
        pass
    recorded = holder.get("pid_start")
    return recorded is None or recorded == _process_start(pid)  # a reused PID is another process


def describe(holder: dict) -> str:
    return (f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, "
            f"started {holder.get('started', '?')}")


class StudyLock:
    """The lock of one study directory; a context manager (``with StudyLock(out, echo=print): ...``)."""

    def __init__(self, study_dir: str, *, echo: Callable[[str], object] = print):
        self.study_dir = str(study_dir)
        self.path = join(self.study_dir, LOCK_FILE)
        self.echo = echo
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": uuid.uuid4().hex}
        self.held = False
        self.made_dir = False  # the directory did not exist: removed again on release if left empty

    def holder(self) -> dict | None:
        """The lock file's contents (``{}`` when unreadable: a lock being written), ``None`` if absent."""
        text = read_text(self.path)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return {}
        return data if isinstance(data, dict) else {}

    def _create(self) -> bool:
        """Create the lock file with our record; ``False`` if one exists."""
        if is_uri(self.path):
            if exists(self.path):
                return False
            write_json_atomic(self.path, self.me)
            return True
        if not os.path.isdir(self.study_dir):
            os.makedirs(self.study_dir, exist_ok=True)
            self.made_dir = True
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.me, f)
        except BaseException:  # e.g. a full disk: leave no empty lock behind
            os.remove(self.path)
            raise
        return True

    def _take_over(self, stale: dict) -> bool:
        """Move a stale lock aside (atomically: of two drivers doing this, one moves it) and create ours."""
        if is_uri(self.path):
            filesystem(self.path)[0].delete_file(filesystem(self.path)[1])
            return self._create()
        try:
            aside = move_aside(self.path, f"stale-{uuid.uuid4().hex}")
        except FileNotFoundError:
            return self._create()
        try:
            with open(aside, encoding="utf-8") as f:
                moved = json.load(f)
        except (OSError, json.JSONDecodeError):
            moved = {}
        if moved.get("token") != stale.get("token"):  # we moved a new driver's lock: put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            os.remove(aside)
            return False
        os.remove(aside)
        return self._create()

    def acquire(self, wait: float = 2.0) -> StudyLock:
        """Take the lock, or raise :class:`StudyLocked` naming the holder. A lock file still being written
        (empty) is re-read for up to ``wait`` seconds before it counts as stale."""
        deadline = time.monotonic() + wait
        while not self._create():
            holder = self.holder()
            if holder is None:
                continue  # released meanwhile
            if not holder and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            alive = holder_alive(holder) if holder else False
            if alive is not False:
                raise StudyLocked(self._refusal(holder, alive))
            if self._take_over(holder):
                self.echo(f"study directory {self.study_dir}: took over the lock of a driver that is no longer "
                          f"running ({describe(holder)})")
                break
        self.held = True
        return self

    def _refusal(self, holder: dict, alive: bool | None) -> str:
        where = "" if alive else (f"; it runs on another host: if that driver is gone, delete {self.path}")
        return (f"study directory {self.study_dir} is in use by another driver ({describe(holder)}){where}; "
                "wait for it to finish or stop it, or choose another --out")

    def release(self) -> None:
        """Remove the lock file if it is still ours."""
        if not self.held:
            return
        self.held = False
        holder = self.holder()
        if holder is not None and holder.get("token") == self.me["token"]:
            fs, p = filesystem(self.path)
            try:
                fs.delete_file(p)
            except (FileNotFoundError, OSError):
                pass
        if self.made_dir:
            try:
                os.rmdir(self.study_dir)  # only when empty: a study that wrote nothing leaves nothing
            except OSError:
                pass

    def __enter__(self) -> StudyLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
