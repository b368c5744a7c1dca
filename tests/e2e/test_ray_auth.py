"""The token file of a Ray instance raystudy starts is readable by its owner only."""

from __future__ import annotations


def test_rays_token_file_is_readable_by_its_owner_only(tmp_path):
    import os
    import stat
    import subprocess
    import sys

    from tests.support.processes import user_env

    code = ("from raystudy.distributed.cluster import init_ray\nimport ray\n"
            "assert init_ray(num_cpus=1)\nray.shutdown()\n")
    env = {**user_env(), "HOME": str(tmp_path)}  # a machine where Ray has made no token yet
    env.pop("RAY_AUTH_MODE", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    token = tmp_path / ".ray" / "auth_token"
    assert token.is_file() and stat.S_IMODE(os.stat(token).st_mode) == 0o600, oct(os.stat(token).st_mode)

