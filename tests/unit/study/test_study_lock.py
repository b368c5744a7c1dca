"""The study lock: a live holder refused and named, a dead driver's lock taken over and said, the lock released
on an exception."""

from __future__ import annotations

import json
import os
import socket

import pytest

from raystudy.study.lock import LOCK_FILE, StudyLock, StudyLocked


def _dead_pid() -> int:
    """A PID no process has: the kernel's limit, which it never hands out (PIDs are below it)."""
    with open("/proc/sys/kernel/pid_max", encoding="ascii") as f:
        return int(f.read())


def test_lock_refuses_a_live_holder_and_names_it(tmp_path):
    with StudyLock(str(tmp_path)) as first:
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["host"] == socket.gethostname() and record["pid"] == os.getpid() and record["started"]
        with pytest.raises(StudyLocked) as e:
            StudyLock(str(tmp_path)).acquire()
        assert f"host {socket.gethostname()}, PID {os.getpid()}, started {record['started']}" in str(e.value)
        assert str(tmp_path) in str(e.value)
        assert first.held
    assert not (tmp_path / LOCK_FILE).exists()  # released


def test_lock_takes_over_a_dead_driver_and_says_so(tmp_path):
    dead = {"host": socket.gethostname(), "pid": _dead_pid(), "started": "2020-01-01T00:00:00", "token": "x"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(dead))
    said: list[str] = []
    with StudyLock(str(tmp_path), echo=said.append):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert len(said) == 1 and "took over the lock" in said[0] and f"PID {dead['pid']}" in said[0]
    # a reused PID (alive, but started at another time) is a dead holder too
    (tmp_path / LOCK_FILE).write_text(json.dumps({**dead, "pid": os.getpid(), "pid_start": "1"}))
    with StudyLock(str(tmp_path), echo=said.append):
        pass
    assert len(said) == 2
    # another host cannot be checked from here: refused, and the message says which file to delete
    (tmp_path / LOCK_FILE).write_text(json.dumps({**dead, "host": "elsewhere"}))
    with pytest.raises(StudyLocked, match=f"delete {tmp_path / LOCK_FILE}"):
        StudyLock(str(tmp_path)).acquire()


def test_lock_released_on_exception_and_new_dir_left_clean(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(RuntimeError), StudyLock(str(out)):
        assert (out / LOCK_FILE).exists()
        raise RuntimeError("boom")
    assert not out.exists()  # created for the lock only: removed again

