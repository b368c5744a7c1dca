"""Sequential pairing through the Ray plasticity pipeline: the rates and a fixed radius equal the core's on the same
pairs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from raystudy.core.bounds import measure_token_stats, upper_bounds
from raystudy.core.plasticity import pair_rates_tensor, rates_frame
from raystudy.data.store import read_split
from raystudy.data.transforms import transform_batch
from raystudy.distributed.plasticity import run_plasticity
from tests.unit.data import test_pairing
from tests.unit.data.test_pairing import (
    SEQUENTIAL_PAIRS,
    _job,
    _pairs,
)

#: the fixture of test_pairing.py, a fixture of this file too (the same files, built again here)
stores = test_pairing.stores


def _images(store: str, indices, splits=("train", "val", "test")) -> torch.Tensor:
    """The eval-transformed images of ``store`` with the given ``index`` values, in that order."""
    rows = {}
    for split in splits:
        t = read_split(store, split)
        rows.update(zip(t["index"].to_pylist(), t["image"].to_pylist()))
    return transform_batch([rows[int(i)] for i in indices], train=False, size=32)


def test_sequential_pipeline_rates_and_fixed_radius(ray_session, stores, tmp_path):
    job = _job(stores, tmp_path / "run", radius=19.4)
    summary = run_plasticity(job, progress=False)
    got = {t: pd.read_parquet(tmp_path / "run" / f"{t}.parquet") for t in ("pairs", "rates", "bounds")}
    model = stores["model"]
    for name, store in zip(("alpha", "beta"), stores["down"]):
        expected = SEQUENTIAL_PAIRS[name]
        assert _pairs(got["pairs"], name) == expected
        x = _images(stores["pre"], [p for p, _ in expected])
        y = _images(store, [d for _, d in expected], splits=("test",))
        ref = rates_frame(pair_rates_tensor(model, x, y, mode="embedding"))  # pair i on (pre[i], down[i])
        rates = got["rates"][(got["rates"].dataset == name) & (got["rates"].weights == "pretrained")]
        rates = rates.reset_index(drop=True)
        pd.testing.assert_frame_equal(rates[["pair", "layer", "component"]], ref[["pair", "layer", "component"]])
        np.testing.assert_allclose(rates["rate"], ref["rate"], rtol=1e-5)
    assert summary["pairing"] == "sequential" and summary["pretrain"]["split"] == "train+val+test"
    assert summary["datasets"]["alpha"]["downstream_reuse"] == 2 and summary["pretrain"]["reuse"] == 1

    # bounds at the fixed radius; the radius measured on the pairs' pretraining images kept beside it
    stats = measure_token_stats(model, _images(stores["pre"], [p for p, _ in SEQUENTIAL_PAIRS["alpha"]]))
    ref = upper_bounds(model, radius=19.4, seq_len=stats.seq_len, sigma=stats.sigma)
    bounds = got["bounds"]
    assert (bounds["radius"] == 19.4).all() and abs(stats.radius - 19.4) > 1
    np.testing.assert_allclose(bounds["radius_measured"], stats.radius, rtol=1e-5)
    np.testing.assert_allclose(bounds["bound"], ref["bound"], rtol=1e-5)

