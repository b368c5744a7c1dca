"""Issues 15 and 36: an ``s3://`` study on separate machines loses the node of its trial, under both executions.

A cluster as ``cluster/gpu.yaml`` starts one (``local_cluster``): a head of ``CPU: 0`` and three worker nodes of
1 CPU and one logical GPU each, whose staging folders are separate, as on separate machines (a private tmpfs
in a mount namespace of each node's). The trial's Tune actor and its Ray Train controller take 0.01 CPU of one
node, so its one worker (1 CPU, 1 GPU; gloo on the CPU, as CUDA sees none, said in the summary) runs on another.
The run is held after its first checkpoint (on S3); then the node of the trial's Tune actor and controller is
lost: its raylet and every process under it killed with SIGKILL. The worker, owned by the dead controller, dies
with it, but the worker group's placement group outlives its controller and keeps that worker's node until the
driver removes it (``raystudy.distributed.cluster.remove_orphaned_placement_groups``): the re-run's worker needs
a whole node, and without that removal the study once waited forever. Tune re-runs the trial from its S3
checkpoint, its worker again on another node than its actor.

Under ``execution: actor`` the trial trains in its Tune actor (1 CPU, 1 GPU of one node), held after its first
checkpoint likewise; losing that node ends the attempt, and Tune re-runs the trial from its S3 checkpoint in a
new actor on another node.

The study's folder on S3 then holds the best weights, equal to an uninterrupted single-process run's, and the
TensorBoard events of every step once, those before the restore too (the lost attempt's events never reached
the bucket), in the trial's folder and under ``tb/``; no surviving node keeps anything in its staging folder.
(A cluster losing a node under ``execution: actor``, four trials on half GPUs: ``tests/e2e/test_topology.py``.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load, load_file

from raystudy.io import read_result
from raystudy.storage import join, read_bytes
from raystudy.study.points import trial_id
from tests.support.local_cluster import Cluster, lose_node
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.processes import user_env
from tests.support.runs import assert_tensorboard_equals_curves, assert_trials_equal_single_process_runs
from tests.support.s3 import moto_s3, s3_checkpoints

BUCKET = "raystudy-train"
OUT = f"s3://{BUCKET}/study"
TID = trial_id("noise", "MHA", "sgd", 0.1, 0)
STEPS = 12
HOLD_S = 240  # the held run's longest wait at its first checkpoint (it dies with its controller sooner)


def _spec(builtin: dict, execution: str) -> dict:
    return dict(
        name="s3-train", out=OUT, model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32,
        weights=builtin["weights"], data_root=builtin["data_root"], pretrain_store="pretrain",
        datasets={"noise": "shift-noise"}, configurations=["MHA"], optimizers={"sgd": [0.1]}, seeds=[0],
        steps=STEPS, batch_size=16, eval_period=4, warmup_steps=1, checkpoint_period=4, execution=execution,
        workers_per_trial=1, cpus_per_worker=1, gpus_per_worker=1, trial_retries=2, worker_retries=1,
        plasticity={"enabled": False}, probe={"enabled": False}, pretrain={"enabled": False}, analysis=False,
    )


def _alive(gcs: dict) -> dict[str, set[str]]:
    """Actor class -> the ids of the nodes where such an actor is alive."""
    found: dict[str, set[str]] = {}
    for a in gcs["actors"]:
        if a["state"] == "ALIVE":
            found.setdefault(a["cls"], set()).add(a["node"])
    return found


@pytest.fixture(scope="module", params=["train", "actor"])
def study(builtin, tmp_path_factory, request):
    execution = request.param
    root = tmp_path_factory.mktemp(f"multinode-{execution}")
    with moto_s3(root, BUCKET) as (env_s3, fs):
        faults = root / "faults.json"
        faults.write_text(json.dumps({"hold_after_checkpoint": {TID: HOLD_S}}))
        env = {**user_env(), **env_s3, "RAYSTUDY_FAULTS": str(faults), "TQDM_DISABLE": "1"}
        cluster = Cluster(root, env, private_staging=True)
        (root / "spec.yaml").write_text(yaml.safe_dump(_spec(builtin, execution)))
        driver = None
        try:
            cluster.start(3, cpus=1, gpus=1)
            staging = [cluster.staging_of(nm) for nm in cluster.workers]
            (staging[0] / "premise").write_text("a")  # seen on its own node only, as on separate machines
            premise = [(p / "premise").exists() for p in (*staging, Path(cluster.staging))]
            (staging[0] / "premise").unlink()
            driver = subprocess.Popen([sys.executable, "-m", "raystudy", "study", "--preset", "spec.yaml",
                                       "--address", cluster.address], cwd=root, env=cluster.env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 300
            while not s3_checkpoints(fs, f"{BUCKET}/study/train/{TID}"):  # held after it, mid-run
                assert driver.poll() is None, f"the driver ended early:\n{driver.communicate()}"
                assert time.monotonic() < deadline, "no checkpoint on S3 within 300 s"
                time.sleep(0.5)
            before = cluster.query()
            port = {n["id"]: n["port"] for n in before["nodes"]}
            lost = port[next(iter(_alive(before)["ImplicitFunc"]))]  # the node of the trial's Tune actor
            lose_node(lost)  # the node of the trial's Tune actor (and, under execution: train, its controller)
            stdout, stderr = driver.communicate(timeout=480)
            survivors = [nm for nm in cluster.workers if nm != lost]
            staged = {nm: sorted(p.name for p in cluster.staging_of(nm).iterdir()) for nm in survivors}
            after = cluster.query()
        finally:
            if driver is not None and driver.poll() is None:
                driver.kill()
                driver.communicate()
            cluster.stop()
        yield {"execution": execution, "rc": driver.returncode, "stdout": stdout, "stderr": stderr,
               "before": before, "after": after,
               "lost": lost, "staged": staged, "premise": premise}


def test_the_study_ends_ok_after_losing_the_node_of_its_trial_and_controller(study):
    assert study["rc"] == 0, (study["stdout"][-3000:], study["stderr"][-3000:])
    before, lost = _alive(study["before"]), study["lost"]
    node_of = {n["port"]: n["id"] for n in study["before"]["nodes"]}
    assert before["ImplicitFunc"] == {node_of[lost]}, before  # the lost node held the trial's Tune actor
    if study["execution"] == "train":  # and its Ray Train controller; its worker ran on another node
        assert before["TrainController"] == {node_of[lost]}, before
        assert len(before["RayTrainWorker"]) == 1 and node_of[lost] not in before["RayTrainWorker"], before
    else:  # the actor trained the trial itself: no Ray Train run
        assert "TrainController" not in before and "RayTrainWorker" not in before, before
    trials = read_result(OUT, "trials").set_index("trial_id")
    assert trials.index.tolist() == [TID]
    row = trials.loc[TID]
    assert row.status == "ok" and row.steps_completed == STEPS
    assert row.num_restores >= 1 and row.trial_restarts >= 1, row.to_dict()  # Tune re-ran it from S3
    # a Ray Train run on a logical GPU: gloo on the CPU (NCCL refuses without a GPU), and the row says why
    assert row.device == "cpu" and "CUDA sees no device" in row.device_warning


def test_every_attempt_trained_where_the_execution_puts_it(study):
    """Under ``execution: train`` each attempt's worker (owned by its controller, itself owned by the trial's
    Tune actor) ran on another node than its controller and Tune actor, the re-run's too; under ``actor`` the
    re-run's Tune actor trained on a surviving node."""
    actors = study["after"]["actors"]
    if study["execution"] == "actor":
        node_of = {n["port"]: n["id"] for n in study["before"]["nodes"]}
        trials = [a for a in actors if a["cls"] == "ImplicitFunc"]
        assert len(trials) >= 2 and {a["node"] for a in trials} - {node_of[study["lost"]]}, actors
        assert not [a for a in actors if a["cls"] in ("TrainController", "RayTrainWorker")], actors
        return
    by_worker = {a["worker"]: a for a in actors}
    workers = [a for a in actors if a["cls"] == "RayTrainWorker"]
    assert len({a["owner"] for a in workers}) >= 2, actors  # two attempts: two controllers
    for w in workers:
        controller = by_worker[w["owner"]]
        trial = by_worker[controller["owner"]]
        assert (controller["cls"], trial["cls"]) == ("TrainController", "ImplicitFunc"), (controller, trial)
        assert controller["node"] == trial["node"] != w["node"], (w, controller, trial)


def test_the_weights_reach_the_bucket_equal_to_a_single_process_run(study, tmp_path):
    assert_trials_equal_single_process_runs(OUT, [TID], tmp_path)
    got = load(read_bytes(join(OUT, "trials", TID, "best_trainable.safetensors")))
    want = load_file(str(tmp_path / TID / "best_trainable.safetensors"))
    assert sorted(got) == sorted(want) and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


def test_the_tensorboard_events_reach_the_bucket(study):
    assert_tensorboard_equals_curves(OUT, [TID])  # the steps before the restore, lost with the node, too


def test_no_surviving_node_keeps_a_staging_folder(study):
    assert study["staged"] == {nm: [] for nm in study["staged"]} and len(study["staged"]) == 2, study["staged"]


def test_the_nodes_staging_folders_are_their_own(study):
    """The premise: what one node stages, the other nodes and the test do not see."""
    assert study["premise"] == [True, False, False, False]
