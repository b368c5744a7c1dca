"""GPT-2 and DINOv3 measured as the paper's authors measure them (issue "The paper, second pass", items 4
and 5; their ``apps/ablation/gpt2.py`` and ``dinov3.py``, branch ``dev``): GPT-2's MHA fed with ``ln_1`` of
the embeddings (``mha_input="normed"``), each text's first ``n`` tokens padded to ``n`` with GPT-2's
end-of-text token (``text_rows="padded"``), and a gated MLP's FC1 as its value projection alone
(``gated_fc1="up"``: their ``up_proj``, timm's ``fc1_x``).

The references here are literal re-implementations of the authors' code: ``get_decomposition`` (every
component applied to the embedding ``wte(ids) + wpe(0..n-1)``, ``attn(ln_1(e), attention_mask=None)``, FC2
of the zero-lifted embedding) with their rate ``||f(x) - f(y)|| / ||e_x - e_y||``, and their loaders'
``tokenizer(texts, truncation=True, padding="max_length", max_length=n)`` through ``transformers``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tr

from raystudy.core.input_checks import PlasticityInputError
from raystudy.core.plasticity import pair_rates
from raystudy.distributed.plasticity import PlasticityJob
from raystudy.vocab import COMPONENTS
from tests.support.families import dinov3_style, eva02_glu_style

AUTHORS_KEYS = ("attn_norm", "attn", "ffn_norm", "ffn_fc1", "ffn_fc2")  # LN1, MHA, LN2, FC1, FC2



@torch.inference_mode()
def authors_decomposition(model, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The authors' ``Gpt2.get_decomposition``, line for line."""
    outputs = {}
    inputs_embeds = model.wte(input_ids)
    position_ids = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
    out = inputs_embeds + model.wpe(position_ids)
    outputs["embedding"] = out
    for i, block in enumerate(model.h):
        block_out = block.ln_1(out)
        outputs[f"block{i}_attn_norm"] = block_out
        block_out, _ = block.attn(hidden_states=block_out, attention_mask=None)
        outputs[f"block{i}_attn"] = block_out
        outputs[f"block{i}_ffn_norm"] = block.ln_2(out)
        block_out = block.mlp.c_fc(out)
        outputs[f"block{i}_ffn_fc1"] = block_out
        zero_list = [torch.zeros_like(out)] * (block_out.shape[-1] // out.shape[-1] - 1)
        outputs[f"block{i}_ffn_fc2"] = block.mlp.c_proj(torch.cat((out, *zero_list), dim=-1))
    return outputs



def authors_rates(model, x: torch.Tensor, y: torch.Tensor) -> pd.DataFrame:
    """``distance(z1, z2) / distance(embedding)`` per pair, block and component (their ``get_plasticity``)."""
    ox, oy = authors_decomposition(model, x), authors_decomposition(model, y)

    def dist(a, b):
        return ((a - b) ** 2).flatten(start_dim=1).sum(dim=-1).sqrt()

    den = dist(ox["embedding"], oy["embedding"])
    rows = [{"pair": p, "layer": i, "component": c, "rate": float(r)}
            for i in range(len(model.h)) for c, key in zip(COMPONENTS, AUTHORS_KEYS)
            for p, r in enumerate(dist(ox[f"block{i}_{key}"], oy[f"block{i}_{key}"]) / den)]
    return pd.DataFrame(rows)



def _sorted(t: pd.DataFrame) -> pd.DataFrame:
    return t.sort_values(["pair", "layer", "component"]).reset_index(drop=True)



def tiny_gpt2(vocab: int = 64, **kw):
    torch.manual_seed(0)
    return tr.GPT2Model(tr.GPT2Config(vocab_size=vocab, n_layer=2, n_embd=32, n_head=4, n_positions=32, **kw)).eval()



def test_normed_mha_equals_the_authors_get_decomposition():
    model = tiny_gpt2()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (6, 16), generator=g), torch.randint(0, 64, (6, 16), generator=g)
    got = _sorted(pair_rates(model, x, y, mode="embedding", mha_input="normed"))
    ref = _sorted(authors_rates(model, x, y))
    assert got[["pair", "layer", "component"]].equals(ref[["pair", "layer", "component"]])
    np.testing.assert_allclose(got["rate"], ref["rate"], rtol=1e-5, atol=1e-7)
    # the paper's definition (raw) differs from it in MHA only
    raw = _sorted(pair_rates(model, x, y, mode="embedding"))
    mha = raw["component"] == "MHA"
    np.testing.assert_allclose(raw.loc[~mha, "rate"], got.loc[~mha, "rate"], rtol=1e-6)
    assert not np.allclose(raw.loc[mha, "rate"], got.loc[mha, "rate"], rtol=1e-3)



def test_normed_mha_applies_to_embedding_mode_only():
    model, ids = tiny_gpt2(), torch.randint(0, 64, (2, 8))
    with pytest.raises(PlasticityInputError, match="applies to mode 'embedding'"):
        pair_rates(model, ids, ids.flip(0), mode="hidden", mha_input="normed")
    with pytest.raises(PlasticityInputError, match="unknown mha_input 'ln1'"):
        pair_rates(model, ids, ids.flip(0), mha_input="ln1")
    with pytest.raises(ValueError, match="mha_input='normed' applies to mode 'embedding'"):
        PlasticityJob(model="hf:x", pretrain="p", downstream=["d"], out_dir="o", mode="hidden",
                      mha_input="normed").validate()



@pytest.mark.parametrize("mode", ["embedding", "hidden"])
def test_gated_fc1_up_is_the_value_projection_alone(mode):
    """On a random-init timm Eva with SwiGLU (DINOv3's layout): FC1's rate with ``gated_fc1="up"`` is
    ``||fc1_x(x) - fc1_x(y)|| / ||x - y||``, ``x, y`` the embeddings (``embedding``) or FC1's true inputs (the
    block's ``norm2`` of its input, captured by a hook on ``fc1_x`` here); the other components do not change."""
    from raystudy.core.plasticity_reference import reference_embedding

    torch.manual_seed(0)
    model = dinov3_style().eval()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(5, 3, 32, 32, generator=g), torch.randn(5, 3, 32, 32, generator=g)
    up = _sorted(pair_rates(model, x, y, mode=mode, gated_fc1="up"))
    stacked = _sorted(pair_rates(model, x, y, mode=mode))
    fc1 = up["component"] == "FC1"
    np.testing.assert_allclose(up.loc[~fc1, "rate"], stacked.loc[~fc1, "rate"], rtol=1e-6)
    with torch.no_grad():
        if mode == "embedding":
            ex, ey = reference_embedding(model, x)[0], reference_embedding(model, y)[0]
            inputs = [(ex, ey)] * len(model.blocks)
        else:
            seen = []
            hooks = [b.mlp.fc1_x.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for b in model.blocks]
            model.forward_features(x), model.forward_features(y)
            for h in hooks:
                h.remove()
            k = len(model.blocks)
            inputs = list(zip(seen[:k], seen[k:]))
        for layer, (a, b) in enumerate(inputs):
            fx = model.blocks[layer].mlp.fc1_x
            ref = torch.linalg.vector_norm((fx(a) - fx(b)).flatten(1), dim=1) / torch.linalg.vector_norm(
                (a - b).flatten(1), dim=1)
            got = up[fc1 & (up["layer"] == layer)].sort_values("pair")["rate"].to_numpy()
            np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5)
            assert not np.allclose(got, stacked[fc1 & (stacked["layer"] == layer)]["rate"], rtol=1e-3)



def test_gated_fc1_up_refuses_a_packed_projection_and_changes_nothing_ungated():
    from tests.support.models import tiny_vit

    x, y = torch.randn(3, 3, 32, 32), torch.randn(3, 3, 32, 32)
    with pytest.raises(PlasticityInputError, match="packs them in one fc1"):
        pair_rates(eva02_glu_style().eval(), x, y, gated_fc1="up")
    vit = tiny_vit().eval()
    pd.testing.assert_frame_equal(pair_rates(vit, x, y, gated_fc1="up"), pair_rates(vit, x, y))

