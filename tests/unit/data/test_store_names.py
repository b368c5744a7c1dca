"""A store's or a dataset's name cannot write outside ``--out``, from the CLI or the Ray pipeline."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from raystudy.cli import main
from tests.support.stores import make_store

MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs",
         json.dumps({"img_size": 32, "patch_size": 8, "depth": 2})]


def _everything(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def _escaping_store(tmp_path: Path) -> Path:
    """A copy of a good store whose dataset.json names it ``../../../STORE_ESCAPE`` (checksum untouched)."""
    store = Path(make_store(tmp_path / "stores" / "copied", n_per_split=(4, 2, 6), name="tiny"))
    meta = json.loads((store / "dataset.json").read_text())
    meta["name"] = "../../../STORE_ESCAPE"
    (store / "dataset.json").write_text(json.dumps(meta))
    return store


def test_store_name_cannot_write_outside_out(tmp_path, capsys):
    bad = _escaping_store(tmp_path)
    good = make_store(tmp_path / "stores" / "good", n_per_split=(4, 2, 6), name="good", seed=1)
    out = tmp_path / "a" / "b" / "c" / "out"
    before = _everything(tmp_path)
    assert main(["plasticity", *MODEL, "--x", good, "--y", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{bad / 'dataset.json'} 'name': '../../../STORE_ESCAPE' is not a valid name" in err
    assert _everything(tmp_path) == before  # nothing written, least of all STORE_ESCAPE.png three levels up


def test_dataset_flag_cannot_write_outside_out(tmp_path, capsys):
    x = make_store(tmp_path / "stores" / "x", n_per_split=(4, 2, 6), name="x")
    y = make_store(tmp_path / "stores" / "y", n_per_split=(4, 2, 6), name="y", seed=1)
    out = tmp_path / "a" / "b" / "c" / "out"
    before = _everything(tmp_path)
    assert main(["plasticity", *MODEL, "--x", x, "--y", y, "--dataset", "../../../OUTSIDE",
                 "--out", str(out)]) == 2
    assert "--dataset: '../../../OUTSIDE' is not a valid name" in capsys.readouterr().err
    assert _everything(tmp_path) == before
    # the same stores with a valid --dataset write inside --out only, the figures under the given name
    assert main(["plasticity", *MODEL, "--x", x, "--y", y, "--dataset", "renamed", "--out", str(out)]) == 0
    assert {p for p in _everything(tmp_path) - before if not p.startswith("a/b/c/out")} == {"a", "a/b", "a/b/c"}
    assert {"plasticity_renamed.png", "rates_renamed.svg"} <= set(os.listdir(out))


def test_ray_pipeline_refuses_the_store_name_before_any_work(tmp_path):
    from raystudy.distributed.plasticity import PlasticityJob, plan_pairs

    bad = _escaping_store(tmp_path)
    good = make_store(tmp_path / "stores" / "good", n_per_split=(4, 2, 6), name="good", seed=1)
    job = PlasticityJob(model="vit_tiny_patch16_224", pretrain=good, downstream=[str(bad)], pairs=4,
                        out_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match=re.escape(f"{bad}/dataset.json 'name': '../../../STORE_ESCAPE'")):
        plan_pairs(job)

