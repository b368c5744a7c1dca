"""GPT-2 and DINOv3 measured as the paper's authors measure them, through the Ray plasticity pipeline: padded text rows
and normed MHA."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tr

from raystudy.data.pairing import positions
from raystudy.data.text_demo import prepare_text_demo
from raystudy.distributed.plasticity import PlasticityJob, run_plasticity
from tests.ray.test_text_plasticity import _read_all, _tokenizer_file
from tests.unit.core.test_authors_measurements import (
    _sorted,
    authors_rates,
    tiny_gpt2,
)

N_TOKENS, PAIRS = 20, 20  # the test texts have 15-22 tokens: some are cut, some padded


@pytest.fixture(scope="module")
def gpt2_setup(tmp_path_factory):
    """Two text stores and a random-init GPT-2 folder whose ``config.json`` has no pad token and the
    tokenizer's ``[PAD]`` as its end-of-text token (GPT-2's ``<|endoftext|>`` plays that part)."""
    root = tmp_path_factory.mktemp("gpt2")
    stores = prepare_text_demo(root / "data", count=40)
    tokenizer = _tokenizer_file(root / "tokenizer.json")
    fast = tr.PreTrainedTokenizerFast(tokenizer_file=tokenizer)
    eos = fast.convert_tokens_to_ids("[PAD]")
    folder = root / "gpt2"
    tiny_gpt2(fast.vocab_size, eos_token_id=eos, bos_token_id=eos).save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    return {"stores": stores, "gpt2": str(folder), "eos": eos}


def authors_rows(store: str, split: str, tokenizer_file: str, eos: int) -> tuple[list[int], torch.Tensor]:
    """Store indices and ``input_ids`` of the authors' loader over ``split``: ``tokenizer(texts, truncation=True,
    padding="max_length", max_length=n)`` with ``pad_token = eos_token``."""
    t = _read_all(store).to_pandas()
    t = t[t["split"] == split]
    tok = tr.PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    tok.pad_token = tok.convert_ids_to_tokens(eos)
    enc = tok(t["text"].tolist(), truncation=True, padding="max_length", max_length=N_TOKENS, return_tensors="pt")
    return t["index"].tolist(), enc["input_ids"]


def test_padded_text_rows_and_normed_mha_through_the_pipeline(ray_session, gpt2_setup, tmp_path):
    """A plasticity job with ``text_rows="padded"`` and ``mha_input="normed"``: its pairs are the authors'
    padded sequences (the pairing recipe over one row per text), its rates their ``get_decomposition``'s."""
    stores, folder = gpt2_setup["stores"], gpt2_setup["gpt2"]
    job = PlasticityJob(model=f"hf:{folder}", pretrain=stores["text-news"], downstream=[stores["text-nature"]],
                        out_dir=str(tmp_path / "out"), pairs=PAIRS, batch_size=8, pairing="random", seed=3,
                        seq_len=N_TOKENS, text_rows="padded", mha_input="normed", cpus_per_worker=0.5,
                        figures=False, control="none")
    assert run_plasticity(job, progress=False)["n_pairs"] == PAIRS
    tok_file = f"{folder}/tokenizer.json"
    pre_index, pre_ids = authors_rows(stores["text-news"], "test", tok_file, gpt2_setup["eos"])
    down_index, down_ids = authors_rows(stores["text-nature"], "test", tok_file, gpt2_setup["eos"])
    assert (pre_ids == gpt2_setup["eos"]).any() and (pre_ids != gpt2_setup["eos"]).all(dim=1).any()  # both kinds
    px, py = positions("random", len(pre_index), len(down_index), PAIRS, seed=3, batch_size=8)
    pairs = pd.read_parquet(tmp_path / "out" / "pairs.parquet").sort_values("pair")
    assert pairs["pretrain_index"].tolist() == [pre_index[i] for i in px]
    assert pairs["downstream_index"].tolist() == [down_index[i] for i in py]
    assert (pairs["pretrain_start"] == 0).all() and (pairs["downstream_start"] == 0).all()
    model = tr.AutoModel.from_pretrained(folder).eval()
    ref = _sorted(authors_rates(model, pre_ids[px], down_ids[py]))
    got = _sorted(pd.read_parquet(tmp_path / "out" / "rates.parquet"))
    np.testing.assert_allclose(got["rate"], ref["rate"], rtol=1e-5, atol=1e-6)

