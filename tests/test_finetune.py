"""Finetuning core (pure PyTorch, no Ray): protocol, freezing, exact data order, step math, resume, outputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import make_store

from raystudy.core.components import CONFIGURATIONS
from raystudy.core.finetune import (
    CURVE_COLUMNS,
    Event,
    FinetuneConfig,
    Finetuner,
    SplitData,
    _MicroBatches,
    analytic_memory,
    fingerprint,
    global_batch,
    make_optimizer,
    make_scheduler,
    measured_memory,
    train_local,
    train_step,
    warmup_cosine,
)
from raystudy.vocab import columns

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
    assert not cfg.amp_bf16 and not cfg.train_final_norm


@pytest.mark.parametrize("kw, field", [
    (dict(component="Attn"), "component"),
    (dict(optimizer="adam"), "optimizer"),
    (dict(batch_size=10, workers=3), "batch_size"),
    (dict(lr=-1.0), "lr"),
    (dict(model_kwargs=dict(img_size=64)), "img_size"),
    (dict(warmup_steps=99), "warmup_steps"),
    (dict(store=""), "store"),
])
def test_validation_names_the_field(kw, field):
    base = dict(store="/somewhere", steps=10, img_size=32)
    base.update(kw)
    with pytest.raises(ValueError, match=f"FinetuneConfig.{field}"):
        FinetuneConfig(**base).validate()


def test_config_dict_roundtrip():
    cfg = FinetuneConfig(store="s", model_kwargs=TINY, img_size=32, betas=(0.8, 0.99))
    assert FinetuneConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown FinetuneConfig field"):
        FinetuneConfig.from_dict({"store": "s", "bogus": 1})


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
    one = _MicroBatches(data, tiny_cfg(store, tmp_path, shuffle=True, augment=True), 0, 2)
    two = [_MicroBatches(data, tiny_cfg(store, tmp_path, shuffle=True, augment=True, workers=2,
                                        micro_batch_size=2), r, 2) for r in (0, 1)]
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
}


@pytest.mark.parametrize("config", CONFIGURATIONS)
def test_freezing_is_exact(store, tmp_path, config):
    cfg = tiny_cfg(store, tmp_path, component=config, steps=3, eval_period=10)
    ft = Finetuner(cfg)
    init = {n: p.detach().clone() for n, p in ft.model.named_parameters()}
    ft.run(progress=False)
    trainable = set(ft.selection.names)
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
    assert ft.selection.num_trainable == expected
    if config in ("MHA", "FC1"):
        assert all(n.startswith("blocks.") or n.startswith("head.") for n in trainable)
    if config != "All":
        assert not any(n.startswith("norm.") for n in trainable)  # final norm frozen by default


def test_train_final_norm_option(store, tmp_path):
    ft = Finetuner(tiny_cfg(store, tmp_path, component="LN1", train_final_norm=True))
    assert {"norm.weight", "norm.bias"} <= set(ft.selection.names)
    assert ft.selection.num_trainable == EXPECTED_COUNTS["LN1"] + 2 * D + D * C + C


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_memory_measured_equals_analytic(store, tmp_path, optimizer):
    ft = Finetuner(tiny_cfg(store, tmp_path, component="FC2", optimizer=optimizer))
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
    cfg = tiny_cfg(store, tmp_path, component="MHA", lr=0.05, warmup_steps=0)
    ft = Finetuner(cfg)
    x, y = ft.train_data.load(np.arange(8), size=32, train=False)
    before = {n: p.detach().clone() for n, p in ft.selection.trainable}
    # independent reference: gradient of the mean loss over the batch
    loss = F.cross_entropy(ft.model(x), y)
    loss_value = loss.item()
    grads = torch.autograd.grad(loss, ft.trainable)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    comp = {n for n, _ in ft.selection.component}
    comp_norm = torch.sqrt(sum((g.double() ** 2).sum() for (n, _), g in zip(ft.selection.trainable, grads)
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
    for (n, p), g in zip(ft.selection.trainable, grads):  # first SGD step: momentum buffer = clipped grad
        torch.testing.assert_close(p.detach(), before[n] - 0.05 * scale * g, rtol=1e-5, atol=1e-7)


def test_divergence_is_recorded_not_raised(store, tmp_path):
    summary, ft = train_local(tiny_cfg(store, tmp_path, lr=1e30, steps=6), tensorboard=False)
    assert summary["status"] == "diverged"
    assert 1 <= summary["diverged_step"] <= 6 and summary["steps_completed"] == summary["diverged_step"]
    last = ft.curves[-1]
    assert last["step"] == summary["diverged_step"]
    assert not (math.isfinite(last["train_loss"]) and math.isfinite(last["grad_norm"]))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "diverged"


# ---------------------------------------------------------------------------------------------------
# Resume and outputs
# ---------------------------------------------------------------------------------------------------


class Killed(Exception):
    pass


def test_resume_is_exact_with_shuffling_and_augmentation(store, tmp_path):
    """Killed after its checkpoint at step 4, a resumed run reproduces the uninterrupted one bitwise and
    restarts from the checkpointed optimizer, schedule and RNG state."""
    kw = dict(component="FC1", optimizer="adamw", lr=3e-3, steps=8, eval_period=3, checkpoint_period=4,
              shuffle=True, augment=True, batch_size=6)
    ref, ref_ft = train_local(tiny_cfg(store, tmp_path / "ref", **kw), tensorboard=False)

    cfg = tiny_cfg(store, tmp_path / "run", **kw)
    ckdir = tmp_path / "run" / "ckpt"
    first = Finetuner(cfg)
    torch.manual_seed(123)  # any RNG state: it must come back from the checkpoint

    def kill(ev: Event):
        if ev.checkpoint:
            first.save(ckdir / f"step_{ev.step:08d}")
            raise Killed

    with pytest.raises(Killed):
        first.run(kill, progress=False)
    assert first.step == 4
    torch.manual_seed(999)
    summary, ft = train_local(cfg, checkpoint_dir=ckdir, resume=True)

    saved = torch.load(ckdir / "step_00000004" / "state.pt", weights_only=True)
    rng = torch.load(ckdir / "step_00000004" / "rng_rank0.pt", weights_only=True)
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
    for n, p in ref_ft.selection.trainable:
        assert torch.equal(p, dict(ft.selection.trainable)[n])
    for k in ("best_val_acc", "best_val_step", "test_acc", "final_val_loss", "trainable_params", "status"):
        assert summary[k] == ref[k]
    assert summary["num_restores"] == 1 and summary["restored_from_step"] == 4


def test_resume_refuses_another_runs_checkpoint(store, tmp_path):
    cfg = tiny_cfg(store, tmp_path, steps=2)
    ft = Finetuner(cfg)
    ft.save(tmp_path / "ck")
    other = Finetuner(tiny_cfg(store, tmp_path, steps=2, lr=0.2))
    with pytest.raises(ValueError, match="lr"):
        other.load(tmp_path / "ck")


def test_outputs_summary_curves_tensorboard(store, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary, ft = train_local(tiny_cfg(store, tmp_path, steps=5, eval_period=2, log_period=2))
    saved = json.loads((tmp_path / "summary.json").read_text())
    needed = set(columns("trials")) - {"trial_id", "dataset", "model"}
    assert needed <= set(saved) and {"grad_memory_bytes", "optimizer_memory_bytes"} <= set(saved)
    curves = pd.read_parquet(tmp_path / "curves.parquet")
    assert list(curves.columns) == CURVE_COLUMNS
    assert curves["step"].tolist() == [2, 4, 5]  # log every 2 steps and the last step
    assert curves["val_acc"].notna().tolist() == [True, True, True]  # evals at 2, 4 and the final step
    assert 0.0 <= saved["best_val_acc"] <= 1.0 and 0.0 <= saved["test_acc"] <= 1.0
    assert saved["best_val_step"] in (2, 4, 5)
    acc = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert {"train/train_loss", "train/grad_norm", "train/component_grad_norm", "val/val_acc",
            "result/test_acc"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train/train_loss")] == [2, 4, 5]
    assert (tmp_path / "best_trainable.safetensors").is_file()


def test_test_accuracy_is_of_the_best_validation_state(store, tmp_path):
    """The reported test accuracy is recomputed here from best_trainable.safetensors."""
    from safetensors.torch import load_file

    summary, ft = train_local(tiny_cfg(store, tmp_path, steps=6, eval_period=2, lr=0.3), tensorboard=False)
    best = load_file(tmp_path / "best_trainable.safetensors")
    model = ft.model
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in best:
                p.copy_(best[n])
    test = SplitData(ft.cfg.store, "test")
    x, y = test.load(np.arange(len(test)), size=32, train=False)
    model.eval()
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    assert summary["test_acc"] == pytest.approx(acc)
    vals = [r["val_acc"] for r in ft.curves if r["val_acc"] is not None]
    assert summary["best_val_acc"] == max(vals)
    assert summary["best_val_step"] == [r["step"] for r in ft.curves if r["val_acc"] == max(vals)][0]


def test_cli_builds_the_config(store, tmp_path):
    from raystudy.cli import build_parser
    from raystudy.commands.finetune import config_from_args

    args = build_parser().parse_args([
        "finetune", "--store", store, "--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(TINY),
        "--img-size", "32", "--config", "LN2", "--optimizer", "adamw", "--lr", "1e-4", "--seed", "2",
        "--steps", "7", "--workers", "2", "--batch-size", "8", "--out", str(tmp_path), "--no-shuffle"])
    cfg = config_from_args(args)
    assert (cfg.component, cfg.optimizer, cfg.lr, cfg.seed, cfg.steps, cfg.workers) == ("LN2", "adamw", 1e-4, 2, 7, 2)
    assert cfg.model_kwargs == TINY and not cfg.shuffle and cfg.augment
    bad = build_parser().parse_args(["finetune", "--store", store, "--out", str(tmp_path), "--model-kwargs", "{x"])
    with pytest.raises(ValueError, match="--model-kwargs"):
        config_from_args(bad)


def test_dataloader_processes_give_the_same_run(store, tmp_path):
    """Prefetching micro-batches in DataLoader worker processes changes nothing (augmentation on)."""
    kw = dict(steps=3, eval_period=10, shuffle=True, augment=True, micro_batch_size=3)
    _, a = train_local(tiny_cfg(store, tmp_path / "a", **kw), tensorboard=False, write=False)
    _, b = train_local(tiny_cfg(store, tmp_path / "b", loader_workers=2, **kw), tensorboard=False, write=False)
    assert [r["train_loss"] for r in a.curves] == [r["train_loss"] for r in b.curves]
    for (n, p), (_, q) in zip(a.selection.trainable, b.selection.trainable):
        assert torch.equal(p, q), n
