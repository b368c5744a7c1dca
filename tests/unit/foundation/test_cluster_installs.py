"""Every install of the project on a cluster node goes through cluster/constraints.txt, pinned at the tested
versions."""

from __future__ import annotations

import pytest
import yaml

from tests.support.processes import REPO


@pytest.mark.parametrize("config", ["gpu.yaml", "local.yaml"])
def test_cluster_nodes_install_the_tested_versions(config):
    """Every install of the project on a node goes through cluster/constraints.txt, which pins each dependency
    of pyproject.toml at the version this environment (the tests') has."""
    import importlib.metadata as md
    import re
    import tomllib

    root = REPO
    pins = {}
    for line in (root / "cluster" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"cluster/constraints.txt: {line!r} is not pinned (name==version)"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", dep).group()).lower()
        assert pins.get(name) == md.version(name), (name, pins.get(name), md.version(name))
    commands = [c for k, v in yaml.safe_load((root / "cluster" / config).read_text()).items()
                if k.endswith("_commands") for c in v or []]
    installs = [c for c in commands if re.search(r"\bpip install\b", c) and "raystudy" in c]
    assert installs and all("-c ~/raystudy/cluster/constraints.txt" in c for c in installs), installs

