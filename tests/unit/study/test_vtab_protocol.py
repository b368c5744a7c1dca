"""VTAB-1k's benchmark protocol as options beside the paper's (issue #23 item 1).

``resize: stretch`` (the whole image to ``size x size``, bicubic: NOAH's ``Resize((224, 224),
interpolation=3)``, no crop) on both data paths; ``train_splits: train+val`` (a run on the union of the store's
train and val rows, no validation, the last step tested); and a study's ``final_fit`` (after the lr search,
one train+val run per seed at the lr chosen on validation, rows with ``phase`` = ``final``)."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import torch

from raystudy.core.finetune import FinetuneConfig, Finetuner, open_split_data
from raystudy.core.finetune.data import CachedSplitData, MicroBatches, SplitData, global_batch, to_device
from raystudy.data.cache import cache_dir, kinds_read
from raystudy.data.store import StoreError, read_split, write_store
from raystudy.data.transforms import IMAGENET_MEAN, IMAGENET_STD, decode
from tests.support.stores import png_bytes

TINY = dict(patch_size=8, embed_dim=48, depth=3, num_heads=4)



COUNTS = {"train": 12, "val": 4, "test": 6}



def _striped(rng, h: int, w: int) -> bytes:
    """A PNG whose leftmost quarter is pure red: a centre crop of a wide image cuts it, a stretch keeps it."""
    from PIL import Image

    px = (rng.random((h, w, 3)) * 255).astype(np.uint8)
    px[:, : w // 4] = (255, 0, 0)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "PNG")
    return buf.getvalue()



def _write(path, counts=COUNTS, *, name="vt", shapes=((24, 48), (40, 20))):
    rng = np.random.default_rng(0)
    rows, index = [], 0
    for split, n in counts.items():
        for _ in range(n):
            h, w = shapes[index % len(shapes)]
            rows.append({"image": _striped(rng, h, w), "label": index % 3, "split": split, "index": index})
            index += 1
    write_store(rows, path, name=name, source="test", classes=["a", "b", "c"])
    return str(path)



@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("vtab_protocol") / "store")



def _cfg(store, tmp, **kw) -> FinetuneConfig:
    base = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, out_dir=str(tmp),
                steps=4, batch_size=4, eval_period=2, seed=3)
    return FinetuneConfig(**{**base, **kw})



def _pil_stretch(data: bytes, size: int, interpolation: str = "BICUBIC") -> torch.Tensor:
    """NOAH's eval transform, independently: PIL ``resize((size, size), BICUBIC)`` (``interpolation=3``),
    ``ToTensor``, ``Normalize`` with the ImageNet statistics; ``(3, size, size)`` float32."""
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB").resize((size, size), getattr(Image, interpolation))
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)



def test_stretch_is_nohas_resize_without_crop_on_both_data_paths(store, tmp_path):
    images = read_split(store, "test", columns=["image"]).column("image").to_pylist()
    rows = np.arange(len(images))
    decoded = SplitData(store, "test", resize="stretch").load(rows, size=32, train=False)[0]
    cached = CachedSplitData(store, "test", size=32, crop=False, root=str(tmp_path), resize="stretch")
    assert torch.equal(cached.load(rows, size=32, train=False)[0], decoded)  # the cache's eval tolerance: 0
    # NOAH's PIL bicubic resize: the same picture but for rounding (PIL's fixed point, torch's floats) and a
    # few pixels at the noise's sharpest edges (measured: mean 0.15 grey levels, 0.5 % beyond 2.5, max 17);
    # PIL's bilinear is far further away (not the interpolation NOAH names)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    noah = torch.stack([_pil_stretch(b, 32) for b in images])
    grey = (decoded - noah).mul(std).abs() * 255
    assert grey.mean() < 0.3 and (grey > 2.5).float().mean() < 0.01, (grey.mean(), (grey > 2.5).float().mean())
    bilinear = torch.stack([_pil_stretch(b, 32, "BILINEAR") for b in images])
    assert (decoded - bilinear).mul(std).abs().mean() * 255 > 10 * grey.mean()
    # the whole field of view: the red quarter of the wide (24 x 48) images is there, a centre crop cuts it
    red = (torch.tensor([1.0, 0.0, 0.0]) - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    cropped = SplitData(store, "test", resize="crop").load(rows, size=32, train=False)[0]
    wide = rows[::2]  # index 16, 18, 20: 24 x 48
    assert torch.allclose(decoded[wide, :, :, :6], red.view(1, 3, 1, 1).expand(3, 3, 32, 6), atol=0.05)
    assert (cropped[wide, :, :, :6] - red.view(1, 3, 1, 1)).abs().amax() > 1.0
    assert decode(images[0]).shape[-2:] == (24, 48)



def test_stretch_has_its_own_cache_kind_and_never_reads_a_crop_cache(store, tmp_path):
    crop = CachedSplitData(store, "val", size=32, crop=False, root=str(tmp_path), resize="crop")
    stretch = CachedSplitData(store, "val", size=32, crop=False, root=str(tmp_path), resize="stretch")
    assert crop.cache.folder == cache_dir(store, "val", "eval", 32, str(tmp_path))
    assert stretch.cache.folder == cache_dir(store, "val", "stretch", 32, str(tmp_path)) != crop.cache.folder
    assert stretch.cache.folder.endswith("val-stretch32") and stretch.cache.manifest["kind"] == "stretch"
    rows = np.arange(len(crop))
    assert not np.array_equal(crop.cache.read(rows), stretch.cache.read(rows))
    assert kinds_read("val", True, resize="stretch") == ("stretch",)
    assert kinds_read("train", True, resize="stretch") == ("full",)
    assert kinds_read("val", True, resize="stretch", train_on_val=True) == ("stretch", "full")



@pytest.mark.parametrize("augment", [False, True])
def test_train_without_augment_is_stretched_and_both_paths_agree(store, tmp_path, augment):
    """augment off: the train batches are the eval transform's (stretch) on both data paths, bitwise; with
    augment the train split keeps the paper's random resized crop (the ``full`` kind) and val/test stretch."""
    batches = {}
    for path in ("decode", "cache"):
        cfg = _cfg(store, tmp_path / path, augment=augment, resize="stretch", data_path=path,
                   cache_dir=str(tmp_path / "c"))
        data = open_split_data(cfg, "train")
        micro = MicroBatches(data, cfg, 0, 0)
        batches[path] = [to_device(micro[k], torch.device("cpu"), size=32)[0] for k in range(len(micro))]
        val = open_split_data(cfg, "val")
        assert torch.equal(val.load(np.arange(4), size=32, train=False)[0],
                           SplitData(store, "val", resize="stretch").load(np.arange(4), size=32, train=False)[0])
    if augment:
        return  # the cache path's crops are its own draws (raystudy.core.finetune.data), not torchvision's
    for a, b in zip(batches["decode"], batches["cache"]):
        assert torch.equal(a, b)
    cfg = _cfg(store, tmp_path, augment=False, resize="stretch")
    rows, _ = global_batch(0, n=COUNTS["train"], batch_size=4, seed=cfg.seed, shuffle=True)
    want = SplitData(store, "train", resize="stretch").load(rows, size=32, train=False)[0]
    assert torch.equal(batches["decode"][0], want)



def _indices(store, *splits):
    return sorted(i for s in splits for i in read_split(store, s, columns=["index"]).column("index").to_pylist())



@pytest.mark.parametrize("data_path,augment", [("decode", False), ("cache", False), ("cache", True)])
def test_a_train_val_run_sees_exactly_the_union_and_tests_its_last_step(store, tmp_path, data_path, augment):
    n = COUNTS["train"] + COUNTS["val"]  # 16 rows: 4 steps of 4 are one epoch, each row once
    cfg = _cfg(store, tmp_path / data_path, train_splits="train+val", data_path=data_path, augment=augment,
               resize="stretch", cache_dir=str(tmp_path / "c"))
    ft = Finetuner(cfg)
    assert len(ft.train_data) == n
    if data_path == "cache":  # val is read as training rows: the whole images when augmenting
        kinds = [d.cache.kind for d in ft.train_data.parts]
        assert kinds == (["full", "full"] if augment else ["stretch", "stretch"])
    seen: list[int] = []
    batch = ft.train_data.batch

    def spy(rows, **kw):
        seen.extend(ft.train_data.indices[np.asarray(rows)].tolist())
        return batch(rows, **kw)

    ft.train_data.batch = spy
    evaluated: list[str] = []
    evaluate = ft.evaluate
    ft.evaluate = lambda split, *a, **k: (evaluated.append(split), evaluate(split, *a, **k))[1]
    summary = ft.run()
    assert sorted(seen) == _indices(store, "train", "val") and len(seen) == cfg.steps * cfg.batch_size
    assert evaluated == ["test"]  # never val
    assert summary["best_val_step"] == cfg.steps and np.isnan(summary["best_val_acc"])
    assert 0.0 <= summary["test_acc"] <= 1.0
    # the test accuracy is the last step's state, recomputed here
    _, acc = ft.evaluate("test")
    assert acc == summary["test_acc"]



def test_train_val_refuses_a_store_without_a_distinct_val(tmp_path, store):
    no_val = _write(tmp_path / "noval", {"train": 8, "val": 0, "test": 4}, name="noval")
    with pytest.raises(ValueError, match="no val rows"):
        open_split_data(_cfg(no_val, tmp_path, train_splits="train+val"), "train")
    rng = np.random.default_rng(1)
    dup = [{"image": png_bytes(rng), "label": i % 2, "split": s, "index": i % 6}
           for i, s in enumerate(["train"] * 6 + ["val"] * 2 + ["test"] * 2)]
    with pytest.raises(StoreError, match="index"):  # a store itself refuses duplicate stable indices
        write_store(dup, tmp_path / "dup", name="dup", source="test", classes=["a", "b"])
    with pytest.raises(ValueError, match="per_seed"):
        open_split_data(_cfg(store, tmp_path, train_splits="train+val", val_split="per_seed"), "train")
    with pytest.raises(ValueError, match="no val split"):
        open_split_data(_cfg(store, tmp_path, train_splits="train+val"), "val")



def test_the_dry_run_counts_the_final_trials_as_a_dependent_stage(builtin, tmp_path):
    from raystudy.commands.study import dry_run_json
    from raystudy.study import cost
    from raystudy.study.checks import SpecError
    from raystudy.study.spec import StudySpec

    base = dict(name="ff", out=str(tmp_path / "s"), model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32,
                weights=builtin["weights"],
                data_root=builtin["data_root"], datasets={"color": "shift-color"}, configurations=["MHA", "LN1"],
                optimizers={"sgd": [0.01, 0.3]}, seeds=[0, 1], steps=4, batch_size=16, eval_period=2,
                plasticity={"enabled": False})
    plain, fit = StudySpec.from_dict(base), StudySpec.from_dict({**base, "final_fit": True})
    assert dry_run_json(fit)["final_trials"] == 4 and dry_run_json(fit)["total_trials"] == 12
    assert dry_run_json(plain)["final_trials"] == 0 and len(dry_run_json(fit)["trials"]) == 8
    a, b = cost.study_cost(plain)["datasets"]["color"], cost.study_cost(fit)["datasets"]["color"]
    assert b["trials"] == 12 and b["final_trials"] == 4 and a["final_trials"] == 0
    # a final trial trains as a search trial does (same steps, same images) and is tested, never validated
    per = a["per_image"]
    want_train = 2 * 16 * 4 * (per["MHA"]["train"] + per["LN1"]["train"])  # 2 seeds of each
    want_eval = 2 * (per["MHA"]["forward"] + per["LN1"]["forward"]) * a["rows"]["test"]
    assert b["flops_train"] - a["flops_train"] == want_train
    assert b["flops_eval"] - a["flops_eval"] == want_eval
    assert any("final fit: 4 trial(s)" in n for n in cost.study_cost(fit)["notes"])
    with pytest.raises(SpecError, match="final_fit: needs search grid"):
        StudySpec.from_dict({**base, "final_fit": True, "search": "optuna"}).validate(check_files=False)
    with pytest.raises(SpecError, match="final_fit: needs val_split fixed"):
        StudySpec.from_dict({**base, "final_fit": True, "val_split": "per_seed"}).validate(check_files=False)



def test_a_final_fit_study_refuses_a_store_without_val_rows(builtin, tmp_path):
    from raystudy.study.final import store_problems
    from raystudy.study.spec import StudySpec

    no_val = _write(tmp_path / "noval", {"train": 8, "val": 0, "test": 4}, name="noval")
    datasets = {"nv": no_val, "ok": builtin["stores"]["shift-color"]}
    spec = StudySpec.from_dict(dict(name="ff", out=str(tmp_path / "s"), datasets=datasets, final_fit=True,
                                    configurations=["MHA"]))
    assert store_problems(spec) == [f"final_fit: datasets.nv: {no_val}/dataset.json has no val rows to train on "
                                    "(train_splits train+val needs a val split of its own)"]
    spec.final_fit = False
    assert store_problems(spec) == []



def test_the_final_points_take_the_val_chosen_lr_once_a_sweep_has_ended(tmp_path):
    """Hand-made search rows where validation prefers another lr than test does, a tie, and a sweep still
    running: the final points follow validation (mean over seeds), the smaller lr on a tie, and wait."""
    from raystudy.study.final import final_points
    from raystudy.study.spec import StudySpec

    spec = StudySpec.from_dict(dict(name="ff", out=str(tmp_path), datasets={"d": "s"}, configurations=["MHA", "LN1"],
                                    optimizers={"sgd": [0.01, 0.1]}, seeds=[0, 1], final_fit=True))
    val = {("MHA", 0.01): (0.5, 0.7), ("MHA", 0.1): (0.8, 0.6),  # mean 0.6 vs 0.7: val picks 0.1
           ("LN1", 0.01): (0.4, 0.6), ("LN1", 0.1): (0.5, 0.5)}  # a tie at 0.5: the smaller lr
    test = {("MHA", 0.01): 0.9, ("MHA", 0.1): 0.1, ("LN1", 0.01): 0.1, ("LN1", 0.1): 0.9}  # test prefers the other
    rows = [{"trial_id": p["trial_id"], "dataset": "d", "model": "m", "configuration": p["configuration"],
             "optimizer": "sgd", "lr": p["lr"], "seed": p["seed"], "status": "ok", "phase": "search",
             "best_val_acc": val[(p["configuration"], p["lr"])][p["seed"]],
             "test_acc": test[(p["configuration"], p["lr"])], "wall_seconds": 1.0, "trainable_params": 10}
            for p in spec.grid()]
    trials = pd.DataFrame(rows)
    points, waiting = final_points(spec, trials)
    assert waiting == []
    assert {(p["configuration"], p["seed"]): p["lr"] for p in points} == {
        ("MHA", 0): 0.1, ("MHA", 1): 0.1, ("LN1", 0): 0.01, ("LN1", 1): 0.01}
    assert all(p["phase"] == "final" and p["trial_id"].endswith("-final") for p in points)
    # a final row of another lr is not a search row: it changes nothing
    extra = {**rows[0], "trial_id": rows[0]["trial_id"] + "-final", "phase": "final", "best_val_acc": float("nan")}
    assert final_points(spec, pd.DataFrame(rows + [extra]))[0] == points
    # MHA's seed 1 at lr 0.1 failed: MHA waits for its retry, LN1 goes on
    failed = trials.assign(status=np.where((trials.configuration == "MHA") & (trials.lr == 0.1)
                                           & (trials.seed == 1), "failed", "ok"))
    points, waiting = final_points(spec, failed)
    assert {p["configuration"] for p in points} == {"LN1"}
    assert waiting == ["d/MHA/sgd: 1 search trial(s) not ended (first: d-MHA-sgd-lr0.1-s1)"]



def test_a_killed_train_val_run_resumes_to_the_same_numbers(store, tmp_path):
    """A train+val run stopped at its first checkpoint and resumed ends as the uninterrupted run (its data
    order over the union, the last step tested); a run on train alone does not resume its checkpoints."""
    from raystudy.core.finetune.driver import train_local
    from tests.support.runs import kill_at_first_checkpoint

    kw = dict(train_splits="train+val", resize="stretch", steps=6, eval_period=2, checkpoint_period=3,
              augment=True, data_path="cache", cache_dir=str(tmp_path / "c"))
    ref, _ = train_local(_cfg(store, tmp_path / "ref", **kw), tensorboard=False)
    cfg = _cfg(store, tmp_path / "run", **kw)
    ckdir = tmp_path / "run" / "ckpt"
    first = Finetuner(cfg)
    kill_at_first_checkpoint(first, ckdir)
    assert first.step == 3 and first.best_state is None  # nothing validated on the way
    summary, ft = train_local(cfg, checkpoint_dir=ckdir, resume=True, tensorboard=False)
    assert ft.restores[0]["step"] == 3 and summary["best_val_step"] == 6 == ref["best_val_step"]
    assert summary["test_acc"] == ref["test_acc"] and summary["final_train_loss"] == ref["final_train_loss"]
    # a run on train alone meets these checkpoints as another run's: moved aside, it starts from step 0
    other, ft = train_local(_cfg(store, tmp_path / "run", **{**kw, "train_splits": "train"}), checkpoint_dir=ckdir,
                            resume=True, tensorboard=False)
    assert not ft.restores and other["checkpoints_skipped"] >= 1
    assert any("train_splits" in w for w in other["checkpoint_warnings"]), other["checkpoint_warnings"]

