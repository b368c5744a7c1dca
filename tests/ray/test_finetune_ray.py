"""Finetuning on Ray Train (CPU, gloo): DDP exactness, freezing, exact resume after a worker failure and from
an older version's Ray checkpoint, divergence through the CLI. Five Ray Train runs in all (start-up dominates:
~20-30 s each); their reference is the single-process loop in one thread, as a one-worker Ray Train run has."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from raystudy.core.finetune import FinetuneConfig, build_finetune_model, fingerprint, select_for, train_local
from raystudy.distributed.train import TrainResources
from tests.support.stores import make_store
from tests.unit.core.test_finetune import read_hparams

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4)
D = 48


@pytest.fixture(scope="module", autouse=True)
def fast_controller_polls():
    """``ray.train.report`` blocks until the controller has taken the previous report, and the controller
    polls every 2 s: with a report per 0.1 s step that throttles these tests. Ray Train propagates this
    variable from the driver to the controller of every run started while it is set (these tests only)."""
    import os

    old = os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    yield
    if old is None:
        del os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]
    else:
        os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = old


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("ftray") / "store", n_per_split=(24, 8, 12))


def cfg_for(store, out, **kw) -> FinetuneConfig:
    base = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, out_dir=str(out),
                configuration="MHA", optimizer="sgd", lr=0.1, seed=0, steps=6, batch_size=8, eval_period=3,
                log_period=1, checkpoint_period=3, shuffle=False, augment=False, save_final=True)
    base.update(kw)
    return FinetuneConfig(**base)


@pytest.fixture(scope="module")
def baseline(store, tmp_path_factory):
    """The reference of the Ray Train runs: the single-process loop, global batch 8, in one thread as a Ray
    Train worker with one CPU runs (so that a one-worker run equals it to the last bit)."""
    cfg = cfg_for(store, tmp_path_factory.mktemp("base") / "run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary, ft = train_local(cfg, tensorboard=False)
    finally:
        torch.set_num_threads(threads)
    return cfg, summary, ft


def curves(cfg) -> pd.DataFrame:
    return pd.read_parquet(Path(cfg.out_dir) / "curves.parquet")


def final_model(cfg) -> dict[str, torch.Tensor]:
    return load_file(Path(cfg.out_dir) / "final_model.safetensors")


def init_model(cfg) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_finetune_model(cfg, 10).state_dict().items()}


def trainable_names(cfg) -> set[str]:
    model = build_finetune_model(cfg, 10)
    return set(select_for(model, cfg).names)


def assert_frozen_exact(cfg):
    init, final, trainable = init_model(cfg), final_model(cfg), trainable_names(cfg)
    assert set(init) == set(final)
    for n in init:
        if n in trainable:
            assert not torch.equal(final[n], init[n]), f"{cfg.configuration}: trainable {n} unchanged"
        else:
            assert torch.equal(final[n], init[n]), f"{cfg.configuration}: frozen {n} changed"


def rel_close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    return float((a - b).norm() / b.norm().clamp_min(1e-12)) <= rtol


def test_ddp_two_workers_equal_one_worker_with_twice_the_batch(ray_session, baseline, store, tmp_path):
    """2 workers x 4 images (micro-batches of 2, so also gradient accumulation) == 1 worker x 8 images."""
    from raystudy.distributed.train import run_finetune

    base_cfg, base, ft = baseline
    cfg = cfg_for(store, tmp_path / "ddp", micro_batch_size=2)
    summary = run_finetune(cfg, TrainResources(workers=2))
    assert base["status"] == summary["status"] == "ok" and summary["workers"] == 2
    a, b = curves(base_cfg), curves(cfg)
    assert a["step"].tolist() == b["step"].tolist() == list(range(1, 7))
    for col in ("train_loss", "grad_norm", "component_grad_norm", "lr_now"):
        torch.testing.assert_close(torch.tensor(b[col].values), torch.tensor(a[col].values), rtol=1e-5, atol=0)
    fa, fb = final_model(base_cfg), final_model(cfg)
    for n, p in ft.trained.trainable:
        assert torch.equal(fa[n], p.detach()), n  # the single-process run's saved weights are its own
    for n in trainable_names(cfg):
        assert rel_close(fb[n], fa[n], 1e-5), n
    for k in ("best_val_acc", "test_acc"):
        assert summary[k] == base[k]
    assert summary["final_val_loss"] == pytest.approx(base["final_val_loss"], rel=1e-5)
    # freezing holds on the Ray Train path with DDP, and in the single process
    assert_frozen_exact(base_cfg)
    assert_frozen_exact(cfg)
    # outputs of the Ray run
    assert read_hparams(Path(cfg.out_dir) / "tb")["configuration"] == "MHA"
    mha = (3 * D * D + 3 * D + D * D + D) * 3 + D * 10 + 10  # the tiny ViT's MHA in 3 blocks + the head
    assert summary["trainable_params"] == mha and summary["grad_memory_bytes"] == 4 * mha
    saved = json.loads((Path(cfg.out_dir) / "config.json").read_text())
    assert saved["resources"]["workers"] == 2 and saved["configuration"] == "MHA"


def _checkpoint_at(run_dir: Path, step: int) -> Path:
    for d in sorted((run_dir / "ray" / "train").glob("checkpoint_*")):
        state = d / "state.pt"
        if state.is_file() and torch.load(state, weights_only=True)["step"] == step:
            return d
    raise AssertionError(f"no checkpoint of step {step} under {run_dir}")


def test_resume_with_shuffling_restores_optimizer_schedule_and_rng(store, tmp_path, faults):
    """Shuffled, augmented, AdamW, 2 workers: a worker raises after its checkpoint at step 4,
    FailureConfig(max_failures=1) restarts the workers from it, and they continue at step 5 with the checkpointed
    optimizer, schedule and RNG state and end with the uninterrupted (single-process) run's metrics and weights.
    The configuration is a mask of single weights (``magnitude:3%:weights``, its file written here): under DDP's
    gradient reduction, AdamW's weight decay and the restart, every entry outside it stays bit-identical. (Not
    ``random:B:weights``: it may draw key biases, whose gradient is zero but for rounding, which AdamW's
    normalisation turns into steps of either sign, so that DDP's sums and one process's differ there.)"""
    from raystudy.core.expressions import unit_parameters
    from raystudy.core.finetune.masks import top_elements, write_masks
    from raystudy.distributed.train import run_finetune

    init = init_model(cfg_for(store, tmp_path, seed=1))
    names = [n for ps in unit_parameters(build_finetune_model(cfg_for(store, tmp_path), 10)).values() for n, _ in ps]
    masks = top_elements({n: init[n].abs() for n in names}, 95_040 * 3 // 100)
    write_masks(str(tmp_path / "mask.safetensors"), masks)
    kw = dict(configuration="magnitude:3%:weights", selection_mask=str(tmp_path / "mask.safetensors"),
              optimizer="adamw", lr=3e-3, steps=8, eval_period=4, checkpoint_period=4, shuffle=True, augment=True,
              seed=1)
    faults(fail_after_step={"shuffled": 4})
    cfg = cfg_for(store, tmp_path / "shuffled", **kw)
    summary = run_finetune(cfg, TrainResources(workers=2, max_failures=1, cleanup_checkpoints=False))
    assert summary["status"] == "ok" and summary["num_restores"] == 1 and summary["restored_from_step"] == 4
    restores = json.loads((Path(cfg.out_dir) / "restores.json").read_text())
    ckpt = _checkpoint_at(Path(cfg.out_dir), 4)
    saved = torch.load(ckpt / "state.pt", weights_only=True)
    info = restores[0]
    assert info["step"] == 4 and info["scheduler_last_epoch"] == 4
    assert info["optimizer"] == fingerprint(saved["optimizer"])
    assert info["scheduler"] == fingerprint(saved["scheduler"])
    assert info["trainable"] == fingerprint(saved["trainable"])
    assert info["rng"] == fingerprint(torch.load(ckpt / "rng_rank0.pt", weights_only=True))
    assert (ckpt / "rng_rank1.pt").is_file()
    assert (ckpt / ".complete").read_text() == "4\n"  # the one checkpoint layout, in the Ray Train run's folder
    run_dir = Path(cfg.out_dir) / "ray" / "train"  # and only it: Ray wrote no checkpoint_<date>/ copies
    assert ckpt == run_dir / "checkpoint_00000004"
    assert sorted(p.name for p in run_dir.glob("checkpoint*")) == ["checkpoint_00000004"]
    assert saved["data"]["samples_seen"] == 32 and saved["data"]["shuffle"]
    b = curves(cfg)
    assert b["step"].tolist() == list(range(1, 9))  # every step exactly once: continued at step 5
    # the same run without failure, single process (batch 8 on one worker): equal up to DDP's float sums
    ref_cfg = cfg_for(store, tmp_path / "ref", **kw)
    ref, ft = train_local(ref_cfg, tensorboard=False)
    a = curves(ref_cfg)
    for col in ("train_loss", "grad_norm", "lr_now", "val_loss", "val_acc"):
        torch.testing.assert_close(torch.tensor(b[col].values), torch.tensor(a[col].values), rtol=1e-5, atol=0,
                                   equal_nan=True)
    for k in ("best_val_acc", "best_val_step", "test_acc", "final_val_loss", "steps_completed"):
        assert summary[k] == pytest.approx(ref[k], rel=1e-5), k
    fb = final_model(cfg)
    for n, p in ft.trained.trainable:
        assert rel_close(fb[n], p.detach(), 1e-5), n
    assert_frozen_exact(cfg)
    assert summary["selection_entries"] == 95_040 * 3 // 100 and summary["trainable_params"] == 2851 + D * 10 + 10
    for n, m in masks.items():  # the entries outside the mask, inside the tensors it touches: bit for bit
        assert torch.equal(fb[n][~m], init[n][~m]), n
        assert bool((fb[n][m] != init[n][m]).all()), n  # AdamW moves every trained entry


def test_a_rerun_resumes_from_an_older_versions_ray_checkpoint(ray_session, baseline, store, tmp_path, faults):
    """A run that failed (no retries) keeps its checkpoint; turned into what an older version left (Ray's
    ``checkpoint_<date>/`` folder and Ray's snapshot naming it), a re-run of the same command upgrades it into
    the one layout before Ray starts, resumes from it and ends with the uninterrupted run's numbers."""
    from raystudy.distributed.train import run_finetune

    base_cfg, base, _ = baseline
    faults(fail_after_step={"again": 3})
    cfg = cfg_for(store, tmp_path / "again")
    failed = run_finetune(cfg, TrainResources(max_failures=0))
    run_dir = Path(cfg.out_dir) / "ray" / "train"
    assert failed["status"] == "failed" and (run_dir / "checkpoint_00000003" / ".complete").is_file()
    old = "checkpoint_2026-12-01_10-00-00.123456"
    (run_dir / "checkpoint_00000003").rename(run_dir / old)
    (run_dir / "checkpoint_manager_snapshot.json").write_text(json.dumps(
        {"checkpoint_results": [{"checkpoint_dir_name": old, "metrics": {}}]}))
    summary = run_finetune(cfg, TrainResources(max_failures=0))
    assert summary["status"] == "ok" and summary["restored_from_step"] == 3 and summary["num_restores"] == 1
    for k in ("best_val_acc", "best_val_step", "test_acc", "final_val_loss", "final_train_loss"):
        assert summary[k] == base[k], k
    a, b = curves(base_cfg), curves(cfg)
    assert b["step"].tolist() == list(range(1, 7))
    assert a.drop(columns="images_per_s").equals(b.drop(columns="images_per_s"))
    assert not run_dir.exists()  # the finished run's checkpoints are cleaned up


def test_divergence_through_the_cli(ray_session, store, tmp_path, capsys):
    """Both DDP workers see the same all-reduced non-finite loss, stop at the same step, and the run is
    recorded as diverged (exit code 0, no exception, no hang)."""
    from raystudy.cli import main

    out = tmp_path / "div"
    rc = main(["finetune", "--store", store, "--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(TINY),
               "--img-size", "32", "--config", "MHA", "--optimizer", "sgd", "--lr", "1e30", "--seed", "0",
               "--steps", "5", "--batch-size", "8", "--eval-period", "2", "--log-period", "1", "--workers", "2",
               "--out", str(out)])
    assert rc == 0
    assert not (out / "ray" / "train").exists()  # a finished run's checkpoints are cleaned up
    printed = capsys.readouterr().out
    assert "diverged" in printed
    assert re.search(r"^step 1/5  loss \S+  lr \S+  \S+ img/s", printed, re.M)  # progress while it ran
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "diverged" and 1 <= summary["diverged_step"] <= 5
    c = pd.read_parquet(out / "curves.parquet")
    last = c.iloc[-1]
    assert last["step"] == summary["diverged_step"]
    assert not (math.isfinite(last["train_loss"]) and math.isfinite(last["grad_norm"]))
