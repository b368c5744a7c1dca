"""A Ray cluster of several nodes on this one machine, started as ``cluster/*.yaml`` start theirs: a head of
``CPU: 0`` and worker nodes, each a ``ray start --block`` process with its own ports, token authentication on
(``RAY_AUTH_MODE=token``, one ``~/.ray/auth_token`` in a HOME of the cluster's). Used by
``tests/e2e/test_topology.py`` and ``tests/e2e/test_multinode.py``.

Nodes of one machine share its disk, where separate machines would not. With ``private_staging`` each worker
node runs in a mount namespace of its own (``unshare -m``) in which a private tmpfs covers one staging folder,
its processes' ``TMPDIR``: what a node writes there, as a trial stages its folder of an ``s3://`` study, the
other nodes and the test do not see, as on separate machines (:meth:`Cluster.staging_of` reads it).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from tests.support.processes import free_port, wait_for_port

# the cluster's nodes see each other's deaths within ~2 s (a killed raylet's checks fail at once; a live one
# has 5 s to answer on two busy cores)
HEAD_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
            "RAY_health_check_timeout_ms": "5000"}

QUERY = r"""
import json, sys
import ray
from ray._private.state import actors  # the GCS's actor table, dead actors included

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = [{"id": n["NodeID"], "port": n["NodeManagerPort"], "alive": n["Alive"], "resources": n["Resources"]}
         for n in ray.nodes()]
table = [{"cls": a["ActorClassName"].rsplit(".", 1)[-1], "node": a["Address"]["NodeID"], "state": a["State"],
          "worker": "{NodeID}:{Port}".format(**a["Address"]), "owner": "{NodeID}:{Port}".format(**a["OwnerAddress"])}
         for a in actors().values()]  # worker and owner: the actor's process and its owner's, as node:port
print(json.dumps({"nodes": nodes, "actors": table}))
"""


def raylet(node_manager_port: int) -> psutil.Process:
    """The raylet process of the node whose node manager listens on ``node_manager_port``."""
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and os.path.basename(cmd[0]) == "raylet" and f"--node_manager_port={node_manager_port}" in cmd:
            return p
    raise LookupError(f"no raylet with node manager port {node_manager_port}")


def lose_node(node_manager_port: int) -> None:
    """The worker node is lost, as a machine is: its raylet and every process under it killed at once."""
    node = raylet(node_manager_port)
    for p in [node, *node.children(recursive=True)]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


class Cluster:
    """A head of ``CPU: 0`` and worker nodes (:meth:`start`), token authentication on, its HOME and temp dir;
    with ``private_staging``, each worker node's own staging folder (see the module docstring)."""

    def __init__(self, root: Path, env: dict, *, private_staging: bool = False):
        self.root = root
        self.home = root / "home"  # every node's and the driver's ~/.ray/auth_token: never the user's
        (self.home / ".ray").mkdir(parents=True)
        (self.home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
        self.env = {**env, "HOME": str(self.home), "RAY_AUTH_MODE": "token"}
        self.temp = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: Ray's socket paths stay < 108 bytes
        self.staging = tempfile.mkdtemp(prefix="rs-stage-", dir="/tmp") if private_staging else None
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.ray = str(Path(sys.executable).parent / "ray")
        self.procs: list[subprocess.Popen] = []
        self.workers: list[int] = []  # node manager ports

    def _start(self, args: list[str], env: dict, private: bool = False) -> subprocess.Popen:
        agent = ["--dashboard-agent-listen-port", str(free_port()), "--min-worker-port", "0",
                 "--max-worker-port", "0", "--disable-usage-stats", "--block"]
        cmd = [self.ray, "start", *args, *agent]
        if private:  # its own tmpfs over the staging folder, then `ray start` in its place (same PID)
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs raystudy-staging "$1" && shift && exec "$@"', "sh", self.staging, *cmd]
            env = {**env, "TMPDIR": self.staging}
        with open(self.root / f"node-{len(self.procs)}.log", "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self, workers: int = 2, *, cpus: int = 2, gpus: int = 1) -> None:
        """The head (cluster/gpu.yaml's: CPU 0, its dashboard on 127.0.0.1, on free ports) and ``workers``
        worker nodes of ``cpus`` CPUs and ``gpus`` logical GPUs each."""
        head = self._start(["--head", "--port", str(self.port), "--num-cpus", "0", "--num-gpus", "0",
                            "--temp-dir", self.temp, "--dashboard-host", "127.0.0.1", "--dashboard-port",
                            str(free_port()), "--ray-client-server-port", str(free_port())],
                           {**self.env, **HEAD_ENV})
        wait_for_port(self.port, head)
        for _ in range(workers):
            nm = free_port()
            node = self._start(["--address", self.address, "--num-cpus", str(cpus), "--num-gpus", str(gpus),
                                "--node-manager-port", str(nm)], self.env, private=self.staging is not None)
            try:
                wait_for_port(nm, node)
            except RuntimeError as e:  # e.g. no permission for a mount namespace: its log says
                log = self.root / f"node-{len(self.procs) - 1}.log"
                raise RuntimeError(f"a worker node did not start ({e}):\n{log.read_text()[-2000:]}") from e
            self.workers.append(nm)

    def staging_of(self, node_manager_port: int) -> Path:
        """The worker node's own staging folder, as its processes see it (through its raylet's mount
        namespace: ``/proc/<pid>/root``)."""
        return Path(f"/proc/{raylet(node_manager_port).pid}/root") / self.staging.lstrip("/")

    def query(self) -> dict:
        """The GCS's nodes and actors (dead ones included), asked by a driver of its own."""
        proc = subprocess.run([sys.executable, "-c", QUERY, self.address], env=self.env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        for proc in reversed(self.procs):  # `ray start --block` stops its own node on SIGTERM
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        current = Path("/tmp/ray/ray_current_cluster")  # read by address="auto": never left naming this head
        if current.is_file() and current.read_text().strip().endswith(f":{self.port}"):
            current.unlink()
        shutil.rmtree(self.temp, ignore_errors=True)
        if self.staging:
            shutil.rmtree(self.staging, ignore_errors=True)
