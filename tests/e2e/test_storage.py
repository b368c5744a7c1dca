"""``storage.uploaded_folder``: a local temporary folder uploaded when its block ends; a folder whose process was
killed in the block is removed by the next block on the machine, a live process's never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from raystudy.storage import OWNER_LOCK, remove_abandoned_folders, uploaded_folder

#: a process that enters a block, says where, then waits for a signal there
HOLDER = r"""
import sys, time
from raystudy.storage import uploaded_folder
with uploaded_folder(sys.argv[1], name="trial") as local:
    open(local + "/events", "w").write("x")
    print(local, flush=True)
    time.sleep(600)
"""


def _holder(tmp_path, uri) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(uri)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    return proc, proc.stdout.readline().strip()


def test_the_folder_is_uploaded_without_its_lock_and_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with uploaded_folder(str(tmp_path / "uri"), name="trial") as local:
        with open(os.path.join(local, "summary.json"), "w") as f:
            f.write("{}")
        folder = os.path.dirname(local)
        assert os.path.basename(folder).startswith("raystudy-") and os.path.isfile(os.path.join(folder, OWNER_LOCK))
    assert sorted(os.listdir(tmp_path / "uri")) == ["summary.json"]  # the lock stays behind, then goes
    assert os.listdir(tmp_path / "tmp") == []


def test_a_killed_process_folder_is_removed_by_the_next_block_and_a_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed, killed_at = _holder(tmp_path, tmp_path / "a")
    live, live_at = _holder(tmp_path, tmp_path / "b")
    try:
        killed.send_signal(signal.SIGKILL)  # no upload, no removal
        killed.wait(timeout=30)
        assert os.path.isdir(killed_at) and not os.path.exists(tmp_path / "a")
        assert remove_abandoned_folders() == [os.path.dirname(killed_at)]
        assert not os.path.exists(killed_at) and os.path.isfile(os.path.join(live_at, "events"))
        with uploaded_folder(str(tmp_path / "c")):  # a block finds nothing more to remove
            assert remove_abandoned_folders() == []
        live.send_signal(signal.SIGTERM)  # Python's default: the process ends without its finally blocks
        live.wait(timeout=30)
        assert remove_abandoned_folders() == [os.path.dirname(live_at)] and not os.path.exists(live_at)
    finally:
        for proc in (killed, live):
            if proc.poll() is None:
                proc.kill()
