"""A run inside the trial's own actor (``execution: actor``, raystudy.distributed.inprocess), without Ray:
the same numbers as the plain loop, exact resume from its own checkpoints, checkpoint bookkeeping."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from raystudy.core.finetune import FinetuneConfig, train_local
from raystudy.core.finetune.checkpoint import checkpoint_steps
from raystudy.core.finetune.driver import InjectedFailure
from raystudy.distributed.inprocess import run_in_process
from raystudy.distributed.train import TrainResources
from tests.support.stores import make_store

TINY = dict(patch_size=8, embed_dim=48, depth=3, num_heads=4)
RESULTS = ("status", "best_val_acc", "best_val_step", "test_acc", "final_val_loss", "final_train_loss",
           "steps_completed", "trainable_params")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("inproc") / "store", n_per_split=(24, 8, 12))


def cfg_for(store, out, **kw) -> FinetuneConfig:
    base = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, out_dir=str(out),
                configuration="MHA", steps=6, batch_size=8, eval_period=2, log_period=1, lr=0.1, checkpoint_period=2,
                shuffle=True, augment=True, seed=3)
    base.update(kw)
    return FinetuneConfig(**base)


RES = TrainResources(cpus_per_worker=1, cleanup_checkpoints=False)


@pytest.fixture
def one_thread():
    """run_in_process uses int(cpus_per_worker) threads; the plain loop must sum in the same order."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_same_numbers_as_the_plain_loop(store, tmp_path, one_thread):
    reference, _ = train_local(cfg_for(store, tmp_path / "local"), tensorboard=False)
    reports = []
    summary = run_in_process(cfg_for(store, tmp_path / "actor"), RES, storage=str(tmp_path / "ckpt"),
                             on_report=reports.append)
    assert {k: summary[k] for k in RESULTS} == {k: reference[k] for k in RESULTS}
    assert summary["execution"] == "actor" and summary["workers"] == 1 and summary["num_restores"] == 0
    # outputs as a Ray Train run writes them
    written = json.loads((tmp_path / "actor" / "summary.json").read_text())
    assert written["test_acc"] == reference["test_acc"] and written["execution"] == "actor"
    assert (tmp_path / "actor" / "best_trainable.safetensors").is_file()
    assert len(pd.read_parquet(tmp_path / "actor" / "curves.parquet")) == 6
    # a report per logged step (log_period 1), then the final one
    assert [r["step"] for r in reports] == [1, 2, 3, 4, 5, 6, 6] and reports[-1]["final"] is True
    # checkpoints at steps 2 and 4 (not at the last step), both kept (keep_checkpoints 2)
    assert checkpoint_steps(str(tmp_path / "ckpt")) == [2, 4]


def test_an_injected_failure_resumes_exactly(store, tmp_path, faults):
    uninterrupted = run_in_process(cfg_for(store, tmp_path / "a"), RES, storage=str(tmp_path / "ca"))
    faults(fail_after_step={"b": 3})
    with pytest.raises(InjectedFailure):
        run_in_process(cfg_for(store, tmp_path / "b"), RES, storage=str(tmp_path / "cb"))
    assert checkpoint_steps(str(tmp_path / "cb")) == [2]
    resumed = run_in_process(cfg_for(store, tmp_path / "b"), RES, storage=str(tmp_path / "cb"))
    assert resumed["num_restores"] == 1 and resumed["restored_from_step"] == 2
    assert {k: resumed[k] for k in RESULTS} == {k: uninterrupted[k] for k in RESULTS}
    a = pd.read_parquet(tmp_path / "a" / "curves.parquet")
    b = pd.read_parquet(tmp_path / "b" / "curves.parquet")
    pd.testing.assert_frame_equal(a.drop(columns="images_per_s"), b.drop(columns="images_per_s"))


def test_incomplete_and_corrupt_checkpoints_are_never_resumed(store, tmp_path, caplog):
    storage = tmp_path / "ckpt"
    run_in_process(cfg_for(store, tmp_path / "first"), RES, storage=str(storage))
    assert checkpoint_steps(str(storage)) == [2, 4]
    good = storage / "checkpoint_00000002"
    # a newer checkpoint cut short by a full disk: its state file truncated, marker present
    bad = storage / "checkpoint_00000004"
    (bad / "state.pt").write_bytes((good / "state.pt").read_bytes()[:100])
    # an even newer one without its marker (the writer died before finishing it)
    (storage / "checkpoint_00000005").mkdir()
    (storage / "checkpoint_00000005" / "state.pt").write_bytes(b"")
    assert checkpoint_steps(str(storage)) == [2, 4]
    summary = run_in_process(cfg_for(store, tmp_path / "first"), RES, storage=str(storage))
    assert summary["restored_from_step"] == 2 and summary["status"] == "ok"
    assert "skipping checkpoint" in caplog.text and "checkpoint_00000004" in caplog.text
    # the marker-less folder was removed by the next save; the two newest complete ones stay
    assert not (storage / "checkpoint_00000005").exists()
    assert checkpoint_steps(str(storage)) == [2, 4]
    assert (storage / "checkpoint_00000004" / "state.pt").stat().st_size > 100  # rewritten whole


def test_checkpoints_are_deleted_when_the_run_ends(store, tmp_path):
    storage = tmp_path / "ckpt"
    summary = run_in_process(cfg_for(store, tmp_path / "run"), TrainResources(cpus_per_worker=1),
                             storage=str(storage))
    assert summary["status"] == "ok" and not storage.exists()


def test_more_than_one_worker_is_refused(store, tmp_path):
    with pytest.raises(ValueError, match="TrainResources.workers=2"):
        run_in_process(cfg_for(store, tmp_path / "run"), TrainResources(workers=2), storage=str(tmp_path / "c"))
    assert not Path(tmp_path / "run" / "summary.json").exists()
