"""Processes as a user starts them: this checkout's environment, free ports, waiting for a server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: the repository's root (this file is tests/support/processes.py)
REPO = Path(__file__).resolve().parents[2]


def user_env() -> dict:
    """The environment of a user's terminal: no Ray address, progress bars on, this checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TQDM_DISABLE", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = str(REPO)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    """Until something listens on 127.0.0.1:``port`` (``proc``, e.g. a ``ray start --block``, must live)."""
    import socket
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:2]} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")
