"""What finetuning changed, recorded per trial (issue #23 item 3): every run ends with the weight change of
each (component, block) against its start and, given a store, each block's linear CKA to the pretrained model
on that store's first images; the run writes them (``changes.parquet``), a study gathers them into
``changes.parquet/`` (one part per trial) and ``load_study`` returns them.

Checked on toy ViT runs from a weights file against independent computations: the file's tensors and the
finetuned model's by a numpy norm ratio (and LoRA's merged ``B A`` by hand), the CKA by the kernel (HSIC)
formula on the block outputs of a second model loaded from the file; a Head run changes no block (weight change
0, CKA 1); a frozen component's change is exactly 0; a run resumed from its step-2 checkpoint records the same
numbers as the uninterrupted one."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

from raystudy.core.change import block_outputs, first_images
from raystudy.core.finetune import FinetuneConfig, Finetuner, train_local
from raystudy.data.store import read_split
from raystudy.data.transforms import transform_batch
from raystudy.io import read_result
from raystudy.study.points import grid_point
from raystudy.study.results import ResultTables, load_study, part_name, trial_dir, trial_row
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.stores import make_store
from tests.unit.core.test_change import cka_by_kernels

N_IMAGES = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A weights file standing for a pretrained tiny ViT, a downstream store and a pretraining store."""
    root = tmp_path_factory.mktemp("change")
    torch.manual_seed(3)
    model = timm.create_model(STUDY_MODEL, img_size=32, num_classes=10, **STUDY_TINY)
    weights = root / "pre.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    return {"weights": str(weights), "store": make_store(root / "down", n_per_split=(16, 8, 8)),
            "pretrain": make_store(root / "pre", n_per_split=(4, 4, 9), seed=5, name="pre"), "root": root}


def _cfg(files, out, **kw) -> FinetuneConfig:
    base = dict(model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32, weights=files["weights"],
                store=files["store"], out_dir=str(out), steps=3, batch_size=8, eval_period=3, lr=0.1,
                configuration="MHA", change_store=files["pretrain"], change_images=N_IMAGES, data_path="decode")
    return FinetuneConfig(**{**base, **kw})


def _by(changes: list[dict], measure: str) -> dict:
    return {(r["component"], r["layer"]) if measure == "weight_change" else r["layer"]: r["value"]
            for r in changes if r["measure"] == measure}


def _pretrained(files) -> torch.nn.Module:
    model = timm.create_model(STUDY_MODEL, img_size=32, num_classes=10, **STUDY_TINY)
    model.load_state_dict(load_file(files["weights"]))
    return model.eval()


def _images(files) -> torch.Tensor:
    """The first N test rows of the pretraining store, read and transformed here."""
    rows = read_split(files["pretrain"], "test", columns=["image"]).column("image").to_pylist()[:N_IMAGES]
    return transform_batch(rows, train=False, size=32)


def test_first_images_are_the_splits_first_rows_eval_transformed(files):
    assert torch.equal(first_images(files["pretrain"], "test", N_IMAGES, 32), _images(files))
    assert first_images(files["pretrain"], "test", 100, 32).shape == (9, 3, 32, 32)  # all the split has
    val_test = read_split(files["pretrain"], "val", columns=["image"]).column("image").to_pylist()
    got = first_images(files["pretrain"], ["val", "test"], 5, 32)  # store order: the 4 val rows come first
    assert torch.equal(got[:4], transform_batch(val_test, train=False, size=32))
    with pytest.raises(ValueError, match="unknown value 'tset'"):
        first_images(files["pretrain"], "tset", 5, 32)


def test_an_mha_run_records_its_weight_change_and_cka_by_independent_computation(files, tmp_path):
    ft = Finetuner(_cfg(files, tmp_path / "run"))
    ft.run()
    w0, w1 = load_file(files["weights"]), ft.model.state_dict()
    weights = _by(ft.changes, "weight_change")
    assert len(weights) == 5 * 3 and len(ft.changes) == 5 * 3 + 3
    for (component, block), value in weights.items():
        if component != "MHA":
            assert value == 0.0, (component, block)  # frozen: bit-identical
            continue
        names = [f"blocks.{block}.attn.{p}" for p in ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias")]
        a = np.concatenate([w0[n].double().numpy().ravel() for n in names])
        b = np.concatenate([w1[n].detach().double().numpy().ravel() for n in names])
        assert value == pytest.approx(np.linalg.norm(b - a) / np.linalg.norm(a), rel=1e-12)
        assert value > 1e-4
    pre, images = _pretrained(files), _images(files)
    expected = [cka_by_kernels(x.double().numpy(), y.double().numpy())
                for x, y in zip(block_outputs(pre, images), block_outputs(ft.model.eval(), images), strict=True)]
    cka = _by(ft.changes, "cka")
    assert list(cka) == [0, 1, 2]
    assert [cka[i] for i in range(3)] == pytest.approx(expected, abs=1e-6)
    assert all(v < 1 - 1e-6 for v in cka.values())  # the trained MHA moved every block's output
    assert all(r["component"] is None for r in ft.changes if r["measure"] == "cka")


def test_a_head_run_changes_no_block(files, tmp_path):
    ft = Finetuner(_cfg(files, tmp_path / "run", configuration="Head"))
    ft.run()
    assert set(_by(ft.changes, "weight_change").values()) == {0.0}
    assert list(_by(ft.changes, "cka").values()) == pytest.approx([1.0] * 3, abs=1e-9)


def test_lora_records_the_merged_weight_change(files, tmp_path):
    ft = Finetuner(_cfg(files, tmp_path / "run", configuration="lora:r=2", lr=0.5))
    ft.run()
    w0 = load_file(files["weights"])
    params = {n: p.detach() for n, p in ft.model.named_parameters()}
    weights = _by(ft.changes, "weight_change")
    for block in range(3):
        attn = f"blocks.{block}.attn"
        delta = sum(float(torch.linalg.matrix_norm(params[f"{attn}.{p}.lora_B.default.weight"].double()
                                                   @ params[f"{attn}.{p}.lora_A.default.weight"].double()) ** 2)
                    for p in ("qkv", "proj"))  # alpha / r = 1
        norm = np.sqrt(sum(float(w0[f"{attn}.{p}"].double().norm() ** 2)
                           for p in ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias")))
        assert weights[("MHA", block)] == pytest.approx(np.sqrt(delta) / norm, rel=1e-5)  # merged in float32
        assert weights[("MHA", block)] > 0
        assert all(weights[(c, block)] == 0.0 for c in ("LN1", "LN2", "FC1", "FC2"))
    assert all(v < 1 for v in _by(ft.changes, "cka").values())


def test_a_resumed_run_records_what_the_uninterrupted_run_does(files, tmp_path):
    """Configuration All (the embedding trains too): the start is the run's own, not the checkpoint's step."""
    cfg = _cfg(files, tmp_path / "run", configuration="All", steps=4, eval_period=2, checkpoint_period=2, lr=0.05)
    whole, ckpt = Finetuner(cfg), tmp_path / "ckpt"

    def save_at_2(ev):
        if ev.checkpoint and ev.step == 2:
            whole.save(ckpt)

    whole.run(save_at_2)
    resumed = Finetuner(cfg)
    resumed.load(ckpt)
    assert resumed.step == 2
    resumed.run()
    assert resumed.changes == whole.changes
    assert all(v > 0 for v in _by(whole.changes, "weight_change").values())
    from_step_2 = Finetuner(cfg)
    from_step_2.load(ckpt)  # what a resume that took its start from the checkpoint would compare with
    with torch.no_grad():
        moved = {n: float((p - from_step_2.start_state[n]).norm()) for n, p in from_step_2.trained.trainable}
    assert max(moved.values()) > 0


def test_a_plain_run_writes_changes_parquet_and_without_a_store_the_weight_change_only(files, tmp_path):
    _, ft = train_local(_cfg(files, tmp_path / "run"))
    table = pd.read_parquet(tmp_path / "run" / "changes.parquet")
    assert list(table.columns) == ["layer", "component", "measure", "value"]
    pd.testing.assert_frame_equal(table, pd.DataFrame(ft.changes))
    assert table.loc[table.measure == "cka", "component"].isna().all() and (table.measure == "cka").sum() == 3
    for kw in ({"change_store": None}, {"change_images": 0}):
        _, plain = train_local(_cfg(files, tmp_path / "plain", **kw))
        assert {r["measure"] for r in plain.changes} == {"weight_change"} and len(plain.changes) == 15


def _changes(i: int) -> pd.DataFrame:
    rows = [{"layer": b, "component": c, "measure": "weight_change", "value": i + b / 10}
            for b in range(2) for c in ("LN1", "MHA")]
    rows += [{"layer": b, "component": None, "measure": "cka", "value": 1 - i / 100 - b / 1000} for b in range(2)]
    return pd.DataFrame(rows)


def _summary(i: int) -> dict:
    return {"status": "ok", "steps": 10, "batch_size": 8, "trainable_params": 10, "best_val_acc": 0.5,
            "best_val_step": 10, "test_acc": 0.5, "final_val_loss": 1.0, "wall_seconds": 1.0,
            "configuration": "MHA", "optimizer": "sgd", "lr": 0.01, "seed": i}


def test_the_study_table_has_one_part_per_trial_and_load_study_joins_it(tmp_path):
    study = str(tmp_path / "study")
    points = [grid_point("a", "MHA", "sgd", 0.01, i) for i in range(3)]
    tables = ResultTables(study)
    for i, p in enumerate(points[:2]):
        tables.add(trial_row(p, "m", _summary(i)), None, _changes(i))
    # the third trial's directory (a run's own files) is picked up by reconcile, its changes with it
    run = trial_dir(study, points[2]["trial_id"])
    from raystudy.core.finetune.outputs import write_outputs

    write_outputs(run, _summary(2), [], changes=_changes(2).to_dict("records"))
    assert tables.reconcile(points, "m") == [points[2]["trial_id"]]
    parts = sorted(p.name for p in (tmp_path / "study" / "changes.parquet").iterdir())
    assert parts == sorted(part_name(p["trial_id"]) for p in points)
    table = read_result(study, "changes")
    assert len(table) == 3 * 6 and list(table.columns) == ["trial_id", "layer", "component", "measure", "value"]
    for i, p in enumerate(points):
        own = table[table.trial_id == p["trial_id"]].drop(columns="trial_id").reset_index(drop=True)
        pd.testing.assert_frame_equal(own, _changes(i), check_dtype=False)
    loaded = load_study(study)
    assert len(loaded.changes) == 18 and set(loaded.changes.seed) == {0, 1, 2}
    assert (loaded.changes.configuration == "MHA").all() and (loaded.changes.lr == 0.01).all()
    assert "changes: 18 rows" in repr(loaded)
    # a trial without changes (an older run) drops its part; the others stay
    tables.add(trial_row(points[0], "m", _summary(0)))
    assert sorted(ResultTables(study).change_ids) == sorted(p["trial_id"] for p in points[1:])
