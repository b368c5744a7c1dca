"""Pairing of the plasticity pipeline: ``sequential`` (the authors' store order), ``random`` (unchanged), the
whole-validation-set ``pretrain_split``, the fixed bounds radius, and resume refused when the pairing changes.

Expected pairs are written out by hand from the rows each miniature store is written with (index and split,
in store order); the ImageNet case takes its expected order from torchvision's ``ImageFolder`` (what the
authors' loader iterates); the rates are recomputed with the core ``pair_rates_tensor`` on images looked
up by ``index``. One test starts Ray."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from raystudy.data.pairing import pair_positions, positions, sequential_positions
from raystudy.data.rows import resolve_pretrain_split
from raystudy.data.store import StoreError, write_store
from raystudy.distributed.plasticity import PlasticityJob, pairs_table, plan_pairs
from raystudy.study.checks import SpecError
from raystudy.study.spec import StudySpec
from tests.support.models import tiny_vit
from tests.support.stores import png_bytes

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)



TIMM_NAME = "vit_tiny_patch16_224"



#: (index, split) of every row, in store order (4 rows per shard: the splits interleave across shards)
PRE_ROWS = [(907, "train"), (12, "test"), (450, "val"), (3, "train"), (871, "test"), (66, "val"),
            (205, "train"), (18, "test"), (999, "val"), (140, "train")]



ALPHA_ROWS = [(40, "train"), (7, "test"), (33, "test"), (2, "val"), (91, "test"), (5, "test"), (60, "test"),
              (14, "train"), (88, "test")]



BETA_ROWS = [(300, "test"), (100, "test"), (9, "train"), (200, "test"), (400, "test"), (500, "test"), (600, "test"),
             (1, "val"), (700, "test"), (800, "test")]



#: pairs=8, batch_size=4, pretrain_split=all. Pretraining side: 10 rows, period 10 - 10 % 4 = 8: its first 8
#: rows. alpha: test rows 7 33 91 5 60 88, period 6 - 6 % 4 = 4: 7 33 91 5, then again. beta: 8 test rows.
SEQUENTIAL_PAIRS = {
    "alpha": [(907, 7), (12, 33), (450, 91), (3, 5), (871, 7), (66, 33), (205, 91), (18, 5)],
    "beta": [(907, 300), (12, 100), (450, 200), (3, 400), (871, 500), (66, 600), (205, 700), (18, 800)],
}



def _write(path, rows, name, seed):
    rng = np.random.default_rng(seed)
    write_store([{"image": png_bytes(rng), "label": i % 3, "split": s, "index": i} for i, s in rows], path,
                name=name, source="test", classes=["a", "b", "c"], rows_per_shard=4)
    return str(path)



@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairing")
    torch.manual_seed(3)
    model = tiny_vit().eval()
    weights = root / "tiny.pt"
    torch.save(model.state_dict(), weights)
    return {"root": root, "pre": _write(root / "pre", PRE_ROWS, "pre", 1), "model": model,
            "down": [_write(root / "alpha", ALPHA_ROWS, "alpha", 2), _write(root / "beta", BETA_ROWS, "beta", 3)],
            "weights": str(weights)}



def _job(stores, out, **kw):
    base = dict(model=TIMM_NAME, weights=stores["weights"], model_kwargs=TINY, pretrain=stores["pre"],
                downstream=stores["down"], pairs=8, batch_size=4, pairing="sequential", pretrain_split="all",
                seed=5, out_dir=str(out), figures=False)
    return PlasticityJob(**{**base, **kw})



def _pairs(table: pd.DataFrame, dataset: str) -> list[tuple[int, int]]:
    sub = table[table.dataset == dataset].sort_values("pair")
    assert sub["pair"].tolist() == list(range(len(sub)))
    return list(zip(sub["pretrain_index"].tolist(), sub["downstream_index"].tolist()))



def test_random_pairing_is_unchanged():
    """The stored expectation: ``rng = numpy.random.default_rng(7)``; ``rng.permutation(12)[:10]``, then
    ``concat(rng.permutation(7), rng.permutation(7))[:10]`` (values printed once and written here)."""
    pre, down = [4, 6, 10, 0, 1, 3, 8, 7, 2, 5], [4, 2, 0, 3, 6, 1, 5, 4, 1, 6]
    rng = np.random.default_rng(7)  # the documented recipe still gives them (numpy's stream is stable)
    assert rng.permutation(12)[:10].tolist() == pre
    assert np.concatenate([rng.permutation(7), rng.permutation(7)])[:10].tolist() == down
    for got in (pair_positions(12, 7, 10, 7), positions("random", 12, 7, 10, seed=7, batch_size=3)):
        assert [a.tolist() for a in got] == [pre, down]



def test_sequential_positions_cycle_after_the_last_full_batch():
    pre, down = sequential_positions(12, 7, 10, 3)  # periods 12 and 6 (7 - 7 % 3)
    assert pre.tolist() == list(range(10)) and down.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    # the authors' CIFAR-10 test split (10,000 images, batches of 64): pair 9984 is image 0 again
    _, cifar = sequential_positions(50_000, 10_000, 12_800, 64)
    assert cifar[9983] == 9983 and cifar[9984] == 0 and cifar[-1] == 12_799 - 9984
    assert sequential_positions(2, 3, 5, 4)[0].tolist() == [0, 1, 0, 1, 0]  # fewer rows than a batch: all
    with pytest.raises(ValueError, match="both sides need rows"):
        sequential_positions(0, 3, 5, 4)



def test_sequential_pairing_pairs_rows_in_store_order(stores, tmp_path):
    job = _job(stores, tmp_path)
    table = pairs_table(job, plan_pairs(job)).to_pandas()
    for name, expected in SEQUENTIAL_PAIRS.items():
        assert _pairs(table, name) == expected
    assert set(table["pairing"]) == {"sequential"}

    # one split, or a list of splits: their rows in store order
    cases = {"test": [12, 871, 18] * 3, ("val", "test"): [12, 450, 871, 66] * 2}  # periods 3 (< a batch) and 4
    for split, pre in cases.items():
        job = _job(stores, tmp_path, pretrain_split=split if isinstance(split, str) else list(split))
        table = pairs_table(job, plan_pairs(job)).to_pandas()
        assert [p for p, _ in _pairs(table, "beta")] == pre[:8]



def test_random_pairing_plan_follows_the_recipe(stores, tmp_path):
    job = _job(stores, tmp_path, pairing="random")
    table = pairs_table(job, plan_pairs(job)).to_pandas()
    pre_index = [i for i, _ in PRE_ROWS]  # pretrain_split=all: every row, in store order
    for name, rows in (("alpha", ALPHA_ROWS), ("beta", BETA_ROWS)):
        test_index = [i for i, s in rows if s == "test"]
        rng = np.random.default_rng(5)  # alpha has 6 test rows: a second permutation is appended
        a = rng.permutation(len(pre_index))[:8]
        b = np.concatenate([rng.permutation(len(test_index)) for _ in range(2)])[:8]
        assert _pairs(table, name) == [(pre_index[i], test_index[j]) for i, j in zip(a, b)]
    assert set(table["pairing"]) == {"random"}



def test_whole_validation_set_split_names(stores, tmp_path):
    pre, alpha = stores["pre"], stores["down"][0]
    assert resolve_pretrain_split(pre, "all") == ("train", "val", "test")
    assert resolve_pretrain_split(pre, "val,test") == resolve_pretrain_split(pre, ["val", "test"]) == ("val", "test")
    no_test = _write(tmp_path / "nt", [(1, "train"), (2, "val"), (3, "val")], "nt", 4)
    assert resolve_pretrain_split(no_test, "test") == ("val",)  # the old fallback
    assert resolve_pretrain_split(no_test, "all") == ("train", "val")
    assert resolve_pretrain_split(alpha, "test") == ("test",)
    with pytest.raises(StoreError, match=r"split 'test' is empty"):
        resolve_pretrain_split(no_test, ["val", "test"])
    for bad in ("dev", ["val", "val"], "all,test"):
        with pytest.raises(ValueError, match="plasticity job: pretrain_split: unknown value"):
            _job(stores, tmp_path, pretrain_split=bad).validate()
    with pytest.raises(ValueError, match=r"plasticity job: pairing: 'shuffled' expected one of \['random', "):
        _job(stores, tmp_path, pairing="shuffled").validate()



def _imagenet_tree(root) -> None:
    """4 class folders x 5 validation images; the validation numbers do not follow the folder order."""
    from PIL import Image

    rng = np.random.default_rng(0)
    numbers = rng.permutation(np.arange(1, 21))
    for k, n in enumerate(numbers):
        folder = root / f"n0{k % 4}000000"
        folder.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray((rng.random((12, 14, 3)) * 255).astype(np.uint8))
        img.save(folder / f"ILSVRC2012_val_{n:08d}.JPEG", "JPEG")



def test_sequential_imagenet_side_is_the_authors_imagefolder_order(tmp_path):
    """A store prepared from ImageNet's <wnid>/ILSVRC2012_val_*.JPEG folders holds the 20 images in 3 splits
    (the 80/20 rule); ``all`` + ``sequential`` gives them in torchvision ImageFolder's order, which is what
    the authors' val loader iterates, and not in ``index`` (validation number) order."""
    from torchvision.datasets import ImageFolder

    from raystudy.data.sources import prepare

    _imagenet_tree(tmp_path / "val")
    meta = prepare("imagenet", tmp_path / "val", tmp_path / "imagenet-val", rows_per_shard=6)
    assert all(meta["counts"][s] > 0 for s in ("train", "val", "test")) and sum(meta["counts"].values()) == 20
    folder_order = [int(p.rsplit("_", 1)[1].split(".")[0]) - 1 for p, _ in ImageFolder(tmp_path / "val").imgs]
    assert folder_order != sorted(folder_order)
    down = _write(tmp_path / "d", [(i, "test") for i in range(20)], "d", 9)
    job = PlasticityJob(model=TIMM_NAME, pretrain=str(tmp_path / "imagenet-val"), downstream=[down], pairs=20,
                        batch_size=4, pairing="sequential", pretrain_split="all", out_dir=str(tmp_path / "o"))
    table = pairs_table(job, plan_pairs(job)).to_pandas()
    assert table["pretrain_index"].tolist() == folder_order
    assert table["downstream_index"].tolist() == list(range(20))



def _spec(**plasticity) -> StudySpec:
    spec = StudySpec.from_dict({"name": "s", "out": "/tmp/s", "weights": "/w.pt", "pretrain_store": "pre",
                                "datasets": {"a": "a"}, "configurations": [], "optimizers": {}, "seeds": [],
                                "plasticity": plasticity})
    spec.validate(check_files=False)
    return spec



def test_spec_pairing_fields_are_validated_and_reach_the_job():
    from raystudy.study.jobs import plasticity_job

    spec = _spec(pairing="sequential", pretrain_split=["val", "test"], radius=19.4, batch_size=64)
    job = plasticity_job(spec, "a", None, "/tmp/out")
    assert (job.pairing, job.pretrain_split, job.radius, job.batch_size) == ("sequential", ["val", "test"], 19.4, 64)
    for bad, field in [({"pairing": "zip"}, "plasticity.pairing"), ({"pretrain_split": "dev"},
                       "plasticity.pretrain_split"), ({"radius": -1}, "plasticity.radius"),
                       ({"radius": "wide"}, "plasticity.radius")]:
        with pytest.raises(SpecError, match=f"^{field}"):
            _spec(**bad)



def test_resume_is_refused_when_the_pairing_changes(tmp_path):
    from raystudy.study.persist import check_stored, write_spec

    stored = _spec(pairing="random", batch_size=64).with_overrides({"out": str(tmp_path / "study")})
    write_spec(stored)
    check_stored(stored)  # the same spec resumes
    check_stored(stored.with_overrides({"plasticity.batch_size": 32}))  # random pairing: batch size is free
    with pytest.raises(SpecError, match=r"plasticity\.pairing: stored 'random', given 'sequential'"):
        check_stored(stored.with_overrides({"plasticity.pairing": "sequential"}))
    (msg,) = _spec(pairing="sequential", batch_size=32).conflicts(_spec(pairing="sequential", batch_size=64))
    assert msg == "plasticity.batch_size: stored 64, given 32"  # where a short side starts over
    assert _spec(pretrain_split="all").conflicts(_spec()) == ["plasticity.pretrain_split: stored 'test', given 'all'"]
    assert _spec(radius=19.4).conflicts(_spec()) == ["plasticity.radius: stored None, given 19.4"]
    # a spec written before `pairing` existed (no key) reads as random: no conflict with today's default
    old = stored.to_dict()
    old["plasticity"].pop("pairing")
    assert StudySpec.from_dict(old).conflicts(stored) == []

