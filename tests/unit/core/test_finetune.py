"""Finetuning core (pure PyTorch, no Ray): protocol, freezing, exact data order, step math, resume, outputs."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from raystudy.core.finetune import (
    MOVED_KEYS,
    DirectoryCheckpointer,
    FinetuneConfig,
    Finetuner,
    MicroBatches,
    Reporter,
    SplitData,
    analytic_memory,
    build_finetune_model,
    checkpoint_steps,
    fingerprint,
    global_batch,
    make_optimizer,
    make_scheduler,
    measured_memory,
    run,
    train_local,
    train_step,
    warmup_cosine,
)
from raystudy.core.finetune.checkpoint import upgrade_layout
from raystudy.core.finetune.driver import failed_summary
from raystudy.distributed.train import TrainResources, run_config_dict, split_legacy
from raystudy.vocab import CONFIGURATIONS, RUN_CURVE_COLUMNS, columns
from tests.support.runs import kill_at_first_checkpoint
from tests.support.stores import make_store

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4)
D, H, L, C = 48, 192, 3, 10


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("ft") / "store", n_per_split=(24, 8, 12))


def tiny_cfg(store, out, **kw) -> FinetuneConfig:
    base = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, out_dir=str(out),
                steps=4, batch_size=8, eval_period=2, log_period=1, lr=0.1, shuffle=False, augment=False)
    base.update(kw)
    return FinetuneConfig(**base)


# ---------------------------------------------------------------------------------------------------
# Protocol defaults and validation
# ---------------------------------------------------------------------------------------------------


def test_defaults_are_the_papers_protocol():
    cfg = FinetuneConfig()
    assert (cfg.optimizer, cfg.momentum, cfg.weight_decay, cfg.betas) == ("sgd", 0.9, 0.0, (0.9, 0.999))
    assert (cfg.steps, cfg.batch_size, cfg.img_size, cfg.clip_norm) == (10_000, 512, 224, 1.0)
    assert cfg.warmup == 2000  # 20% of 10,000, the paper's 2000 warmup steps
    assert FinetuneConfig(steps=2500).warmup == 500  # low-data variant keeps the fraction
    assert not cfg.train_final_norm
    # speed settings (issue 13): precision by device, the uint8 cache, no compile unless asked
    assert cfg.precision == "auto" and cfg.data_path == "cache" and not cfg.compile
    assert cfg.resolved_precision("cpu") == "fp32" and cfg.resolved_precision("cuda") == "bf16"
    assert FinetuneConfig(precision=None).resolved_precision("cuda") == "bf16"  # an older config's None: auto
    assert FinetuneConfig(precision="fp32").resolved_precision("cuda") == "fp32"
    assert FinetuneConfig(precision="bf16").resolved_precision("cpu") == "bf16"


@pytest.mark.parametrize("kw, field", [
    (dict(configuration="Attn"), "configuration"),
    (dict(optimizer="adam"), "optimizer"),
    (dict(lr=-1.0), "lr"),
    (dict(model_kwargs=dict(img_size=64)), "img_size"),
    (dict(warmup_steps=99), "warmup_steps"),
    (dict(store=""), "store"),
    (dict(precision="fp16"), "precision"),
    (dict(data_path="jpeg"), "data_path"),
])
def test_validation_names_the_field(kw, field):
    base = dict(store="/somewhere", steps=10, img_size=32)
    base.update(kw)
    with pytest.raises(ValueError, match=f"FinetuneConfig.{field}"):
        FinetuneConfig(**base).validate()


def test_the_global_batch_must_split_over_the_workers():
    cfg = FinetuneConfig(store="/somewhere", batch_size=10)
    with pytest.raises(ValueError, match="TrainResources.workers=3"):
        TrainResources(workers=3).validate(cfg)
    assert TrainResources(workers=5).validate(cfg).workers == 5
    with pytest.raises(ValueError, match="over the 3 workers"):  # checked before the store is read
        Finetuner(cfg, world_size=3)
    with pytest.raises(ValueError, match="TrainResources.keep_checkpoints"):
        TrainResources(keep_checkpoints=0).validate()


def test_config_dict_roundtrip():
    cfg = FinetuneConfig(store="s", model_kwargs=TINY, img_size=32, betas=(0.8, 0.99))
    assert FinetuneConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown FinetuneConfig field"):
        FinetuneConfig.from_dict({"store": "s", "bogus": 1})
    res = TrainResources(workers=2, gpus_per_worker=0.5, max_failures=3, cleanup_checkpoints=False)
    assert split_legacy(json.loads(json.dumps(run_config_dict(cfg, res)))) == (cfg, res)


OLD_CONFIG_JSON = {  # a run's config.json as written before the protocol and the resources were split
    "model": "vit_tiny_patch16_224", "store": "s", "component": "FC1", "optimizer": "adamw", "lr": 0.003,
    "seed": 0, "steps": 8, "batch_size": 6, "eval_period": 3, "warmup_steps": None, "img_size": 32,
    "workers": 2, "gpus_per_worker": 0.0, "cpus_per_worker": 2.0, "out_dir": "runs/x", "weights": None,
    "pretrained": False, "num_classes": None, "amp_bf16": False, "train_final_norm": False, "augment": True,
    "shuffle": True, "checkpoint_period": 4, "max_failures": 1, "model_kwargs": TINY, "micro_batch_size": None,
    "log_period": 1, "momentum": 0.9, "betas": [0.9, 0.999], "weight_decay": 0.0, "clip_norm": 1.0,
    "head_init": "trunc_normal", "include_layerscale": False, "eval_batch_size": 256, "eval_cache_mb": 512,
    "loader_workers": 0, "keep_checkpoints": 3, "cleanup_checkpoints": False, "save_final": False,
    "fail_after_step": 4,
}


def test_an_old_config_json_still_loads():
    cfg, res = split_legacy(OLD_CONFIG_JSON)
    assert (cfg.data_path, cfg.precision) == ("decode", "fp32")  # what such a run did
    assert split_legacy({**OLD_CONFIG_JSON, "amp_bf16": True})[0].precision == "bf16"  # the older spelling
    assert split_legacy({**OLD_CONFIG_JSON, "precision": None})[0].precision == "auto"
    with pytest.raises(ValueError, match="FinetuneConfig.amp_bf16: True contradicts precision: fp32"):
        FinetuneConfig.from_dict({**OLD_CONFIG_JSON, "amp_bf16": True, "precision": "fp32"})
    assert (cfg.configuration, cfg.optimizer, cfg.lr, cfg.steps, cfg.batch_size) == ("FC1", "adamw", 0.003, 8, 6)
    assert res == TrainResources(workers=2, gpus_per_worker=0.0, cpus_per_worker=2.0, max_failures=1,
                                 keep_checkpoints=3, cleanup_checkpoints=False)
    assert FinetuneConfig.from_dict(OLD_CONFIG_JSON) == cfg  # the core alone drops the moved keys
    assert {f for f in res.to_dict()} | {"fail_after_step"} == set(MOVED_KEYS)
    assert not hasattr(cfg, "fail_after_step") and not hasattr(cfg, "workers")


def test_warmup_cosine_schedule_matches_closed_form():
    w, total, lr = 3, 10, 0.5
    expected = [lr * (s + 1) / w for s in range(w)]
    expected += [lr * 0.5 * (1 + math.cos(math.pi * (s - w) / (total - w))) for s in range(w, total)]
    p = torch.nn.Parameter(torch.zeros(1))
    cfg = FinetuneConfig(store="s", steps=total, warmup_steps=w, lr=lr)
    opt = make_optimizer([p], cfg)
    sched = make_scheduler(opt, cfg)
    got = []
    for _ in range(total):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert got[w - 1] == pytest.approx(lr) and got[-1] > 0
    assert warmup_cosine(0, 0, 10) == 1.0  # no warmup: cosine from the first step


# ---------------------------------------------------------------------------------------------------
# Data order
# ---------------------------------------------------------------------------------------------------


def test_global_batches_cover_each_epoch_exactly_once():
    n, b = 10, 4
    for shuffle in (False, True):
        seq = np.concatenate([global_batch(s, n=n, batch_size=b, seed=3, shuffle=shuffle)[0] for s in range(5)])
        epochs = np.concatenate([global_batch(s, n=n, batch_size=b, seed=3, shuffle=shuffle)[1] for s in range(5)])
        assert np.array_equal(epochs, np.arange(20) // n)
        assert sorted(seq[:10]) == list(range(10)) and sorted(seq[10:]) == list(range(10))
        if not shuffle:
            assert np.array_equal(seq, np.tile(np.arange(n), 2))
    a = np.concatenate([global_batch(s, n=n, batch_size=b, seed=3, shuffle=True)[0] for s in range(5)])
    c = np.concatenate([global_batch(s, n=n, batch_size=b, seed=4, shuffle=True)[0] for s in range(5)])
    assert not np.array_equal(a[:10], a[10:]) and not np.array_equal(a, c)  # epochs and seeds differ


def test_worker_slices_equal_the_single_worker_batch(store, tmp_path):
    """2 workers x 4 images (micro-batches of 2) load exactly the tensors of 1 worker x 8, augmentation on."""
    data = SplitData(store, "train")
    one = MicroBatches(data, tiny_cfg(store, tmp_path, shuffle=True, augment=True), 0, 2)
    two = [MicroBatches(data, tiny_cfg(store, tmp_path, shuffle=True, augment=True, micro_batch_size=2), r, 2,
                        world_size=2) for r in (0, 1)]
    x1, y1 = one[0]
    parts = [two[r][k] for r in (0, 1) for k in (0, 1)]  # step 2 = item 0..1 of each worker
    assert torch.equal(torch.cat([p[0] for p in parts]), x1) and torch.equal(torch.cat([p[1] for p in parts]), y1)
    assert x1.shape == (8, 3, 32, 32)
    x_next, _ = one[1]
    assert not torch.equal(x_next, x1)


# ---------------------------------------------------------------------------------------------------
# Freezing, parameter counts, memory
# ---------------------------------------------------------------------------------------------------

EXPECTED_COUNTS = {  # independent of the registry: the tiny ViT's shapes, per block times depth, + head
    "LN1": 2 * D * L, "LN2": 2 * D * L, "MHA": (3 * D * D + 3 * D + D * D + D) * L,
    "FC1": (D * H + H) * L, "FC2": (H * D + D) * L, "Head": 0,
    "Emb": 3 * 8 * 8 * D + D + D + 17 * D,  # patch projection (8 px patches) + bias, cls token, 17 positions
}


@pytest.mark.parametrize("config", CONFIGURATIONS)
def test_freezing_is_exact(store, tmp_path, config):
    cfg = tiny_cfg(store, tmp_path, configuration=config, steps=3, eval_period=10)
    ft = Finetuner(cfg)
    init = {n: p.detach().clone() for n, p in ft.model.named_parameters()}
    ft.run(progress=False)
    trainable = set(ft.trained.names)
    head = {n for n in init if n.startswith("head.")}
    assert head <= trainable
    for n, p in ft.model.named_parameters():
        if n in trainable:
            assert not torch.equal(p.detach(), init[n]), f"{config}: trainable {n} did not change"
        else:
            assert torch.equal(p.detach(), init[n]), f"{config}: frozen {n} changed"
            assert p.grad is None
    total = sum(t.numel() for t in init.values())
    expected = (total if config == "All" else EXPECTED_COUNTS[config] + D * C + C)
    assert ft.trained.num_trainable == expected
    if config in ("MHA", "FC1"):
        assert all(n.startswith("blocks.") or n.startswith("head.") for n in trainable)
    if config != "All":
        assert not any(n.startswith("norm.") for n in trainable)  # final norm frozen by default


def test_train_final_norm_option(store, tmp_path):
    ft = Finetuner(tiny_cfg(store, tmp_path, configuration="LN1", train_final_norm=True))
    assert {"norm.weight", "norm.bias"} <= set(ft.trained.names)
    assert ft.trained.num_trainable == EXPECTED_COUNTS["LN1"] + 2 * D + D * C + C


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_memory_measured_equals_analytic(store, tmp_path, optimizer):
    ft = Finetuner(tiny_cfg(store, tmp_path, configuration="FC2", optimizer=optimizer))
    assert measured_memory(ft.trainable, ft.optimizer) == {"grad_bytes": 0, "optimizer_bytes": 0}
    x, y = ft.train_data.load(np.arange(8), size=32, train=False)
    train_step(ft.net, ft.optimizer, ft.scheduler, [(x, y)], share=8, trainable=ft.trainable, group=ft.group)
    got = measured_memory(ft.trainable, ft.optimizer)
    p = EXPECTED_COUNTS["FC2"] + D * C + C
    assert got["grad_bytes"] == 4 * p
    # SGD: one momentum buffer; AdamW: two moments plus one float32 ``step`` scalar per tensor
    extra = 0 if optimizer == "sgd" else 4 * len(ft.trainable)
    assert got["optimizer_bytes"] == (1 if optimizer == "sgd" else 2) * 4 * p + extra
    assert analytic_memory(p, optimizer) == {"grad_bytes": 4 * p,
                                             "optimizer_bytes": (1 if optimizer == "sgd" else 2) * 4 * p}


# ---------------------------------------------------------------------------------------------------
# The step: accumulation, grad norms, clipping
# ---------------------------------------------------------------------------------------------------


def test_train_step_norms_clipping_and_accumulation(store, tmp_path):
    cfg = tiny_cfg(store, tmp_path, configuration="MHA", lr=0.05, warmup_steps=0)
    ft = Finetuner(cfg)
    x, y = ft.train_data.load(np.arange(8), size=32, train=False)
    before = {n: p.detach().clone() for n, p in ft.trained.trainable}
    # independent reference: gradient of the mean loss over the batch
    loss = F.cross_entropy(ft.model(x), y)
    loss_value = loss.item()
    grads = torch.autograd.grad(loss, ft.trainable)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    comp = {n for n, _ in ft.trained.component}
    comp_norm = torch.sqrt(sum((g.double() ** 2).sum() for (n, _), g in zip(ft.trained.trainable, grads)
                               if n in comp))
    micro = [(x[i:i + 3], y[i:i + 3]) for i in range(0, 8, 3)]  # 3 + 3 + 2: uneven accumulation
    res = train_step(ft.net, ft.optimizer, ft.scheduler, micro, share=8, trainable=ft.trainable, group=ft.group,
                     clip_norm=1.0)
    assert res.finite and res.lr == pytest.approx(0.05)
    assert res.loss == pytest.approx(loss_value, rel=1e-6)
    assert res.grad_norm == pytest.approx(float(norm), rel=1e-5)
    assert res.component_grad_norm == pytest.approx(float(comp_norm), rel=1e-5)
    assert float(norm) > 1.0  # so clipping is active
    scale = 1.0 / (float(norm) + 1e-6)
    for (n, p), g in zip(ft.trained.trainable, grads):  # first SGD step: momentum buffer = clipped grad
        torch.testing.assert_close(p.detach(), before[n] - 0.05 * scale * g, rtol=1e-5, atol=1e-7)


def test_divergence_is_recorded_not_raised(store, tmp_path):
    # evaluation only at the last step, which a diverged run never reaches: no validation result at all
    summary, ft = train_local(tiny_cfg(store, tmp_path, lr=1e30, steps=6, eval_period=10), tensorboard=False)
    assert summary["status"] == "diverged"
    assert 1 <= summary["diverged_step"] <= 6 and summary["steps_completed"] == summary["diverged_step"]
    last = ft.curves[-1]
    assert last["step"] == summary["diverged_step"]
    assert not (math.isfinite(last["train_loss"]) and math.isfinite(last["grad_norm"]))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "diverged"
    # nulls, not -1 sentinels, where the run has no value
    assert saved["best_val_step"] is None and saved["restored_from_step"] is None
    assert math.isnan(saved["best_val_acc"]) and math.isnan(saved["test_acc"])
    assert not (tmp_path / "best_trainable.safetensors").exists()


def test_failed_summary_has_every_key_of_a_summary_with_nulls(store, tmp_path):
    cfg = tiny_cfg(store, tmp_path, configuration="LN2", steps=2)
    summary, _ = train_local(cfg, tensorboard=False, write=False)
    failed = failed_summary(cfg, RuntimeError("workers died"))
    assert set(summary) <= set(failed)
    assert failed["status"] == "failed" and failed["error"] == "RuntimeError: workers died"
    assert failed["trainable_params"] == EXPECTED_COUNTS["LN2"] + D * C + C  # the model could be built
    assert failed["best_val_step"] is None and failed["steps_completed"] is None
    assert math.isnan(failed["best_val_acc"]) and math.isnan(failed["test_acc"])
    assert (failed["configuration"], failed["model_kwargs"], failed["num_classes"]) == ("LN2", TINY, C)
    no_store = failed_summary(tiny_cfg(tmp_path / "missing", tmp_path), "store gone")
    assert no_store["trainable_params"] is None and no_store["error"] == "store gone"


# ---------------------------------------------------------------------------------------------------
# Resume and outputs
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data_path", ["cache", "decode"])
def test_resume_is_exact_with_shuffling_and_augmentation(store, tmp_path, data_path):
    """Killed after its checkpoint at step 4, a resumed run reproduces the uninterrupted one bitwise and
    restarts from the checkpointed optimizer, schedule and RNG state, on either data path."""
    kw = dict(configuration="FC1", optimizer="adamw", lr=3e-3, steps=8, eval_period=3, checkpoint_period=4,
              shuffle=True, augment=True, batch_size=6, data_path=data_path)
    ref, ref_ft = train_local(tiny_cfg(store, tmp_path / "ref", **kw), tensorboard=False)

    cfg = tiny_cfg(store, tmp_path / "run", **kw)
    ckdir = tmp_path / "run" / "ckpt"
    first = Finetuner(cfg)
    torch.manual_seed(123)  # any RNG state: it must come back from the checkpoint

    kill_at_first_checkpoint(first, ckdir)
    assert first.step == 4
    torch.manual_seed(999)
    summary, ft = train_local(cfg, checkpoint_dir=ckdir, resume=True)

    saved = torch.load(ckdir / "checkpoint_00000004" / "state.pt", weights_only=True)
    rng = torch.load(ckdir / "checkpoint_00000004" / "rng_rank0.pt", weights_only=True)
    info = ft.restores[0]
    assert info["step"] == 4 and info["scheduler_last_epoch"] == 4
    assert info["optimizer"] == fingerprint(saved["optimizer"])
    assert info["scheduler"] == fingerprint(saved["scheduler"])
    assert info["rng"] == fingerprint(rng)
    assert saved["data"]["samples_seen"] == 24 and saved["data"]["epoch"] == 1  # 24 train rows: 1 epoch done
    assert [r["step"] for r in ft.curves] == list(range(1, 9))
    for a, b in zip(ref_ft.curves, ft.curves):  # bitwise, except the wall-clock throughput
        assert {k: v for k, v in a.items() if k != "images_per_s"} == {k: v for k, v in b.items()
                                                                         if k != "images_per_s"}
    for n, p in ref_ft.trained.trainable:
        assert torch.equal(p, dict(ft.trained.trainable)[n])
    for k in ("best_val_acc", "best_val_step", "test_acc", "final_val_loss", "trainable_params", "status"):
        assert summary[k] == ref[k]
    assert summary["num_restores"] == 1 and summary["restored_from_step"] == 4
    assert (summary["data_path"], summary["precision"], summary["compile"]) == (data_path, "fp32", False)
    assert saved["data"]["data_path"] == data_path
    with pytest.raises(ValueError, match="data_path"):  # the other data path would see other crops
        Finetuner(tiny_cfg(store, tmp_path / "run", **{**kw, "data_path": {"cache": "decode"}.get(data_path,
                                                                                                  "cache")})
                  ).load(ckdir / "checkpoint_00000004")


def test_a_checkpoint_of_the_old_format_resumes(store, tmp_path):
    """A checkpoint written before the rename (its config says ``component`` and has neither ``data_path``
    nor ``precision``), with the run's old config.json, resumes on the decode path (the only one then) in
    fp32 and ends where the uninterrupted run ends."""
    kw = dict(configuration="FC1", optimizer="adamw", lr=3e-3, steps=8, eval_period=3, checkpoint_period=4,
              shuffle=True, augment=True, batch_size=6, data_path="decode", precision="fp32")
    ref, ref_ft = train_local(tiny_cfg(store, tmp_path / "ref", **kw), tensorboard=False)
    cfg = tiny_cfg(store, tmp_path / "run", **kw)
    ckdir = tmp_path / "run" / "ckpt"

    first = Finetuner(cfg)
    kill_at_first_checkpoint(first, ckdir)
    path = ckdir / "checkpoint_00000004" / "state.pt"
    state = torch.load(path, weights_only=True)
    state["config"]["component"] = state["config"].pop("configuration")
    del state["config"]["data_path"], state["config"]["precision"]
    torch.save(state, path)
    old = dict(OLD_CONFIG_JSON, store=store, out_dir=str(tmp_path / "run"))
    old_cfg, _ = split_legacy(json.loads(json.dumps(old)))
    assert old_cfg == cfg
    summary, ft = train_local(old_cfg, checkpoint_dir=ckdir, resume=True, tensorboard=False)
    assert summary["restored_from_step"] == 4 and [r["step"] for r in ft.curves] == list(range(1, 9))
    assert [r["train_loss"] for r in ft.curves] == [r["train_loss"] for r in ref_ft.curves]
    assert summary["test_acc"] == ref["test_acc"]
    state["config"]["component"] = "FC2"  # and an old checkpoint of another configuration is refused
    torch.save(state, path)
    with pytest.raises(ValueError, match="configuration"):
        Finetuner(cfg).load(ckdir / "checkpoint_00000004")


class _Killed(Exception):
    pass


class _KillAtFirstCheckpoint(Reporter):
    """Stops the run once its first checkpoint is complete, like a killed process."""

    def report(self, metrics, checkpoint):
        if checkpoint is not None:
            raise _Killed


def test_one_checkpoint_layout_with_a_completion_marker(store, tmp_path):
    """train_local writes checkpoint_XXXXXXXX/ folders with .complete (written last); killed after its first
    one, a re-run resumes from it exactly, never from a folder without its marker (removed by the next save)."""
    kw = dict(configuration="FC1", optimizer="adamw", lr=3e-3, steps=8, eval_period=3, checkpoint_period=2,
              shuffle=True, augment=True, batch_size=6)
    ref, ref_ft = train_local(tiny_cfg(store, tmp_path / "ref", **kw), checkpoint_dir=tmp_path / "ref" / "ck",
                              tensorboard=False)
    assert checkpoint_steps(str(tmp_path / "ref" / "ck")) == [2, 4, 6]
    assert sorted(p.name for p in (tmp_path / "ref" / "ck").iterdir()) == [f"checkpoint_{s:08d}" for s in (2, 4, 6)]
    assert (tmp_path / "ref" / "ck" / "checkpoint_00000004" / ".complete").read_text() == "4\n"

    cfg, ckdir = tiny_cfg(store, tmp_path / "run", **kw), tmp_path / "run" / "ck"
    with pytest.raises(_Killed):
        run(cfg, checkpointer=DirectoryCheckpointer(ckdir), reporter=_KillAtFirstCheckpoint(), tensorboard=False)
    assert checkpoint_steps(str(ckdir)) == [2]
    (ckdir / "checkpoint_00000003").mkdir()  # a writer killed before its marker: never resumed from
    (ckdir / "checkpoint_00000003" / "state.pt").write_bytes(b"")
    torch.manual_seed(999)
    summary, ft = train_local(cfg, checkpoint_dir=ckdir, resume=True, tensorboard=False)
    assert summary["restored_from_step"] == 2 and [r["step"] for r in ft.curves] == list(range(1, 9))
    for a, b in zip(ref_ft.curves, ft.curves):  # bitwise, except the wall-clock throughput
        assert {k: v for k, v in a.items() if k != "images_per_s"} == {k: v for k, v in b.items()
                                                                         if k != "images_per_s"}
    for k in ("best_val_acc", "best_val_step", "test_acc", "final_val_loss", "status"):
        assert summary[k] == ref[k]
    assert not (ckdir / "checkpoint_00000003").exists() and checkpoint_steps(str(ckdir)) == [2, 4, 6]


def _as_older_layout(ckdir, step: int, name: str, marker: bool) -> None:
    """Turn today's checkpoint of ``step`` under ``ckdir`` into a folder of an older version's layout: ``name``
    (``step_XXXXXXXX``: train_local's, no marker; ``checkpoint_<date>``: Ray Train's, marker kept)."""
    folder = ckdir / f"checkpoint_{step:08d}"
    if not marker:
        (folder / ".complete").unlink()
    folder.rename(ckdir / name)


@pytest.mark.parametrize("old_name, marker", [("step_00000002", False),
                                              ("checkpoint_2026-12-01_10-00-00.123456", True)])
def test_a_checkpoint_of_an_older_layout_is_upgraded_and_resumes(store, tmp_path, old_name, marker):
    """A checkpoint folder of an older layout (train_local's ``step_XXXXXXXX`` without marker, Ray Train's
    ``checkpoint_<date>`` with Ray's snapshot beside it) is renamed into today's layout when a run resumes there
    (the snapshot, which names the old folder, deleted) and resumes exactly; nothing of the old layout is left
    or written again."""
    kw = dict(configuration="FC1", optimizer="adamw", lr=3e-3, steps=8, eval_period=3, checkpoint_period=2,
              shuffle=True, augment=True, batch_size=6)
    ref, ref_ft = train_local(tiny_cfg(store, tmp_path / "ref", **kw), tensorboard=False)
    cfg, ckdir = tiny_cfg(store, tmp_path / "run", **kw), tmp_path / "run" / "ck"
    kill_at_first_checkpoint(Finetuner(cfg), ckdir)
    _as_older_layout(ckdir, 2, old_name, marker)
    (ckdir / "checkpoint_manager_snapshot.json").write_text(json.dumps(
        {"checkpoint_results": [{"checkpoint_dir_name": old_name, "metrics": {}}]}))
    assert upgrade_layout(str(ckdir)) == [str(ckdir / "checkpoint_00000002")]
    assert sorted(p.name for p in ckdir.iterdir()) == ["checkpoint_00000002"]
    assert (ckdir / "checkpoint_00000002" / ".complete").read_text() == "2\n"
    _as_older_layout(ckdir, 2, old_name, marker)  # and the same, found by a resume
    summary, ft = train_local(cfg, checkpoint_dir=ckdir, resume=True, tensorboard=False)
    assert summary["restored_from_step"] == 2 and [r["step"] for r in ft.curves] == list(range(1, 9))
    assert [r["train_loss"] for r in ft.curves] == [r["train_loss"] for r in ref_ft.curves]
    assert summary["test_acc"] == ref["test_acc"] and summary["best_val_acc"] == ref["best_val_acc"]
    assert sorted(p.name for p in ckdir.iterdir()) == [f"checkpoint_{s:08d}" for s in (2, 4, 6)]


def test_an_older_folder_of_a_step_already_checkpointed_is_dropped(store, tmp_path):
    """An older layout's folder whose step today's layout holds complete is deleted by the upgrade (today's is
    kept); a Ray folder that holds no checkpoint is moved aside."""
    cfg, ckdir = tiny_cfg(store, tmp_path / "run", steps=4, checkpoint_period=2), tmp_path / "ck"
    kill_at_first_checkpoint(Finetuner(cfg), ckdir)
    shutil.copytree(ckdir / "checkpoint_00000002", ckdir / "step_00000002")
    (ckdir / "checkpoint_2026-12-01_10-00-00.5").mkdir()
    assert upgrade_layout(str(ckdir)) == []
    assert sorted(p.name for p in ckdir.iterdir()) == ["checkpoint_00000002",
                                                       "checkpoint_2026-12-01_10-00-00.5.corrupt-1"]


def test_resume_refuses_another_runs_checkpoint(store, tmp_path):
    cfg = tiny_cfg(store, tmp_path, steps=2)
    ft = Finetuner(cfg)
    ft.save(tmp_path / "ck")
    other = Finetuner(tiny_cfg(store, tmp_path, steps=2, lr=0.2))
    with pytest.raises(ValueError, match="lr"):
        other.load(tmp_path / "ck")


def read_hparams(tb_dir) -> dict:
    """The HParams record of a run's TensorBoard folder: {name: value}, read with TensorBoard's own parser."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(str(tb_dir)).Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    hp = metadata.parse_session_start_info_plugin_data(content)
    return {k: (v.string_value if v.HasField("string_value") else v.number_value) for k, v in hp.hparams.items()}


def test_outputs_summary_curves_tensorboard(store, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary, ft = train_local(tiny_cfg(store, tmp_path, steps=5, eval_period=2, log_period=2, seed=3))
    saved = json.loads((tmp_path / "summary.json").read_text())
    needed = set(columns("trials")) - {"trial_id", "dataset", "model"}
    assert needed <= set(saved) and {"grad_memory_bytes", "optimizer_memory_bytes"} <= set(saved)
    assert "component" not in saved and saved["configuration"] == "MHA" and saved["model_kwargs"] == TINY
    curves = pd.read_parquet(tmp_path / "curves.parquet")
    assert list(curves.columns) == list(RUN_CURVE_COLUMNS)
    assert curves["step"].tolist() == [2, 4, 5]  # log every 2 steps and the last step
    assert curves["val_acc"].notna().tolist() == [True, True, True]  # evals at 2, 4 and the final step
    assert saved["best_val_step"] in (2, 4, 5)
    tb = tmp_path / "tb"
    acc = EventAccumulator(str(tb)).Reload()
    assert {"train/train_loss", "train/grad_norm", "train/component_grad_norm", "val/val_acc",
            "result/test_acc", "result/best_val_acc"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train/train_loss")] == [2, 4, 5]
    assert acc.Scalars("result/test_acc")[0].value == pytest.approx(saved["test_acc"])
    assert (tmp_path / "best_trainable.safetensors").is_file()
    # the HParams record, in the run's own folder (no timestamped sub-folder)
    assert [p for p in tb.iterdir() if p.is_dir()] == []
    assert read_hparams(tb) == {"configuration": "MHA", "optimizer": "sgd", "lr": pytest.approx(0.1), "seed": 3,
                                "steps": 5, "batch_size": 8, "model": "vit_tiny_patch16_224",
                                "model_kwargs": json.dumps(TINY, sort_keys=True),
                                "dataset": "tiny"}  # the store's name (make_store's), as a study gives its dataset


def accuracy(model: torch.nn.Module, state: dict[str, torch.Tensor], split: SplitData) -> float:
    """Accuracy on all of ``split`` of ``model`` with the trainable tensors ``state`` put in."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in state:
                p.copy_(state[n])
    x, y = split.load(np.arange(len(split)), size=32, train=False)
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).double().mean())


def test_best_validation_state_and_its_test_accuracy(store, tmp_path):
    """Recomputed here from the saved states: the val accuracy of the trainable state at every evaluation
    step (checkpoints of steps 2 and 4, the final model of step 6), the best of them (the first on ties),
    the saved best_trainable.safetensors, and its test accuracy."""
    from safetensors.torch import load_file

    cfg = tiny_cfg(store, tmp_path, steps=6, eval_period=2, checkpoint_period=2, lr=0.3, save_final=True)
    summary, ft = train_local(cfg, checkpoint_dir=tmp_path / "ck", tensorboard=False)
    states = {s: torch.load(tmp_path / "ck" / f"checkpoint_{s:08d}" / "state.pt", weights_only=True)["trainable"]
              for s in (2, 4)}
    final = load_file(tmp_path / "final_model.safetensors")
    states[6] = {n: final[n] for n in states[2]}
    model = build_finetune_model(cfg, C)  # frozen parameters as initialised (test_freezing_is_exact)
    val, test = SplitData(store, "val"), SplitData(store, "test")
    val_acc = {s: accuracy(model, state, val) for s, state in states.items()}
    best_step = min(s for s in val_acc if val_acc[s] == max(val_acc.values()))
    assert summary["best_val_step"] == best_step
    assert summary["best_val_acc"] == pytest.approx(val_acc[best_step], abs=1e-12)
    best = load_file(tmp_path / "best_trainable.safetensors")
    assert set(best) == set(states[best_step]) and all(torch.equal(best[n], states[best_step][n]) for n in best)
    assert summary["test_acc"] == pytest.approx(accuracy(model, best, test), abs=1e-12)
    assert len(set(val_acc.values())) > 1 or summary["best_val_step"] == 2  # (ties resolve to the first)


def test_the_summary_counts_the_test_examples(store, tmp_path):
    """``test_examples``: the rows of the test split behind ``test_acc`` (one example moves it by 1/n), counted
    here from the store's own Parquet shards; a per-sample test accuracy is a multiple of 1/n."""
    summary, _ = train_local(tiny_cfg(store, tmp_path, steps=2), tensorboard=False, write=False)
    splits = pd.concat([pd.read_parquet(p, columns=["split"]) for p in sorted(Path(store).rglob("*.parquet"))])
    n = int((splits["split"] == "test").sum())
    assert n == 12 and summary["test_examples"] == n
    assert summary["test_acc"] * n == pytest.approx(round(summary["test_acc"] * n), abs=1e-9)


def test_cli_builds_the_config(store, tmp_path, capsys):
    from raystudy.cli import build_parser
    from raystudy.commands.finetune import config_from_args

    base = ["finetune", "--store", store, "--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(TINY),
            "--img-size", "32", "--optimizer", "adamw", "--lr", "1e-4", "--seed", "2", "--steps", "7",
            "--workers", "2", "--cpus-per-worker", "1.5", "--max-failures", "2", "--batch-size", "8",
            "--out", str(tmp_path), "--no-shuffle"]
    for flag in ("--configuration", "--component", "--config"):  # today's name and the old spellings
        cfg, res = config_from_args(build_parser().parse_args([*base, flag, "LN2"]))
        assert (cfg.configuration, cfg.optimizer, cfg.lr, cfg.seed, cfg.steps) == ("LN2", "adamw", 1e-4, 2, 7)
        assert cfg.model_kwargs == TINY and not cfg.shuffle and cfg.augment and cfg.out_dir == str(tmp_path)
        assert res == TrainResources(workers=2, cpus_per_worker=1.5, max_failures=2)
    fast = config_from_args(build_parser().parse_args([*base, "--configuration", "LN2", "--bf16", "--compile",
                                                       "--data-path", "decode", "--cache-dir", "/c"]))[0]
    assert (fast.precision, fast.compile, fast.data_path, fast.cache_dir) == ("bf16", True, "decode", "/c")
    assert (cfg.precision, cfg.compile, cfg.data_path, cfg.cache_dir) == ("auto", False, "cache", None)
    from raystudy.vocab import DATA_PATHS, PRECISION_CHOICES

    actions = build_parser()._subparsers._group_actions[0].choices["finetune"]._actions
    choices = {a.option_strings[0]: a.choices for a in actions if a.option_strings}
    assert (choices["--precision"], choices["--data-path"]) == (PRECISION_CHOICES, DATA_PATHS)  # the vocabulary's
    with pytest.raises(SystemExit):  # configurations are checked as they are parsed
        build_parser().parse_args([*base, "--configuration", "Attn"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["finetune", "--store", store, "--out", str(tmp_path), "--model-kwargs", "{x"])
    assert "argument --model-kwargs: not valid JSON" in capsys.readouterr().err
    odd = build_parser().parse_args([*base, "--configuration", "LN2", "--workers", "3"])
    with pytest.raises(ValueError, match="TrainResources.workers"):
        config_from_args(odd)


def test_dataloader_processes_give_the_same_run(store, tmp_path):
    """Prefetching micro-batches in DataLoader worker processes changes nothing (augmentation on)."""
    kw = dict(steps=3, eval_period=10, shuffle=True, augment=True, micro_batch_size=3)
    _, a = train_local(tiny_cfg(store, tmp_path / "a", **kw), tensorboard=False, write=False)
    _, b = train_local(tiny_cfg(store, tmp_path / "b", loader_workers=2, **kw), tensorboard=False, write=False)
    assert [r["train_loss"] for r in a.curves] == [r["train_loss"] for r in b.curves]
    for (n, p), (_, q) in zip(a.trained.trainable, b.trained.trainable):
        assert torch.equal(p, q), n


def test_a_run_reads_its_stores_metadata_once(store, tmp_path, monkeypatch):
    """One ``Finetuner`` opens its store once (``data.store.Store``) and hands the object on: building it and
    evaluating on val and test read ``dataset.json`` once (its caches built beforehand, as a study does)."""
    from pathlib import Path

    warm = Finetuner(tiny_cfg(store, tmp_path / "warm"))  # builds the caches
    warm.evaluate("val"), warm.evaluate("test")
    reads = []
    real = Path.read_text

    def spy(self, *args, **kwargs):
        if self.name == "dataset.json":
            reads.append(str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", spy)
    ft = Finetuner(tiny_cfg(store, tmp_path / "run"))
    ft.evaluate("val"), ft.evaluate("test")
    assert reads == [str(Path(store) / "dataset.json")]


def test_head_init_torch_default_is_nn_linears_own_initialisation():
    """``head_init="torch_default"`` (the paper authors' head: the new ``nn.Linear`` as built) draws the
    weight and the bias exactly as ``nn.Linear.reset_parameters`` does from the same seed."""
    from raystudy.core.finetune.selection import reset_head

    model = build_finetune_model(FinetuneConfig(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32,
                                                store="s", out_dir="o"), num_classes=C)
    reset_head(model, seed=3, mode="torch_default")
    torch.manual_seed(10_007 * 3 + 1)  # reset_head's seed, on the global generator nn.Linear draws from
    ref = torch.nn.Linear(D, C)
    torch.testing.assert_close(model.head.weight, ref.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.head.bias, ref.bias, rtol=0, atol=0)
    assert model.head.bias.abs().max() > 0 and model.head.weight.abs().max() <= 1 / D ** 0.5


def _tb_losses(tb_dir) -> list[tuple[int, float]]:
    """``(step, train loss)`` of every event of a TensorBoard folder, as TensorBoard shows them (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return [(e.step, e.value) for e in EventAccumulator(str(tb_dir)).Reload().Scalars("train/train_loss")]


@pytest.mark.parametrize("fresh_folder", [False, True])
def test_a_resumed_run_shows_every_step_once_in_tensorboard(store, tmp_path, fresh_folder):
    """Killed after its first checkpoint and resumed: into the same folder (one file system: the new events
    start after the restored step), or into a fresh one (a trial re-run on another node of a study on object
    storage: the restored rows are written again). Either way TensorBoard shows every curve row once, with the
    resumed run's values, also once the killed attempt's events are merged into the fresh folder (as an upload
    of both attempts to the trial's URI merges them)."""
    kw = dict(optimizer="adamw", lr=3e-3, steps=8, eval_period=3, checkpoint_period=2, log_period=1)
    first, ckdir = tiny_cfg(store, tmp_path / "first", **kw), tmp_path / "ck"
    with pytest.raises(_Killed):
        run(first, checkpointer=DirectoryCheckpointer(ckdir), reporter=_KillAtFirstCheckpoint())
    assert [s for s, _ in _tb_losses(tmp_path / "first" / "tb")] == [1, 2]
    second = dataclasses.replace(first, out_dir=str(tmp_path / "second")) if fresh_folder else first
    summary, ft = run(second, checkpointer=DirectoryCheckpointer(ckdir))
    assert summary["restored_from_step"] == 2
    want = [(r["step"], pytest.approx(r["train_loss"])) for r in ft.curves]
    assert [r["step"] for r in ft.curves] == list(range(1, 9))
    assert _tb_losses(Path(second.out_dir) / "tb") == want
    if fresh_folder:
        for f in (tmp_path / "first" / "tb").iterdir():
            shutil.copy(f, tmp_path / "second" / "tb")
        assert _tb_losses(tmp_path / "second" / "tb") == want
