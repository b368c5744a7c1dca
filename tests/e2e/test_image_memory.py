"""A huge PNG refused from its header keeps a fresh process's peak memory small."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.stores import huge_png


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak RSS read from /proc/self/status (Linux)")
def test_huge_png_peak_memory_stays_small(tmp_path):
    """In a fresh process: refusing the PNG keeps the peak RSS far below the 400 MB of its pixels.

    The peak is the process's ``VmHWM`` (reset by ``exec``; ``ru_maxrss`` would keep pytest's own peak).
    """
    (tmp_path / "bomb.png").write_bytes(huge_png())
    code = ("import re, sys\nfrom raystudy.data.images import ImageError, load_image_file\n"
            "try:\n    load_image_file(sys.argv[1])\nexcept ImageError as e:\n    print(e)\n"
            "status = open('/proc/self/status').read()\n"
            "print(int(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1)) // 1024)\n")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bomb.png")], capture_output=True, text=True,
                         timeout=120, check=True)
    message, peak_mb = res.stdout.strip().splitlines()
    assert message.startswith(f"{tmp_path / 'bomb.png'}: ") and "refused without decoding" in message
    assert int(peak_mb) < 150, res.stdout

