"""Component-wise finetuning of text classifiers: a tiny random-init BERT (and GPT-2) saved with a tokenizer
trained here (no download) on the built-in labelled text store: tokenisation, exact freezing per
configuration, learning, exact resume, and the Ray Train path equal to the local one."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pandas as pd
import pytest
import torch

from raystudy.core.finetune import FinetuneConfig, Finetuner, fingerprint, train_local
from raystudy.core.finetune.text import TextSplitData, open_text_split
from raystudy.data.store import read_split
from raystudy.data.text_demo import prepare_text_demo
from tests.support.runs import kill_at_first_checkpoint

D, LAYERS, FFN, C = 32, 2, 64, 4  # hidden size, layers, FFN width, classes of text-nature


def train_tokenizer(path):
    """A WordPiece tokenizer with BERT's normaliser, pre-tokeniser and [CLS] ... [SEP] template, trained on
    the demo's sentences; written to ``path/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from raystudy.data.text_demo import CORPORA, sentences

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator([s for c in CORPORA for s, _ in sentences(c, 200, seed=7)], trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls),
                                                                                                ("[SEP]", sep)])
    tok.save(str(path / "tokenizer.json"))
    return tok


def save_model(path, family: str, dropout: float = 0.0) -> str:
    """A random-init base model (no head, like a pretrained checkpoint) + tokenizer in ``path``."""
    import transformers

    path.mkdir(parents=True)
    tok = train_tokenizer(path)
    torch.manual_seed(0)
    if family == "bert":
        config = transformers.BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=D, num_hidden_layers=LAYERS,
                                         num_attention_heads=2, intermediate_size=FFN, max_position_embeddings=64,
                                         hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                         pad_token_id=0)
        transformers.BertModel(config).save_pretrained(path)
    else:
        config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_embd=D, n_layer=LAYERS, n_head=2,
                                         n_positions=64, resid_pdrop=dropout, embd_pdrop=dropout,
                                         attn_pdrop=dropout, bos_token_id=2, eos_token_id=3, pad_token_id=0)
        transformers.GPT2Model(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    # 2 in 3 words from the topic (the demo's 1 in 4 is too hard for the tiny random-init model's 40 steps)
    return prepare_text_demo(tmp_path_factory.mktemp("textstores"), count=100, topic_share=2 / 3)["text-nature"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("models") / "bert", "bert")


def text_cfg(model, store, out, **kw) -> FinetuneConfig:
    base = dict(model=f"hf:{model}", store=store, out_dir=str(out), configuration="MHA", optimizer="sgd", lr=0.1,
                seed=0, steps=3, batch_size=8, eval_period=3, log_period=1, checkpoint_period=0, shuffle=True)
    base.update(kw)
    return FinetuneConfig(**base)


# ---- tokenisation --------------------------------------------------------------------------------


def test_texts_are_encoded_with_special_tokens_truncated_and_padded(bert, store):
    from raystudy.data.text_stream import load_tokenizer

    tok = load_tokenizer(bert)
    every = [t for s in ("train", "val", "test") for t in read_split(store, s, columns=["text"])["text"].to_pylist()]
    longest = max(len(tok.encode(t, add_special_tokens=False).ids) for t in every) + 2
    texts = read_split(store, "train", columns=["text"]).column("text").to_pylist()
    content = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    full = open_text_split(text_cfg(bert, store, "unused"), "train")
    assert full.seq_len == longest  # seq_len None: the store's longest text (train/val/test), nothing cut
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    for i in (0, 1, len(texts) - 1):
        want = [cls, *content[i], sep]
        assert full.ids[i].tolist() == want + [0] * (longest - len(want))
        assert full.mask[i].tolist() == [1] * len(want) + [0] * (longest - len(want))
    cut = TextSplitData(store, "train", tokenizer=f"{bert}/tokenizer.json", seq_len=6, pad_id=0)
    assert cut.ids.shape == (len(texts), 6) and cut.mask.all()
    assert cut.ids[0].tolist() == [cls, *content[0][:4], sep]
    batch = cut.batch(np.array([3, 0]))
    assert batch.input_ids.dtype == torch.int64 and torch.equal(batch.input_ids[1], torch.from_numpy(cut.ids[0]).long())
    assert batch.labels.tolist() == read_split(store, "train", columns=["label"]).column("label").to_pylist()[3::-3]


def test_a_text_store_reads_the_same_tokens_on_every_data_path(bert, store, tmp_path, capsys):
    """The modality seam: a text store's data path is its tokens whatever ``data_path`` asks; it has no
    image caches to plan or prepare, no images to preview, no image line in ``data info``; an image model on
    it raises naming the store and the model."""
    from raystudy.cli import main
    from raystudy.core.finetune.data import open_split_data, prepare_caches
    from raystudy.core.finetune.preview import preview_batch
    from raystudy.data.store import StoreError
    from raystudy.distributed.cache import plan_caches

    caches = tmp_path / "caches"
    decoded = open_split_data(text_cfg(bert, store, tmp_path, data_path="decode"), "test")
    cached_cfg = text_cfg(bert, store, tmp_path, data_path="cache", cache_dir=str(caches))
    cached = open_split_data(cached_cfg, "test")
    assert isinstance(decoded, TextSplitData) and isinstance(cached, TextSplitData)
    assert np.array_equal(decoded.ids, cached.ids) and np.array_equal(decoded.mask, cached.mask)
    assert np.array_equal(decoded.labels, cached.labels) and len(decoded) == len(read_split(store, "test"))
    prepare_caches(cached_cfg)
    assert not caches.exists()
    assert plan_caches([store], ["train", "test"], ["full", "eval"], 32, root=str(caches)) == []
    with pytest.raises(StoreError, match="a text store has no images to preview"):
        preview_batch(store, "train", n=2, seed=0, data_path="cache", size=32)
    with pytest.raises(ValueError, match=rf"{re.escape(str(store))} is a text store but model vit_tiny_patch16_224 "
                                         "takes images"):
        open_text_split(dataclasses.replace(text_cfg(bert, store, tmp_path), model="vit_tiny_patch16_224"), "train")
    assert main(["data", "info", str(store)]) == 0
    out = capsys.readouterr().out
    assert ", text)" in out.splitlines()[0] and "skipped images" not in out


# ---- freezing ------------------------------------------------------------------------------------

LAYER = r"bert\.encoder\.layer\.(\d)\."
EXPECTED = {  # configuration -> the names it trains besides the head, written from BERT's own names (re.match)
    "LN1": LAYER + r"attention\.output\.LayerNorm\.",
    "MHA": LAYER + r"attention\.(self\.(query|key|value)|output\.dense)\.",
    "LN2": LAYER + r"output\.LayerNorm\.",
    "FC1": LAYER + r"intermediate\.dense\.",
    "FC2": LAYER + r"output\.dense\.",
    "Emb": r"bert\.embeddings\.",
    "All": r"bert\.",
    "Head": r"$^",
}
HEAD = {"classifier.weight", "classifier.bias"}


def expected_trainable(names: list[str], configuration: str) -> set[str]:
    if configuration == "MHA@1+FC1@0":
        return HEAD | {n for n in names for c, layer in (("MHA", "1"), ("FC1", "0"))
                       if (m := re.match(EXPECTED[c], n)) and m.group(1) == layer}
    return HEAD | {n for n in names if re.match(EXPECTED[configuration], n)}


@pytest.mark.parametrize("configuration", [*EXPECTED, "MHA@1+FC1@0"])
def test_freezing_is_exact_per_configuration(bert, store, tmp_path, configuration):
    """Only the configuration's parameters and the classifier change; BERT's pooler trains in All only."""
    ft = Finetuner(text_cfg(bert, store, tmp_path, configuration=configuration, steps=2))
    init = {n: p.detach().clone() for n, p in ft.model.named_parameters()}
    want = expected_trainable(list(init), configuration)
    assert set(ft.trained.names) == want
    assert any(n.startswith("bert.pooler.") for n in want) == (configuration == "All")
    ft.run(progress=False)
    for n, p in ft.model.named_parameters():
        assert torch.equal(p.detach(), init[n]) == (n not in want), f"{configuration}: {n}"
    mha = LAYERS * (4 * D * D + 4 * D)
    fc1 = LAYERS * (D * FFN + FFN)
    counts = {"LN1": LAYERS * 2 * D, "MHA": mha, "FC1": fc1, "MHA@1+FC1@0": (mha + fc1) // 2}
    if configuration in counts:
        assert ft.trained.num_trainable == counts[configuration] + D * C + C


def test_gpt2_classifier_trains_its_configuration_and_keeps_the_final_norm_frozen(store, tmp_path):
    gpt2 = save_model(tmp_path / "gpt2", "gpt2")
    ft = Finetuner(text_cfg(gpt2, store, tmp_path / "run", configuration="LN1", steps=2))
    init = {n: p.detach().clone() for n, p in ft.model.named_parameters()}
    want = {f"transformer.h.{i}.ln_1.{w}" for i in range(LAYERS) for w in ("weight", "bias")} | {"score.weight"}
    assert set(ft.trained.names) == want
    assert ft.train_data.ids[0, ft.train_data.mask[0].sum():].tolist() == [0] * (ft.train_data.seq_len
                                                                              - ft.train_data.mask[0].sum())
    summary = ft.run(progress=False)
    assert summary["status"] == "ok"
    for n, p in ft.model.named_parameters():
        assert torch.equal(p.detach(), init[n]) == (n not in want), n
    with_norm = Finetuner(text_cfg(gpt2, store, tmp_path / "norm", configuration="LN1", train_final_norm=True))
    assert set(with_norm.trained.names) == want | {"transformer.ln_f.weight", "transformer.ln_f.bias"}


# ---- learning, resume ----------------------------------------------------------------------------


def test_loss_goes_down_on_a_learnable_text_task(bert, store, tmp_path):
    """Labels are the sentence's topic (2 in 3 words from it): a random-init BERT learns it."""
    summary, ft = train_local(text_cfg(bert, store, tmp_path, configuration="All", optimizer="adamw", lr=1e-2,
                                       steps=40, batch_size=16, eval_period=10, warmup_steps=4), tensorboard=False)
    losses = [r["train_loss"] for r in ft.curves]
    assert np.mean(losses[:3]) == pytest.approx(np.log(C), abs=0.05)  # a fresh head: chance-level loss
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3])
    assert summary["test_acc"] >= 0.6 and summary["best_val_acc"] >= 0.6  # chance: 0.25
    curves = pd.read_parquet(tmp_path / "curves.parquet")
    assert curves["train_loss"].tolist() == losses


def test_resume_is_exact_on_text_with_dropout(store, tmp_path):
    """Killed after its checkpoint at step 3, a resumed run of a model with dropout (the RNG state comes
    back from the checkpoint) reproduces the uninterrupted run bitwise."""
    model = save_model(tmp_path / "bert-dropout", "bert", dropout=0.1)
    kw = dict(configuration="FC1", optimizer="adamw", lr=3e-3, steps=6, eval_period=2, checkpoint_period=3)
    ref, ref_ft = train_local(text_cfg(model, store, tmp_path / "ref", **kw), tensorboard=False)
    cfg = text_cfg(model, store, tmp_path / "run", **kw)
    ckdir = tmp_path / "run" / "ckpt"
    first = Finetuner(cfg)

    kill_at_first_checkpoint(first, ckdir)
    torch.manual_seed(999)
    summary, ft = train_local(cfg, checkpoint_dir=ckdir, resume=True, tensorboard=False)
    assert ft.restores[0]["step"] == 3 and [r["step"] for r in ft.curves] == list(range(1, 7))
    assert ft.restores[0]["trainable"] == fingerprint(first.trainable_state())
    for a, b in zip(ref_ft.curves, ft.curves):
        assert {k: v for k, v in a.items() if k != "images_per_s"} == {k: v for k, v in b.items()
                                                                         if k != "images_per_s"}
    for n, p in ref_ft.trained.trainable:
        assert torch.equal(p, dict(ft.trained.trainable)[n]), n
    for k in ("best_val_acc", "best_val_step", "test_acc", "final_val_loss", "trainable_params"):
        assert summary[k] == ref[k]
    other = text_cfg(model, store, tmp_path / "run", **{**kw, "seq_len": 8})
    with pytest.raises(ValueError, match="seq_len"):  # another tokenisation is another run
        Finetuner(other).load(ckdir / "checkpoint_00000003")


# ---- Ray Train ---------------------------------------------------------------------------------


def test_ray_train_path_equals_the_local_path(ray_session, bert, store, tmp_path):
    from safetensors.torch import load_file

    from raystudy.distributed.train import run_finetune

    kw = dict(configuration="MHA@1+FC1@0", steps=4, eval_period=2, save_final=True)
    ray_cfg = text_cfg(bert, store, tmp_path / "ray", **kw)
    summary = run_finetune(ray_cfg)
    local, ft = train_local(text_cfg(bert, store, tmp_path / "local", **kw), tensorboard=False)
    assert summary["status"] == local["status"] == "ok"
    a, b = (pd.read_parquet(tmp_path / d / "curves.parquet") for d in ("ray", "local"))
    for col in ("train_loss", "grad_norm", "val_loss", "val_acc"):  # bitwise (NaN where no evaluation)
        pd.testing.assert_series_equal(a[col], b[col], check_exact=True)
    final = load_file(tmp_path / "ray" / "final_model.safetensors")
    for n, p in ft.model.state_dict().items():
        assert torch.equal(final[n], p), n
    for k in ("best_val_acc", "test_acc", "final_val_loss", "trainable_params"):
        assert summary[k] == local[k]
