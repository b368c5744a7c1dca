"""The shape of ``cluster/gpu.yaml`` on one machine (issue 36): the cluster a user's study meets, in the suite.

As the configs start it: a head of ``CPU: 0`` (``ray start --head --num-cpus 0``, its dashboard on
127.0.0.1), two worker nodes that declare one GPU each (``--num-gpus 1``: logical GPUs, CUDA sees none here),
token authentication on every node and in the driver (``RAY_AUTH_MODE=token``, the shared
``~/.ray/auth_token``), results on a real S3 API (moto's server on 127.0.0.1, ``AWS_ENDPOINT_URL``, as for
MinIO or Ceph). The study is launched as a user launches it: ``raystudy study --address HEAD``.

Its four trials ask for half a GPU each (``gpus_per_worker: 0.5``), so that each node packs two; its
plasticity pass asks for half a GPU per actor. Every trial is held after its first checkpoint (on S3) until
both nodes hold two; then one worker node is lost (its raylet and every process under it killed with
SIGKILL) and the other's trials released. The lost trials are re-run by Tune on the surviving node from their
S3 checkpoints, and the final tables equal an uninterrupted single-process run of each trial's own
``config.json``. No trial and no plasticity actor ever ran on the head; every trial ran on the CPU and the
terminal said so once. (Ray Train on logical GPUs, losing a trial's controller: ``tests/e2e/test_multinode.py``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from raystudy.io import read_result
from raystudy.study.points import trial_id
from tests.support.local_cluster import Cluster, lose_node, raylet
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.processes import user_env
from tests.support.runs import assert_tensorboard_equals_curves, assert_trials_equal_single_process_runs
from tests.support.s3 import moto_s3, s3_checkpoints

BUCKET = "raystudy-topology"
OUT = f"s3://{BUCKET}/study"
STEPS = 12
GRID = sorted(trial_id("noise", c, "sgd", 0.1, s) for c in ("LN1", "MHA") for s in (0, 1))
HOLD_S = 240  # a held run's longest wait at its first checkpoint (released as soon as the node is lost)
NO_CUDA = "CUDA sees no device"

def _spec(builtin: dict) -> dict:
    return dict(
        name="topology", out=OUT, model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32,
        weights=builtin["weights"], data_root=builtin["data_root"], pretrain_store="pretrain",
        datasets={"noise": "shift-noise"}, configurations=["LN1", "MHA"], optimizers={"sgd": [0.1]}, seeds=[0, 1],
        steps=STEPS, batch_size=16, eval_period=4, warmup_steps=1, checkpoint_period=4, workers_per_trial=1,
        cpus_per_worker=1, gpus_per_worker=0.5, max_concurrent_trials=4, trial_retries=2, worker_retries=0,
        plasticity={"enabled": True, "pairs": 16, "batch_size": 8, "mode": "embedding", "workers": 1,
                    "gpus_per_worker": 0.5, "cpus_per_worker": 1, "torch_threads": 1},
        probe={"enabled": False}, pretrain={"enabled": False}, analysis=False,
    )


def _trials_under(node: psutil.Process) -> set[str]:
    """The grid's trials whose Tune actor runs under the raylet ``node`` (Tune works in a folder named by the
    trial)."""
    found = set()
    for p in node.children(recursive=True):
        try:
            found.add(os.path.basename(p.cwd()))
        except (psutil.Error, OSError):
            pass
    return found & set(GRID)


@pytest.fixture(scope="module")
def topology(builtin, tmp_path_factory):
    root = tmp_path_factory.mktemp("topology")
    with moto_s3(root, BUCKET) as (env_s3, fs):
        faults = root / "faults.json"
        faults.write_text(json.dumps({"hold_after_checkpoint": dict.fromkeys(GRID, HOLD_S)}))
        # the nodes' workers inherit the nodes' environment: the S3 endpoint and its credentials, the faults
        env = {**user_env(), **env_s3, "RAYSTUDY_FAULTS": str(faults), "TQDM_DISABLE": "1"}
        cluster = Cluster(root, env)
        (root / "spec.yaml").write_text(yaml.safe_dump(_spec(builtin)))
        t0 = time.monotonic()
        driver = None
        try:
            cluster.start()
            driver = subprocess.Popen([sys.executable, "-m", "raystudy", "study", "--preset", "spec.yaml",
                                       "--address", cluster.address], cwd=root, env=cluster.env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 420
            placed: dict[int, set[str]] = {}
            while True:  # every trial held mid-run after its first checkpoint, on S3
                assert driver.poll() is None, f"the driver ended early:\n{driver.communicate()}"
                assert time.monotonic() < deadline, "the four trials were not all checkpointed within 420 s"
                if all(s3_checkpoints(fs, f"{BUCKET}/study/train/{tid}") for tid in GRID):
                    placed = {nm: _trials_under(raylet(nm)) for nm in cluster.workers}
                    if sum(map(len, placed.values())) == len(GRID):
                        break
                time.sleep(0.5)
            lost_port = cluster.workers[1]
            lose_node(lost_port)
            for tid in GRID:  # the held runs go on (their folders: local staging of the S3 trial folders)
                for folder in Path(tempfile.gettempdir()).glob(f"raystudy-*/{tid}"):
                    (folder / ".release").touch()
            stdout, stderr = driver.communicate(timeout=480)
            (root / "driver.out").write_text(stdout)
            (root / "driver.err").write_text(stderr)
            seconds = time.monotonic() - t0
            gcs = cluster.query()
        finally:
            if driver is not None and driver.poll() is None:
                driver.kill()
                driver.communicate()
            cluster.stop()
        yield {"fs": fs, "rc": driver.returncode, "stdout": stdout, "stderr": stderr, "placed": placed,
               "lost_port": lost_port, "workers": list(cluster.workers), "gcs": gcs, "seconds": seconds}


def test_the_study_ends_with_the_grid_after_losing_a_node(topology):
    assert topology["rc"] == 0, (topology["stdout"][-3000:], topology["stderr"][-3000:])
    trials = read_result(OUT, "trials").set_index("trial_id")
    assert sorted(trials.index) == GRID and trials.index.is_unique
    assert (trials.status == "ok").all() and (trials.steps_completed == STEPS).all()
    lost = topology["placed"][topology["lost_port"]]
    for tid in GRID:  # the lost node's trials went on from their S3 checkpoints; the others never restarted
        assert (trials.loc[tid, "num_restores"] >= 1) == (tid in lost), trials.loc[tid].to_dict()
    print(f"topology study: {topology['seconds']:.0f} s")


def test_each_node_packs_two_half_gpu_trials_and_the_head_runs_none(topology):
    placed = topology["placed"]
    assert sorted(len(t) for t in placed.values()) == [2, 2], placed  # 0.5 GPU each: two per GPU, both nodes
    nodes = {n["port"]: n for n in topology["gcs"]["nodes"]}
    head = [n["id"] for n in topology["gcs"]["nodes"] if n["port"] not in topology["workers"]]
    assert len(head) == 1 and nodes[topology["workers"][0]]["resources"].get("GPU") == 1
    kinds = {}
    for a in topology["gcs"]["actors"]:
        kinds.setdefault(a["cls"], []).append(a["node"])
    # Tune's trial actors and Ray Data's map workers (the plasticity pass's actors) ran, never on the head
    rates = kinds.get("MapWorker(MapBatches(RateActor))")
    assert kinds.get("ImplicitFunc") and rates, sorted(kinds)
    assert head[0] not in kinds["ImplicitFunc"] + rates, kinds
    trials = read_result(OUT, "trials")
    worker_ids = {nodes[p]["id"] for p in topology["workers"]}
    assert set(trials.node_id) <= worker_ids and nodes[topology["workers"][0]]["id"] in set(trials.node_id)


def test_a_logical_gpu_without_cuda_trains_on_the_cpu_and_says_so_once(topology):
    trials = read_result(OUT, "trials")
    assert (trials.device == "cpu").all() and trials.device_warning.str.contains(NO_CUDA).all()
    said = [line for line in topology["stdout"].splitlines() + topology["stderr"].splitlines() if NO_CUDA in line]
    assert len(said) == 1 and "gpus_per_worker=0.5" in said[0] and "note:" in said[0], said
    assert "Traceback" not in topology["stderr"], topology["stderr"][-3000:]


def test_the_tables_equal_uninterrupted_single_process_runs(topology, tmp_path):
    assert_trials_equal_single_process_runs(OUT, GRID, tmp_path)
    assert_tensorboard_equals_curves(OUT, GRID)  # the lost trials' steps before their restore too
    plasticity = read_result(OUT, "plasticity")
    assert len(plasticity) and plasticity.notna().any(axis=None)
