"""The cluster launcher configs pass Ray's own validation, offline (no cloud calls, no SSH)."""

from __future__ import annotations

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.support.processes import REPO

CLUSTER = REPO / "cluster"


def _load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


@pytest.mark.parametrize("name", ["gpu.yaml", "local.yaml"])
def test_cluster_config_passes_ray_schema(name):
    raw = _load(name)
    # What `ray up` does before talking to any provider: merge the provider's defaults, then validate
    # against ray/autoscaler/ray-schema.json plus Ray's cross-field checks.
    prepared = prepare_config(raw)
    validate_config(prepared)
    # The raw file itself is schema-valid too (no field Ray would not know).
    validate_config({**raw, "cluster_synced_files": raw.get("cluster_synced_files", [])})


def test_gpu_cluster_shape():
    cfg = prepare_config(_load("gpu.yaml"))
    head = cfg["available_node_types"][cfg["head_node_type"]]
    assert head["resources"] == {"CPU": 0}, "the head must not take trials"
    workers = [t for n, t in cfg["available_node_types"].items() if n != cfg["head_node_type"]]
    assert len(workers) == 1 and workers[0]["min_workers"] == 0 and workers[0]["max_workers"] >= 1
    assert workers[0]["node_config"]["InstanceType"].startswith(("g", "p")), "workers are GPU instances"
    # Only Ray's default rules (SSH + intra-cluster): no extra inbound permission opens a port.
    assert "IpPermissions" not in cfg["provider"]["security_group"]
    # The dashboard binds to localhost (reached by `ray dashboard`, i.e. SSH port forwarding).
    assert "--dashboard-host=127.0.0.1" in " ".join(cfg["head_start_ray_commands"])
    setup = " ".join(cfg["setup_commands"])
    assert "pip install" in setup and "~/raystudy" in setup and "/mnt/shared" in setup


def test_local_cluster_shape():
    cfg = prepare_config(_load("local.yaml"))
    (node_type,) = cfg["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(cfg["provider"]["worker_ips"])
    assert "--dashboard-host=127.0.0.1" in " ".join(cfg["head_start_ray_commands"])


def test_schema_rejects_a_broken_config():
    """The check is real: a misspelled field or a wrong type fails the same validation."""
    bad = _load("gpu.yaml")
    bad["available_node_types"]["gpu_worker"]["min_worker"] = 1  # typo
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))
    bad = _load("gpu.yaml")
    bad["max_workers"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))


# --------------------------------------------------------------------------------------------------
# raystudy.distributed.cluster: Ray's benign notices dropped at their logger, real warnings kept
# --------------------------------------------------------------------------------------------------


def test_quiet_ray_logs_drops_only_the_benign_notices(caplog, monkeypatch):
    import logging

    from raystudy.distributed.cluster import BENIGN_NOTICES, quiet_ray_logs

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    quiet_ray_logs(verbose=False)
    quiet_ray_logs(verbose=False)  # idempotent: one filter per notice
    auth = logging.getLogger(BENIGN_NOTICES[0][0])
    assert len(auth.filters) == 1
    assert logging.getLogger("ray").level == logging.WARNING and logging.getLogger("ray.data").level == logging.WARNING
    with caplog.at_level(logging.WARNING):
        auth.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled ...")
        auth.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
        logging.getLogger("ray.data._internal.progress").warning("Progress bars disabled. To enable, set ...")
        logging.getLogger("ray.data._internal.progress").warning("a real problem")
    # the notice about Ray's default is gone; the security warning and real problems stay
    assert [r.getMessage()[:40] for r in caplog.records] == [
        "Token authentication is disabled for thi", "a real problem"]
    assert "RAY_AUTH_MODE" not in __import__("os").environ  # authentication itself is never changed
    quiet_ray_logs(verbose=True)  # -v: Ray prints as it always does
    assert logging.getLogger("ray").level == logging.INFO and auth.filters == []
    quiet_ray_logs(verbose=False)
