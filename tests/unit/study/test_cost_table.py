"""The dry run's cost table counts each model's inputs (images or tokens)."""

from __future__ import annotations

import pytest

from tests.support.models import STUDY_MODEL


@pytest.mark.parametrize("model, unit", [(STUDY_MODEL, "images/s"), ("hf:sentence-transformers/all-MiniLM-L6-v2",
                                                                   "sequences/s")])
def test_the_cost_table_counts_the_models_inputs(tmp_path, model, unit):
    import numpy as np
    import pandas as pd

    from raystudy.analysis.pipeline import run_analysis
    from raystudy.core.finetune import FinetuneConfig
    from raystudy.core.finetune.outputs import run_summary
    from raystudy.io import write_result
    from tests.unit.analysis.test_analysis_beyond import _rows

    inputs = run_summary(FinetuneConfig(model=model, store="s", out_dir="o"))["inputs"]  # what a run records
    rows = [{**r, "model": model, "images_per_s": 100.0, "inputs": inputs} for r in _rows(np.random.default_rng(0))
            if r["configuration"] in ("MHA", "Head")]
    write_result(pd.DataFrame(rows), tmp_path / "s", "trials")
    cost = run_analysis(tmp_path / "s", figures=False).rendered["cost"]
    assert cost.blocks[0].columns[-1] == unit

