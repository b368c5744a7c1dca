"""The linear probe under the protocol's ``resize``: ``stretch`` features equal those of images made by
:func:`raystudy.data.transforms.eval_transform` ``(size, "stretch")`` and fed to timm's own modules; the
decode and cache paths agree; ``probe.json`` records the transform; a crop probe is not reused for stretch;
a study's ``resize`` reaches its probe job; ``raystudy probe --resize`` sets it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.functional import pil_to_tensor

from raystudy.data.store import read_split, write_store
from raystudy.data.transforms import eval_transform
from tests.support.models import tiny_vit

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)
MODEL = "vit_tiny_patch16_224"
SEED = 5


def _image(rng: np.random.Generator, label: int) -> bytes:
    """A 24 x 48 PNG (2:1, so a centre crop and a stretch see different pixels), channel ``label`` brighter."""
    arr = rng.integers(0, 160, size=(24, 48, 3))
    arr[..., label] += 90
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A 3-class store (24 train / 3 val / 15 test rows, indices not in store order) and a tiny ViT's weights."""
    root = tmp_path_factory.mktemp("probe_resize")
    rng = np.random.default_rng(1)
    splits = ["train"] * 24 + ["val"] * 3 + ["test"] * 15
    rng.shuffle(splits)
    index = rng.permutation(500)[:len(splits)]
    rows = [{"image": _image(rng, i % 3), "label": i % 3, "split": s, "index": int(index[i])}
            for i, s in enumerate(splits)]
    write_store(rows, root / "store", name="wide", source="test", classes=["r", "g", "b"], rows_per_shard=10)
    torch.manual_seed(0)
    model = tiny_vit().eval()
    torch.save(model.state_dict(), root / "tiny.pt")
    return {"root": root, "store": str(root / "store"), "weights": str(root / "tiny.pt"), "model": model}


def _job(store, **kw):
    from raystudy.distributed.probe import ProbeJob

    return ProbeJob(store=store["store"], model=MODEL, model_kwargs=TINY, seed=SEED, weights=store["weights"],
                    batch_size=8, augment=False, local=True, **kw)


def _by_hand(model, store: str, split: str, resize: str) -> tuple[np.ndarray, np.ndarray]:
    """PIL-decoded images through ``eval_transform(32, resize)``, then timm's patch embedding, position
    embedding and blocks: ``f = mean_i z_i / ||.||`` of the last block's ``(n, d)`` tokens, rows by index."""
    t = read_split(store, split, columns=["image", "label", "index"]).to_pydict()
    order = np.argsort(t["index"])
    tf = eval_transform(32, resize)
    x = torch.stack([tf(pil_to_tensor(Image.open(io.BytesIO(t["image"][i])).convert("RGB"))) for i in order])
    assert x.shape == (len(order), 3, 32, 32)
    with torch.no_grad():
        z = model._pos_embed(model.patch_embed(x))
        for blk in model.blocks:
            z = blk(z)
    f = z.mean(dim=1).numpy()
    return f / np.linalg.norm(f, axis=-1, keepdims=True), np.asarray(t["label"])[order]


@pytest.mark.parametrize("data_path", ["decode", "cache"])
def test_stretch_features_are_the_stretched_images_features(store, data_path):
    """Both data paths give, for train (augment off) and test, the features of the stretched images to 1e-5;
    the crop's features differ from them (the 2:1 images lose half their width to the crop)."""
    from raystudy.distributed.probe import build_probe_model, features_local, model_spec

    job = _job(store, data_path=data_path, resize="stretch")
    model = build_probe_model(model_spec(job))
    for split in ("train", "test"):
        got, labels, _ = features_local(job, model, split, train=False, img_size=32)
        want, want_labels = _by_hand(store["model"], store["store"], split, "stretch")
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(labels, want_labels)
        crop, _ = _by_hand(store["model"], store["store"], split, "crop")
        assert np.abs(crop - want).max() > 1e-2


def test_decode_and_cache_paths_agree_and_record_the_transform(store):
    """The whole probe under stretch: the two data paths give the same test accuracy (features to 1e-6),
    the cache path reads the ``stretch`` kind, and probe.json names the stretch transform."""
    from raystudy.data.cache import cache_dir
    from raystudy.distributed.probe import build_probe_model, features_local, model_spec, run_probe_job

    decode, cache = _job(store, data_path="decode", resize="stretch"), _job(store, resize="stretch")
    model = build_probe_model(model_spec(decode))
    for split in ("train", "test"):
        np.testing.assert_allclose(features_local(cache, model, split, train=False, img_size=32)[0],
                                   features_local(decode, model, split, train=False, img_size=32)[0],
                                   rtol=0, atol=1e-6)
    a = run_probe_job(_job(store, data_path="decode", resize="stretch"))
    b = run_probe_job(_job(store, resize="stretch"))
    assert a["test_acc"] == b["test_acc"]
    for split in ("train", "test"):
        assert (Path(cache_dir(store["store"], split, "stretch", 32)) / "manifest.json").is_file()
    assert b["features"]["resize"] == "stretch" and b["job"]["resize"] == "stretch"
    assert b["features"]["transforms"] == {"train": "eval (stretch the whole image to img_size x img_size, bicubic)",
                                           "test": "eval (stretch the whole image to img_size x img_size, bicubic)"}
    crop = run_probe_job(_job(store))
    assert crop["features"]["transforms"]["test"] == "eval (resize the shorter side + center crop)"


def test_a_crop_probe_json_is_not_reused_for_stretch(store, tmp_path):
    """study.probes.stored_result: a probe.json fitted with crop answers a crop job only; one written
    before ``resize`` was recorded counts as crop."""
    from raystudy.distributed.probe import run_probe_job
    from raystudy.study.probes import stored_result

    out = str(tmp_path / "p")
    run_probe_job(_job(store, data_path="decode", out_dir=out))
    assert stored_result(_job(store, data_path="decode", out_dir=out))["job"]["resize"] == "crop"
    assert stored_result(_job(store, data_path="decode", out_dir=out, resize="stretch")) is None
    path = tmp_path / "p" / "probe.json"
    old = json.loads(path.read_text())
    old["job"].pop("resize")
    path.write_text(json.dumps(old))  # as a raystudy without the setting wrote it
    assert stored_result(_job(store, data_path="decode", out_dir=out)) is not None
    assert stored_result(_job(store, data_path="decode", out_dir=out, resize="stretch")) is None


def test_a_studys_resize_reaches_its_probe_job_and_the_cli_flag_sets_it(store, tmp_path):
    from raystudy.cli import build_parser
    from raystudy.commands.probe import job_from_args
    from raystudy.study.jobs import probe_job
    from raystudy.study.spec import StudySpec

    def spec(**extra):
        s = StudySpec.from_dict(dict(name="r", out=str(tmp_path / "s"), model=MODEL, img_size=32,
                                     weights=store["weights"], datasets={"wide": store["store"]},
                                     configurations=["MHA"], optimizers={"sgd": [0.01]}, seeds=[0],
                                     plasticity={"enabled": False},
                                     analysis=False, probe={"enabled": True}, **extra))
        s.validate(check_files=False)
        return s

    assert probe_job(spec(resize="stretch"), "wide", "x").resize == "stretch"
    assert probe_job(spec(), "wide", "x").resize == "crop"
    argv = ["probe", "--store", store["store"], "--model", MODEL, "--out", str(tmp_path / "o")]
    assert job_from_args(build_parser().parse_args([*argv, "--resize", "stretch"])).resize == "stretch"
    assert job_from_args(build_parser().parse_args(argv)).resize == "crop"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--resize", "squash"])
    with pytest.raises(ValueError, match="probe job: resize: 'squash' expected one of"):
        _job(store, resize="squash").validate()
