"""A real S3 API on 127.0.0.1 (moto's server) and what the tests read from it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from tests.support.processes import free_port, wait_for_port


@contextlib.contextmanager
def moto_s3(log_dir: Path, bucket: str):
    """``(env, filesystem)``: moto's S3 server on a free port of 127.0.0.1 with ``bucket`` made, the
    environment a client needs to reach it (also set in this process, which reads the study's tables, until
    the block ends), and a pyarrow file system on it. The server is stopped when the block ends."""
    import shutil

    import pyarrow.fs as pafs

    port = free_port()
    server = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    log = open(Path(log_dir) / "moto.log", "w")
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_REGION": "us-east-1"}
    try:
        wait_for_port(port, proc, timeout=60)
        fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", access_key="test", secret_key="test",
                               region="us-east-1", allow_bucket_creation=True)
        fs.create_dir(bucket)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield env, fs
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def s3_checkpoints(fs, folder: str) -> list[str]:
    """The complete checkpoints (``checkpoint_*/.complete``) under ``folder`` (``bucket/study/train/<trial>``)
    of the pyarrow file system ``fs``; none while the folder does not exist."""
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(folder, recursive=True))
    except (FileNotFoundError, OSError):
        return []
    return sorted(i.path for i in infos if i.base_name == ".complete")
