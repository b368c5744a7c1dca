"""Issue 15 item 7: the cluster launcher configs turn Ray token authentication on, keep Ray's ports closed to
everything but the cluster, keep the shared folder from being world-writable and download no install
script. Offline: the YAML files, Ray's own default security-group rules and (where `nft` is installed) the
nftables ruleset's syntax."""

from __future__ import annotations

import ast
import importlib.util
import ipaddress
import itertools
import re
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config

from tests.support.processes import REPO

CLUSTER = REPO / "cluster"



CONFIGS = ["gpu.yaml", "local.yaml"]



CLOSED_PORTS = (6379, 10001, 8265)  # GCS, Ray client server, dashboard



FIREWALL = CLUSTER / "local-firewall.nft"



def _load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text(encoding="utf-8"))



def _commands(cfg: dict) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    return [c for k in keys for c in cfg.get(k) or []]



def _ray_starts(cfg: dict, key: str) -> list[str]:
    return [c for c in cfg[key] if re.search(r"\bray start\b", c)]



@pytest.mark.parametrize("name", CONFIGS)
def test_token_auth_on_for_head_workers_and_drivers(name):
    cfg = _load(name)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = _ray_starts(cfg, key)
        assert starts, f"{name}: no `ray start` in {key}"
        for cmd in starts:
            # exported in the same shell, before `ray start` (the processes Ray starts inherit it)
            before = cmd[: cmd.index("ray start")]
            assert re.search(r"\bexport RAY_AUTH_MODE=token\s*;", before), f"{name} {key}: {cmd}"
            assert "RAY_AUTH_MODE=disabled" not in cmd
    # The token travels as a file (never on a command line) to every node, readable by its owner only.
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "chmod 600 ~/.ray/auth_token" in cfg["setup_commands"]
    assert not any("RAY_AUTH_TOKEN=" in c for c in _commands(cfg))
    # Drivers run on the head through `ray exec` (a login shell) authenticate too.
    assert any("export RAY_AUTH_MODE=token" in c and ".bashrc" in c for c in cfg["setup_commands"])



@pytest.mark.parametrize("name", CONFIGS)
def test_no_world_writable_folder_and_no_piped_install_script(name):
    text = (CLUSTER / name).read_text(encoding="utf-8")
    commands = _commands(_load(name))
    joined = "\n".join(commands)
    modes = re.findall(r"\bchmod\s+(?:-\w+\s+)*(\S+)", joined)
    assert "777" not in joined and not re.search(r"chmod\s+-R\b", joined)
    for mode in modes:  # numeric: the "others" digit has no write bit; symbolic: no o/a write
        assert (int(mode[-1], 8) & 2 == 0) if mode.isdigit() else not re.search(r"[oa]?[+=][^,]*w", mode), mode
    assert modes, "the configs set modes explicitly (token file, shared folder)"
    assert not re.search(r"\b(curl|wget)\b[^\n|]*\|\s*(sudo\s+)?(ba|z|da)?sh\b", text)
    assert not re.search(r"\b(curl|wget)\b", joined), "tools come from the distribution or pinned from PyPI"
    for cmd in commands:  # whatever is installed from PyPI as a tool is pinned
        m = re.search(r"pipx install (\S+)", cmd)
        assert m is None or "==" in m.group(1), cmd



def test_shared_folder_owned_by_the_ray_user_with_setgid_group():
    setup = " ".join(_load("gpu.yaml")["setup_commands"])
    assert 'sudo chown "$(id -u):$(id -g)" /mnt/shared && sudo chmod 2775 /mnt/shared' in setup



@pytest.mark.parametrize("name", CONFIGS)
def test_no_port_bound_to_all_interfaces(name):
    cfg = _load(name)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for cmd in cfg[key]:
            assert "0.0.0.0" not in cmd and "::/0" not in cmd and "--dashboard-host=::" not in cmd, cmd
    (head,) = _ray_starts(cfg, "head_start_ray_commands")
    assert "--dashboard-host=127.0.0.1" in head and "--port=6379" in head and "--ray-client-server-port=10001" in head



def _covers(rule: dict, port: int) -> bool:
    if rule.get("IpProtocol") == "-1":
        return True
    return rule.get("FromPort", 0) <= port <= rule.get("ToPort", 65535)



def _ray_default_inbound_rules():
    """Ray's own ``_create_default_inbound_rules`` (what ``ray up`` authorizes on a new AWS security group),
    taken from the installed ``ray/autoscaler/_private/aws/config.py`` without importing it (that module
    needs boto3, which the project does not)."""
    path = Path(importlib.util.find_spec("ray").origin).parent / "autoscaler/_private/aws/config.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    wanted = {"_create_default_inbound_rules", "_create_default_intracluster_inbound_rules",
              "_create_default_ssh_inbound_rules"}
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {d.name for d in defs} == wanted, "Ray's AWS default rules moved; update this test"
    namespace = {"itertools": itertools}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["_create_default_inbound_rules"]



def test_gpu_security_group_admits_ray_ports_from_the_cluster_only():
    """The rules `ray up` authorizes (Ray's own defaults plus the config's IpPermissions): from outside the
    cluster's own group, SSH only; 6379, 10001 and 8265 are reachable from members of the group only."""
    cfg = prepare_config(_load("gpu.yaml"))
    extra = cfg["provider"]["security_group"].get("IpPermissions", [])
    rules = _ray_default_inbound_rules()({"sg-cluster"}, extra)
    open_rules = [r for r in rules if r.get("IpRanges") or r.get("Ipv6Ranges") or r.get("PrefixListIds")]
    assert open_rules and all(r["FromPort"] == r["ToPort"] == 22 and r["IpProtocol"] == "tcp" for r in open_rules)
    for port in CLOSED_PORTS:
        admitting = [r for r in rules if _covers(r, port)]
        assert admitting and all(
            not r.get("IpRanges") and not r.get("Ipv6Ranges") and not r.get("PrefixListIds")
            and [p["GroupId"] for p in r["UserIdGroupPairs"]] == ["sg-cluster"] for r in admitting
        ), port



def _nft_define(name: str) -> str:
    m = re.search(rf"^define {name} = \{{([^}}]*)\}}", FIREWALL.read_text(encoding="utf-8"), re.M)
    assert m, f"no `define {name}` in {FIREWALL.name}"
    return m.group(1)



def _port_set(spec: str) -> set[int]:
    ports: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        lo, _, hi = part.partition("-")
        ports.update(range(int(lo), int(hi or lo) + 1))
    return ports



def test_local_firewall_closes_every_pinned_ray_port_to_all_but_the_cluster():
    cfg = _load("local.yaml")
    provider = cfg["provider"]
    cluster = {ipaddress.ip_address(a.strip()) for a in _nft_define("cluster").split(",")}
    assert cluster == {ipaddress.ip_address(a) for a in [provider["head_ip"], *provider["worker_ips"]]}
    closed = _port_set(_nft_define("ray_ports"))
    # every port pinned by a `ray start` (head and workers) is in the dropped set, and so are 6379/10001/8265
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for cmd in _ray_starts(cfg, key):
            flags = dict(re.findall(r"--([a-z-]+)=(\d+)\b", cmd))
            pinned = {int(v) for k, v in flags.items() if k.endswith("port")}
            if "min-worker-port" in flags:
                pinned |= set(range(int(flags["min-worker-port"]), int(flags["max-worker-port"]) + 1))
            assert pinned and pinned <= closed, (key, sorted(pinned - closed)[:5])
    assert set(CLOSED_PORTS) <= closed
    rules = FIREWALL.read_text(encoding="utf-8")
    assert re.search(r"ip saddr \$cluster accept\s+tcp dport \$ray_ports drop", rules)
    (head,) = _ray_starts(cfg, "head_start_ray_commands")
    assert f"--node-ip-address={provider['head_ip']}" in head
    assert "sudo nft -f ~/raystudy/cluster/local-firewall.nft" in cfg["setup_commands"]

