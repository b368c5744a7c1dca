"""An ``s3://`` study under ``execution: train`` whose Ray Train worker runs on another node than its trial.

A trial of a study on object storage writes its folder into a local staging folder on the node of its Tune
actor, uploaded when the trial ends. Under ``execution: train`` worker 0 of the trial's Ray Train run writes the
TensorBoard events and the best weights, on whatever node Ray places it. Here the cluster's two worker nodes
have separate staging folders, as separate machines have (``local_cluster``: a private tmpfs in a mount
namespace of each node's), and one CPU each: the trial's Tune actor takes 0.01 CPU of one node, so its one
1-CPU worker can only run on the other. The study's folder on S3 still holds the weights, equal to a
single-process run's, and the TensorBoard events of every step, in the trial's folder and under ``tb/``; no
node keeps anything in its staging folder.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    STUDY_MODEL,
    STUDY_TINY,
    assert_tensorboard_equals_curves,
    assert_trials_equal_single_process_runs,
    moto_s3,
    user_env,
)
from local_cluster import Cluster
from safetensors.torch import load, load_file

from raystudy.io import read_result
from raystudy.storage import join, read_bytes
from raystudy.study.points import trial_id

pytestmark = pytest.mark.slow

BUCKET = "raystudy-train"
OUT = f"s3://{BUCKET}/study"
TID = trial_id("noise", "MHA", "sgd", 0.1, 0)


def _spec(builtin: dict) -> dict:
    return dict(
        name="s3-train", out=OUT, model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32,
        weights=builtin["weights"], data_root=builtin["data_root"], pretrain_store="pretrain",
        datasets={"noise": "shift-noise"}, configurations=["MHA"], optimizers={"sgd": [0.1]}, seeds=[0],
        steps=12, batch_size=16, eval_period=4, warmup_steps=1, checkpoint_period=4, execution="train",
        workers_per_trial=1, cpus_per_worker=1, gpus_per_worker=0, trial_retries=0, worker_retries=0,
        plasticity={"enabled": False}, probe={"enabled": False}, pretrain={"enabled": False}, analysis=False,
    )


@pytest.fixture(scope="module")
def study(builtin, tmp_path_factory):
    root = tmp_path_factory.mktemp("s3train")
    with moto_s3(root, BUCKET) as (env_s3, fs):
        cluster = Cluster(root, {**user_env(), **env_s3, "TQDM_DISABLE": "1"}, private_staging=True)
        (root / "spec.yaml").write_text(yaml.safe_dump(_spec(builtin)))
        try:
            cluster.start(cpus=1, gpus=0)
            a, b = (cluster.staging_of(nm) for nm in cluster.workers)
            (a / "premise").write_text("a")  # seen on its own node only, as on separate machines
            premise = [(p / "premise").exists() for p in (a, b, Path(cluster.staging))]
            (a / "premise").unlink()
            proc = subprocess.run([sys.executable, "-m", "raystudy", "study", "--preset", "spec.yaml",
                                   "--address", cluster.address], cwd=root, env=cluster.env, text=True,
                                  capture_output=True, timeout=480)
            staged = {nm: sorted(p.name for p in cluster.staging_of(nm).iterdir()) for nm in cluster.workers}
            gcs = cluster.query()
        finally:
            cluster.stop()
        yield {"proc": proc, "staged": staged, "gcs": gcs, "workers": cluster.workers, "premise": premise}


def test_the_worker_trained_on_another_node_than_its_trial(study):
    proc = study["proc"]
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    trials = read_result(OUT, "trials")
    assert trials.trial_id.tolist() == [TID] and trials.status.tolist() == ["ok"]
    nodes = {a["cls"]: a["node"] for a in study["gcs"]["actors"] if a["cls"] in ("ImplicitFunc", "RayTrainWorker")}
    assert len(nodes) == 2 and nodes["ImplicitFunc"] != nodes["RayTrainWorker"], study["gcs"]["actors"]


def test_the_weights_reach_the_bucket_equal_to_a_single_process_run(study, tmp_path):
    assert_trials_equal_single_process_runs(OUT, [TID], tmp_path)
    got = load(read_bytes(join(OUT, "trials", TID, "best_trainable.safetensors")))
    want = load_file(str(tmp_path / TID / "best_trainable.safetensors"))
    assert sorted(got) == sorted(want) and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


def test_the_tensorboard_events_reach_the_bucket(study):
    assert_tensorboard_equals_curves(OUT, [TID])


def test_no_node_keeps_a_staging_folder(study):
    assert study["staged"] == {nm: [] for nm in study["workers"]}, study["staged"]


def test_the_nodes_staging_folders_are_their_own(study):
    """The premise: what one node stages, the other node and the test do not see."""
    assert study["premise"] == [True, False, False]
