"""The fast trial step and the batched augmentation (issue 13), on the CPU: bf16 and compiled steps against
fp32 eager, fused optimizers, SDPA attention, no gradient buffers for frozen parameters, inference-mode
evaluation; crop parameters against torchvision's ``RandomResizedCrop`` (KS tests), pixels against
torchvision's ``resized_crop``, determinism per image seed; the cache path's exact worker slices."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import ks_2samp
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from raystudy.core.finetune import (
    CacheBatch,
    CachedSplitData,
    FinetuneConfig,
    Finetuner,
    MicroBatches,
    SplitData,
    enable_fused_attention,
    make_optimizer,
    to_device,
    train_step,
)
from raystudy.core.finetune.augment import augment, resize_crops, sample_crops, uniforms
from raystudy.data.transforms import IMAGENET_MEAN, IMAGENET_STD, sample_seed
from tests.support.stores import make_store

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4)



@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("fast") / "store", n_per_split=(24, 8, 12))



def tiny_cfg(store, out, **kw) -> FinetuneConfig:
    base = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, out_dir=str(out),
                steps=4, batch_size=8, eval_period=2, log_period=1, lr=0.1, shuffle=False, augment=False,
                warmup_steps=0)
    base.update(kw)
    return FinetuneConfig(**base)



N = 4000



def torchvision_boxes(n: int, side: int) -> np.ndarray:
    """``(n, 4)`` (top, left, h, w) drawn by torchvision's own RandomResizedCrop on a ``side``-square."""
    rrc = T.RandomResizedCrop(32, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
    img = torch.zeros(3, side, side)
    torch.manual_seed(0)
    out = []
    for _ in range(n):
        p = rrc.make_params([img])
        out.append((p["top"], p["left"], p["height"], p["width"]))
    return np.array(out)



@pytest.mark.parametrize("side", [256, 37])
def test_crop_parameters_follow_torchvisions_distribution(side):
    """Scale ``h w / side^2``, log aspect ratio ``log(w / h)`` and relative position ``top / (side - h + 1)``
    of 4000 crops: two-sample KS tests against torchvision (p > 0.01); flips are fair."""
    seeds = np.array([sample_seed(0, 0, i) for i in range(N)], dtype=np.uint64)
    ours, flips = sample_crops(seeds, side, side)
    ref = torchvision_boxes(N, side)

    def stats(b):
        return {"scale": b[:, 2] * b[:, 3] / side ** 2, "log_ratio": np.log(b[:, 3] / b[:, 2]),
                "top": b[:, 0] / (side - b[:, 2] + 1), "left": b[:, 1] / (side - b[:, 3] + 1)}

    for name, a in stats(ours).items():
        p = ks_2samp(a, stats(ref)[name]).pvalue
        assert p > 0.01, f"{name}: KS p={p:.3g}"
    assert (ours[:, 2] <= side).all() and (ours[:, 3] <= side).all() and (ours[:, :2] >= 0).all()
    assert (ours[:, 0] + ours[:, 2] <= side).all() and (ours[:, 1] + ours[:, 3] <= side).all()
    assert abs(flips.mean() - 0.5) < 3 * 0.5 / np.sqrt(N)



def test_uniforms_are_a_pure_function_of_seed_and_draw():
    seeds = np.array([1, 2, 3], dtype=np.uint64)
    u = uniforms(seeds, 5)
    assert u.shape == (3, 5) and ((0 <= u) & (u < 1)).all()
    assert np.array_equal(uniforms(seeds[::-1], 5), u[::-1]) and np.array_equal(uniforms(seeds[1:], 3), u[1:, :3])
    big = uniforms(np.arange(20_000, dtype=np.uint64), 1).ravel()
    assert abs(big.mean() - 0.5) < 0.01 and ks_2samp(big, np.random.default_rng(0).random(20_000)).pvalue > 0.01



def test_resize_crops_matches_torchvision_per_image():
    """Flat crops resized on the device == torchvision's resized_crop (bilinear, antialias) of the same
    boxes image by image, within 1e-3 on the 0-255 scale (float rounding); crops of one shape are resized
    together with the same result; flips mirror the output; normalisation is (x / 255 - mean) / std."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (6, 3, 37, 45), dtype=torch.uint8, generator=g)
    seeds = np.array([sample_seed(1, 0, i) for i in range(6)], dtype=np.uint64)
    boxes, flips = sample_crops(seeds, 37, 45)
    boxes[5] = boxes[4]  # two crops of one shape
    flat = torch.cat([x[i, :, t:t + h, c:c + w].reshape(-1) for i, (t, c, h, w) in enumerate(boxes.tolist())])
    shapes = torch.from_numpy(boxes[:, 2:].copy())
    out = resize_crops(flat, shapes, 32)
    for i in range(6):
        top, left, h, w = boxes[i].tolist()
        ref = TF.resized_crop(x[i].float(), top, left, h, w, [32, 32], antialias=True)
        torch.testing.assert_close(out[i], ref, rtol=0, atol=1e-3)
    y = augment(flat, shapes, torch.from_numpy(flips), 32)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    mirrored = torch.where(torch.from_numpy(flips)[:, None, None, None], out.flip(-1), out)
    torch.testing.assert_close(y, (mirrored / 255 - mean) / std, rtol=1e-6, atol=1e-6)



def test_same_seeds_same_crops_in_any_batch(store):
    """An image's augmented tensor depends only on (seed, epoch, index): bitwise the same alone, in another
    batch order, or in a larger batch; another epoch gives another crop."""
    data = CachedSplitData(store, "train", size=32, crop=True)
    rows = np.arange(8)

    def tensors(r, epoch=0):
        b = data.batch(np.asarray(r), size=32, train=True, seed=5, epochs=np.full(len(r), epoch))
        return to_device(b, torch.device("cpu"), size=32)[0]

    full = tensors(rows)
    assert torch.equal(tensors(rows[::-1]), full.flip(0))
    assert torch.equal(tensors(rows[2:5]), full[2:5]) and torch.equal(tensors([3]), full[3:4])
    assert torch.equal(tensors(rows), full)
    assert not torch.equal(tensors(rows, epoch=1), full)
    assert full.shape == (8, 3, 32, 32) and (data.cache.shapes == [20, 24]).all()  # whole images stored



def test_cache_path_worker_slices_equal_the_single_worker_batch(store, tmp_path):
    """On the cache path 2 workers x 4 images (micro-batches of 2) get exactly 1 worker x 8's rows, crops and
    flips, and the same tensors once augmented."""
    cfg = dict(shuffle=True, augment=True, data_path="cache")
    data = CachedSplitData(store, "train", size=32, crop=True)
    one = MicroBatches(data, tiny_cfg(store, tmp_path, **cfg), 0, 2)
    two = [MicroBatches(data, tiny_cfg(store, tmp_path, micro_batch_size=2, **cfg), r, 2, world_size=2)
           for r in (0, 1)]
    whole = one[0]
    parts = [two[r][k] for r in (0, 1) for k in (0, 1)]
    assert isinstance(whole, CacheBatch)
    for field in ("images", "labels", "shapes", "flips"):
        assert torch.equal(torch.cat([getattr(p, field) for p in parts]), getattr(whole, field)), field
    cpu = torch.device("cpu")
    x = torch.cat([to_device(p, cpu, size=32)[0] for p in parts])
    assert torch.equal(x, to_device(whole, cpu, size=32)[0])



def test_unaugmented_cache_path_equals_the_decode_path(store, tmp_path):
    """Without augmentation (and for evaluation) the cache holds the eval transform's own pixels: the two data
    paths give bitwise equal tensors and therefore bitwise equal runs."""
    for split in ("train", "val"):
        cached = CachedSplitData(store, split, size=32, crop=False)
        decoded = SplitData(store, split)
        rows = np.arange(len(decoded))
        a, b = cached.load(rows, size=32, train=False), decoded.load(rows, size=32, train=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    runs = {}
    for path in ("cache", "decode"):
        ft = Finetuner(tiny_cfg(store, tmp_path / path, data_path=path, steps=3, shuffle=True))
        summary = ft.run(progress=False)
        runs[path] = (summary, [r["train_loss"] for r in ft.curves], ft.trainable_state())
        assert summary["data_path"] == path
    assert runs["cache"][1] == runs["decode"][1]
    assert runs["cache"][0]["test_acc"] == runs["decode"][0]["test_acc"]
    assert all(torch.equal(v, runs["decode"][2][k]) for k, v in runs["cache"][2].items())



def one_step(store, tmp_path, **kw) -> tuple[Finetuner, object, dict[str, torch.Tensor]]:
    """One training step of the tiny ViT (MHA, SGD, 8 fixed images in 2 micro-batches): the finetuner, its
    StepResult and the trainable parameters before the step (the first SGD update is ``-lr`` times the
    clipped gradient, so comparing updates compares gradients)."""
    ft = Finetuner(tiny_cfg(store, tmp_path, configuration="MHA", optimizer="sgd", lr=0.1, **kw))
    x, y = ft.train_data.load(np.arange(8), size=32, train=False)
    before = ft.trainable_state()
    res = train_step(ft.net, ft.optimizer, ft.scheduler, [(x[:5], y[:5]), (x[5:], y[5:])], share=8,
                     trainable=ft.trainable, group=ft.group, precision=ft.precision)
    return ft, res, before



def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))



def assert_step_close(fast, ref, *, loss_rtol: float, norm_rtol: float, update_rtol: float):
    """Loss, gradient norms and the parameter update ``p_after - p_before`` (relative L2 error)."""
    (ft_a, res_a, before_a), (ft_b, res_b, before_b) = fast, ref
    assert res_a.finite and res_b.finite
    assert res_a.loss == pytest.approx(res_b.loss, rel=loss_rtol)
    assert res_a.grad_norm == pytest.approx(res_b.grad_norm, rel=norm_rtol)
    assert res_a.component_grad_norm == pytest.approx(res_b.component_grad_norm, rel=norm_rtol)
    after_a, after_b = ft_a.trainable_state(), ft_b.trainable_state()
    for n in after_b:
        assert torch.equal(before_a[n], before_b[n])  # same initialisation
        assert rel(after_a[n] - before_a[n], after_b[n] - before_b[n]) <= update_rtol, n



def test_bf16_step_agrees_with_fp32(store, tmp_path):
    """bf16 autocast (fp32 master weights, gradients and loss; bf16 keeps 8 bits of mantissa): loss within
    1%, gradient norms within 3%, every parameter's update (the clipped gradient) within 5% relative L2."""
    fp32 = one_step(store, tmp_path / "a", precision="fp32")
    bf16 = one_step(store, tmp_path / "b", precision="bf16")
    assert (fp32[0].precision, bf16[0].precision) == ("fp32", "bf16")
    assert all(p.dtype == torch.float32 for p in bf16[0].trainable)  # master weights stay fp32
    assert bf16[1].loss != fp32[1].loss  # autocast is really on
    assert_step_close(bf16, fp32, loss_rtol=1e-2, norm_rtol=3e-2, update_rtol=5e-2)



@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fused_optimizer_agrees_with_the_default(store, tmp_path, optimizer):
    """The fused kernels (chosen automatically on CUDA; forced here on the CPU) give the default's update."""
    ft = Finetuner(tiny_cfg(store, tmp_path, configuration="FC1", optimizer=optimizer, lr=1e-2))
    assert ft.optimizer.defaults.get("fused") is None  # CPU parameters: PyTorch's default (foreach)
    params = [torch.nn.Parameter(p.detach().clone()) for p in ft.trainable]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in ft.trainable]
    fused, plain = make_optimizer(params, ft.cfg, fused=True), make_optimizer(copies, ft.cfg)
    assert fused.defaults["fused"] is True
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(params, copies):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
    for p, q in zip(params, copies):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)



def test_attention_runs_through_sdpa(store, tmp_path, monkeypatch):
    """Every attention module of the model has timm's fused_attn on, and a forward calls
    ``F.scaled_dot_product_attention`` once per block."""
    import torch.nn.functional as F

    monkeypatch.setenv("TIMM_FUSED_ATTN", "0")  # even when timm was told otherwise
    ft = Finetuner(tiny_cfg(store, tmp_path))
    assert enable_fused_attention(ft.model) == TINY["depth"]
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    ft.model(torch.zeros(2, 3, 32, 32))
    assert len(calls) == TINY["depth"]



def test_frozen_parameters_never_get_gradient_buffers(store, tmp_path):
    """After bf16 steps: frozen parameters have requires_grad False and no .grad; the optimizer holds exactly
    the trainable parameters (and state for them only)."""
    ft, res, _ = one_step(store, tmp_path, precision="bf16")
    trainable = {id(p) for p in ft.trainable}
    frozen = [(n, p) for n, p in ft.model.named_parameters() if id(p) not in trainable]
    assert frozen and all(not p.requires_grad and p.grad is None for _, p in frozen)
    assert all(p.grad is not None for p in ft.trainable)
    in_optimizer = [id(p) for group in ft.optimizer.param_groups for p in group["params"]]
    assert sorted(in_optimizer) == sorted(trainable) and set(map(id, ft.optimizer.state)) == trainable



def test_evaluation_runs_in_inference_mode(store, tmp_path):
    """Evaluation forwards run under torch.inference_mode in eval mode, over batches of eval_batch_size."""
    ft = Finetuner(tiny_cfg(store, tmp_path, eval_batch_size=5))
    seen = []
    hook = ft.model.register_forward_hook(
        lambda m, args, out: seen.append((torch.is_inference_mode_enabled(), m.training, len(args[0]))))
    loss, acc = ft.evaluate("val")
    hook.remove()
    assert seen == [(True, False, 5), (True, False, 3)]  # 8 val images in batches of 5
    assert 0 <= acc <= 1 and loss > 0

