"""A deliberately literal plasticity reference for the Hugging Face text families (GPT-2, BERT, Llama).

The yardstick for :mod:`raystudy.core.hf` + :mod:`raystudy.core.plasticity`: it shares no code with
either; its last step, the rates from the recorded inputs and outputs, is the image reference's
(:func:`raystudy.core.plasticity_reference.reference_rates`). Every input is built here from the model's
own modules, written out as the model's forward does it:

* Embedding stage. GPT-2: ``drop(wte(ids) + wpe(arange(n)))``. BERT: ``dropout(LayerNorm(word(ids) +
  token_type(0) + position(p)))`` with ``p = arange(n)`` (RoBERTa: ``padding_idx + 1 + arange(n)``; the
  inputs hold no padding token). Llama: ``embed_tokens(ids)``.
* Attention. GPT-2 and Llama get an explicit additive causal mask ``(1, 1, n, n)`` (the dtype's minimum
  above the diagonal), built here rather than by ``transformers.masking_utils``; Llama also gets
  ``rotary_emb(h, arange(n))``; BERT gets no mask (no padding). BERT's MHA is
  ``attention.output.dense(attention.self(h))``.
* ``embedding`` mode: every component applied to the embeddings ``z``; FC1 as the model's own module(s)
  (GPT-2 ``c_fc``; Llama ``[gate_proj(z), up_proj(z)]``); FC2 to the explicitly zero-lifted tokens
  ``[z_i, 0, ..., 0] in R^h``.
* ``hidden`` mode: each layer's submodules run step by step (pre-LN for GPT-2 / Llama, post-LN for BERT),
  recording each component's input and output.
* Two separate forward passes (``x``, then ``y``); outputs copied to the host; the norms
  ``||f(x_i) - f(y_i)||_F / ||x_i - y_i||_F`` computed there in float64.

Slow by design; used by the tests.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import nn

from raystudy.core.plasticity_reference import Record, host, reference_rates


def text_family(model: nn.Module) -> str:
    """``"gpt2"``, ``"bert"``, ``"roberta"`` or ``"llama"`` from the class of ``model.base_model``."""
    import transformers as tr

    base = getattr(model, "base_model", None)
    for family, classes in (("gpt2", (tr.GPT2Model,)), ("bert", (tr.BertModel,)),
                            ("roberta", (tr.RobertaModel, tr.XLMRobertaModel)), ("llama", (tr.LlamaModel,))):
        if isinstance(base, classes):
            return family
    raise TypeError(f"the text reference implements GPT-2, BERT, RoBERTa and Llama, not {type(model).__name__}")


def _layers(model: nn.Module) -> list[nn.Module]:
    base, family = model.base_model, text_family(model)
    if family == "gpt2":
        return list(base.h)
    if family == "llama":
        return list(base.layers)
    return list(base.encoder.layer)


def reference_text_tokens(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The embedding stage from the model's own modules: ``(N, n)`` token ids -> ``(N, n, d)``."""
    base, family = model.base_model, text_family(model)
    pos = torch.arange(ids.shape[1], device=ids.device)  # (n,)
    if family == "gpt2":
        return base.drop(base.wte(ids) + base.wpe(pos)[None])
    if family == "llama":
        return base.embed_tokens(ids)
    emb = base.embeddings
    if family == "roberta":
        pos = pos + emb.padding_idx + 1
    z = emb.word_embeddings(ids) + emb.token_type_embeddings(torch.zeros_like(ids)) + emb.position_embeddings(pos)
    return emb.dropout(emb.LayerNorm(z))


def _causal(h: torch.Tensor) -> torch.Tensor:
    """Additive causal mask ``(1, 1, n, n)``: 0 on and below the diagonal, the dtype's minimum above."""
    n = h.shape[1]
    above = torch.ones(n, n, dtype=torch.bool, device=h.device).triu(1)
    return torch.zeros(n, n, dtype=h.dtype, device=h.device).masked_fill(above, torch.finfo(h.dtype).min)[None, None]


def _mha(model: nn.Module, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The attention component of ``layer`` on ``h`` ``(N, n, d)``, output ``(N, n, d)``."""
    family = text_family(model)
    if family == "gpt2":
        return layer.attn(h, attention_mask=_causal(h))[0]
    if family == "llama":
        cos_sin = model.base_model.rotary_emb(h, torch.arange(h.shape[1], device=h.device)[None])
        return layer.self_attn(h, position_embeddings=cos_sin, attention_mask=_causal(h))[0]
    return layer.attention.output.dense(layer.attention.self(h, attention_mask=None)[0])


def _mlp_parts(model: nn.Module, layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """``(LN1, LN2, FC2, act)`` modules of ``layer`` (FC1 is family-specific, see :func:`_fc1`)."""
    family = text_family(model)
    if family == "gpt2":
        return layer.ln_1, layer.ln_2, layer.mlp.c_proj, layer.mlp.act
    if family == "llama":
        return layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.down_proj, layer.mlp.act_fn
    return (layer.attention.output.LayerNorm, layer.output.LayerNorm, layer.output.dense,
            layer.intermediate.intermediate_act_fn)


def _fc1(model: nn.Module, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """FC1's output ``(N, n, h)`` (Llama: ``(N, n, 2h)``, gate then up)."""
    family = text_family(model)
    if family == "gpt2":
        return layer.mlp.c_fc(h)
    if family == "llama":
        return torch.cat([layer.mlp.gate_proj(h), layer.mlp.up_proj(h)], dim=-1)
    return layer.intermediate.dense(h)


def _fc2_width(model: nn.Module, layer: nn.Module) -> int:
    """FC2's input width ``h``: GPT-2's ``Conv1D`` stores its weight ``(in, out)``, ``nn.Linear`` ``(out, in)``."""
    fc2 = _mlp_parts(model, layer)[2]
    return fc2.weight.shape[0] if text_family(model) == "gpt2" else fc2.weight.shape[1]


def _embedding_records(model: nn.Module, z: torch.Tensor) -> list[Record]:
    """Every component of every layer applied to the embeddings ``z`` ``(N, n, d)``."""
    records = []
    zh = host(z)
    for layer in _layers(model):
        ln1, ln2, fc2, _ = _mlp_parts(model, layer)
        lifted = torch.cat([z, z.new_zeros(*z.shape[:-1], _fc2_width(model, layer) - z.shape[-1])], dim=-1)
        records.append({"LN1": (zh, host(ln1(z))), "MHA": (zh, host(_mha(model, layer, z))),
                        "LN2": (zh, host(ln2(z))), "FC1": (zh, host(_fc1(model, layer, z))),
                        "FC2": (zh, host(fc2(lifted)))})
    return records


def _pre_ln_step(model: nn.Module, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Record]:
    """One GPT-2 / Llama layer: ``x = x + MHA(LN1(x))``, ``x = x + FC2(act(FC1(LN2(x))))`` (Llama:
    ``FC2(act(gate) * up)``), with each component's input and output. ``(N, n, d) -> (N, n, d)``."""
    ln1, ln2, fc2, act = _mlp_parts(model, layer)
    a = ln1(x)
    m = _mha(model, layer, a)
    rec = {"LN1": (host(x), host(a)), "MHA": (host(a), host(m))}
    x = x + m
    b = ln2(x)
    f = _fc1(model, layer, b)
    if text_family(model) == "llama":
        gate, up = layer.mlp.gate_proj(b), layer.mlp.up_proj(b)
        g = act(gate) * up
    else:
        g = act(f)
    o = fc2(g)
    rec.update(LN2=(host(x), host(b)), FC1=(host(b), host(f)), FC2=(host(g), host(o)))
    if text_family(model) == "gpt2":
        o = layer.mlp.dropout(o)
    return x + o, rec


def _post_ln_step(model: nn.Module, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Record]:
    """One BERT layer: ``h1 = LN1(x + MHA(x))``, ``out = LN2(FC2(act(FC1(h1))) + h1)``, with each
    component's input and output. ``(N, n, d) -> (N, n, d)``."""
    ln1, ln2, fc2, act = _mlp_parts(model, layer)
    m = _mha(model, layer, x)
    s = x + layer.attention.output.dropout(m)
    h1 = ln1(s)
    f = layer.intermediate.dense(h1)
    g = act(f)
    o = fc2(g)
    t = layer.output.dropout(o) + h1
    out = ln2(t)
    rec = {"MHA": (host(x), host(m)), "LN1": (host(s), host(h1)), "FC1": (host(h1), host(f)),
           "FC2": (host(g), host(o)), "LN2": (host(t), host(out))}
    return out, rec


def reference_text_blocks(model: nn.Module, z: torch.Tensor) -> tuple[list[torch.Tensor], list[Record]]:
    """All layers on the embeddings ``z`` ``(N, n, d)``, step by step: each layer's output and records.

    Returns the list of layer outputs ``[(N, n, d)] * L`` and each layer's component inputs/outputs.
    """
    step = _post_ln_step if text_family(model) in ("bert", "roberta") else _pre_ln_step
    outputs, records = [], []
    for layer in _layers(model):
        z, rec = step(model, layer, z)
        outputs.append(z)
        records.append(rec)
    return outputs, records


@torch.no_grad()
def _records(model: nn.Module, ids: torch.Tensor, mode: str) -> list[Record]:
    z = reference_text_tokens(model, ids)
    return _embedding_records(model, z) if mode == "embedding" else reference_text_blocks(model, z)[1]


def pair_rates_text_reference(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, mode: str = "embedding"
) -> pd.DataFrame:
    """Same contract as :func:`raystudy.core.plasticity.pair_rates` for token ids, computed literally.

    ``x, y``: token-id batches ``(N, n)``; returns columns ``pair, layer, component, rate``
    (:func:`raystudy.core.plasticity_reference.reference_rates`). The model is left in eval mode.
    """
    return reference_rates(_records, model, x, y, mode)
