"""The local cluster's firewall ruleset (cluster/local-firewall.nft) is valid nftables, checked by nft itself."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.unit.foundation.test_cluster_configs import FIREWALL


@pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (nft) is not installed here")
def test_local_firewall_ruleset_is_valid_nftables():
    done = subprocess.run(["nft", "-c", "-f", str(FIREWALL)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    broken = FIREWALL.read_text(encoding="utf-8").replace("policy accept;", "policy acept;")
    bad = subprocess.run(["nft", "-c", "-f", "-"], input=broken, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0  # the check is real

