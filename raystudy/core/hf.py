"""Hugging Face ``transformers`` language models: component adapters and ``build_model("hf:<dir>")``.

Three families, each matched on the model's *base* model (``model.base_model``), so the bare model, its
LM head model and its sequence-classification model share one adapter:

``hf-gpt2`` (``GPT2Model``: pre-LN, causal attention, ``Conv1D`` weights stored ``(in, out)``)
    LN1 ``ln_1``, MHA ``attn`` (``c_attn`` and ``c_proj``), LN2 ``ln_2``, FC1 ``mlp.c_fc``, FC2
    ``mlp.c_proj``. Embedding stage ``drop(wte(ids) + wpe(positions))``.
``hf-bert`` (``BertModel``, ``RobertaModel``, ``XLMRobertaModel``: post-LN; MiniLM checkpoints are BERT)
    A layer computes ``h1 = LN1(h + MHA(h))``, ``h2 = LN2(FC2(act(FC1(h1))) + h1)``. MHA is the
    self-attention *with* its output dense layer (``attention.self`` + ``attention.output.dense``, before
    the residual), LN1 ``attention.output.LayerNorm``, FC1 ``intermediate.dense`` (the linear map only),
    FC2 ``output.dense``, LN2 ``output.LayerNorm``. Embedding stage: the ``embeddings`` module (word +
    position + token type, then its LayerNorm). In hidden mode every component gets its true input
    (MHA the layer input, LN1 ``h + MHA(h)``, FC1 LN1's output, FC2 ``act(FC1)``, LN2 ``FC2 + h1``).
``hf-llama`` (``LlamaModel``: RMSNorm, SwiGLU, rotary positions, grouped KV heads)
    LN1 ``input_layernorm``, MHA ``self_attn`` (rotary embeddings computed as the model does), LN2
    ``post_attention_layernorm``. The gated MLP ``down(act(gate(x)) * up(x))`` maps as: FC1 = ``gate_proj``
    and ``up_proj`` stacked (one linear ``d -> 2h``), FC2 = ``down_proj`` (``h -> d``). Embedding stage
    ``embed_tokens`` (positions live inside attention).

Inputs are token-id batches ``(N, n)`` (LongTensor, no padding). Components that are not one
``nn.Linear`` in the model are presented through small views (:class:`ConvLinear`, the components
module's ``StackedLinear``, the attention wrappers) whose ``weight`` is in ``nn.Linear`` orientation
``(out, in)``; each adapter runs its blocks through these components (:meth:`_HFAdapter.block_forward`),
so forward hooks on them see every component's true input. The head (``Head``) is every top-level module
of the model other than the base model (``score``, ``classifier``, ``lm_head``); BERT's pooler belongs to
the base model (``All``).

Nothing here imports ``transformers`` at module import time: matching an HF model needs it loaded anyway.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from raystudy.core.components import (
    Adapter,
    BlockComponents,
    StackedLinear,
    UnsupportedModelError,
    register_adapter,
)
from raystudy.core.input_checks import PlasticityInputError
from raystudy.data.modality import hf_source
from raystudy.terminal import interactive

#: What :func:`build_hf_model` builds: the bare base model, or one with a sequence-classification head.
HF_TASKS = ("features", "classification")


# --------------------------------------------------------------------------------------------------
# Linear views and attention wrappers
# --------------------------------------------------------------------------------------------------


class ConvLinear(nn.Module):
    """GPT-2's ``Conv1D`` (``y = x W + b``, ``W`` stored ``(in, out)``) seen as a linear layer.

    ``weight`` is ``W^T`` ``(out, in)`` like ``nn.Linear``'s; calling the view calls the ``Conv1D`` itself,
    ``(..., in) -> (..., out)``.
    """

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv
        self.in_features, self.out_features = conv.weight.shape

    @property
    def weight(self) -> torch.Tensor:
        return self.conv.weight.t()

    @property
    def bias(self) -> torch.Tensor | None:
        return self.conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def _positions(h: torch.Tensor) -> torch.Tensor:
    """Position ids ``(1, n)`` for hidden states ``(N, n, d)`` without cache or padding."""
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


def _causal_mask(config, h: torch.Tensor):
    """The attention mask the model's own forward builds for ``h`` ``(N, n, d)``: causal, no padding.

    ``None`` where the attention kernel applies the causal mask itself (SDPA's ``is_causal``).
    """
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config=config, inputs_embeds=h, attention_mask=None, cache=None,
                              position_ids=_positions(h))


class GPT2SelfAttention(nn.Module):
    """GPT-2's ``attn`` with the model's causal mask: ``(N, n, d) -> (N, n, d)`` (after ``c_proj``)."""

    def __init__(self, attn: nn.Module, config):
        super().__init__()
        self.attn, self.config = attn, config
        self.num_heads = attn.num_heads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.attn(h, attention_mask=_causal_mask(self.config, h))[0]


class BertSelfAttention(nn.Module):
    """A BERT layer's self-attention and its output dense layer, before residual and LayerNorm.

    ``(N, n, d) -> (N, n, d)``: ``dropout(dense(self_attention(h)))``; causal when the model is a decoder.
    """

    def __init__(self, attention: nn.Module, config):
        super().__init__()
        self.attention, self.config = attention, config
        self.num_heads = attention.self.num_attention_heads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        if self.config.is_decoder:
            mask = _causal_mask(self.config, h)
        else:
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=None)
        out = self.attention.output
        return out.dropout(out.dense(self.attention.self(h, attention_mask=mask)[0]))

    # The per-head matrices :func:`raystudy.core.bounds.attention_heads` reads (``(out, in)`` weights).
    q_proj = property(lambda self: self.attention.self.query)
    k_proj = property(lambda self: self.attention.self.key)
    v_proj = property(lambda self: self.attention.self.value)
    proj = property(lambda self: self.attention.output.dense)


class LlamaSelfAttention(nn.Module):
    """Llama's ``self_attn`` with the model's rotary embeddings and causal mask: ``(N, n, d) -> (N, n, d)``."""

    def __init__(self, attn: nn.Module, rotary: nn.Module, config):
        super().__init__()
        self.attn, self.rotary, self.config = attn, rotary, config
        self.num_heads = config.num_attention_heads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rope = self.rotary(h, position_ids=_positions(h))  # (cos, sin), each (1, n, head_dim)
        return self.attn(h, position_embeddings=rope, attention_mask=_causal_mask(self.config, h))[0]


# --------------------------------------------------------------------------------------------------
# Token-id input checks
# --------------------------------------------------------------------------------------------------


def check_token_batches(x: torch.Tensor, y: torch.Tensor, *, vocab_size: int, max_len: int | None) -> None:
    """Validate token-id batches ``x, y`` ``(N, n)``: integer ids in ``[0, vocab_size)``, equal shapes,
    ``N, n > 0`` and ``n <= max_len`` (absolute position embeddings). Raises ``PlasticityInputError``."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise PlasticityInputError(f"x and y must be tensors, got {type(x).__name__} and {type(y).__name__}")
    if x.shape != y.shape:
        raise PlasticityInputError(f"x and y must have the same shape (equal-length windows, no padding), "
                                   f"got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.ndim != 2 or x.numel() == 0:
        raise PlasticityInputError(f"a text model takes token-id batches of shape (N, n) with N, n > 0, "
                                   f"got {tuple(x.shape)}")
    for name, t in (("x", x), ("y", y)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise PlasticityInputError(f"{name} must hold integer token ids, got dtype {t.dtype}")
        bad = ((t < 0) | (t >= vocab_size)).any(dim=1)
        if bad.any():
            raise PlasticityInputError(f"{name} has token ids outside [0, {vocab_size}) in pair(s) "
                                       f"{bad.nonzero().flatten().tolist()[:10]}")
    if max_len is not None and x.shape[1] > max_len:
        raise PlasticityInputError(f"sequences of {x.shape[1]} tokens exceed the model's {max_len} positions")


# --------------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------------


def _transformers_classes(names: tuple[str, ...]) -> tuple[type, ...]:
    """The named ``transformers`` classes that this installation has (none when it is not loaded)."""
    module = sys.modules.get("transformers")
    if module is None:  # an HF model cannot exist without transformers imported
        return ()
    found = []
    for name in names:
        try:
            found.append(getattr(module, name))
        except (AttributeError, ImportError):  # pragma: no cover - older/newer transformers
            pass
    return tuple(found)


class _HFAdapter(Adapter):
    """Shared part of the HF adapters: the base model, its parameter-name prefix, head, input checks.

    Subclasses set ``base_classes`` and ``layers_path`` and implement :meth:`_components`,
    :meth:`block_forward`, :meth:`embed` and :meth:`_embedding_paths`.
    """

    base_classes: tuple[str, ...] = ()
    layers_path: str = ""  # the ModuleList of layers, relative to the base model

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        classes = _transformers_classes(cls.base_classes)
        return bool(classes) and isinstance(getattr(model, "base_model", None), classes)

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.base = model.base_model
        self.config = model.config
        self.base_prefix = "" if self.base is model else f"{model.base_model_prefix}."
        if getattr(self.config, "add_cross_attention", False):
            raise UnsupportedModelError(f"{type(model).__name__} has cross-attention layers; raystudy's "
                                        "HF adapters cover self-attention stacks only")
        layers = self.base.get_submodule(self.layers_path)
        prefix = f"{self.base_prefix}{self.layers_path}."
        self._blocks = [self._components(layer, f"{prefix}{i}.") for i, layer in enumerate(layers)]

    def _components(self, layer: nn.Module, prefix: str) -> BlockComponents:
        raise NotImplementedError

    def block_forward(self, b: BlockComponents, h: torch.Tensor) -> torch.Tensor:
        """One layer, as the model runs it, through the component modules: ``(N, n, d) -> (N, n, d)``."""
        raise NotImplementedError

    def _embedding_paths(self) -> tuple[str, ...]:
        raise NotImplementedError

    def blocks(self) -> list[BlockComponents]:
        return self._blocks

    def run_blocks(self, tokens: torch.Tensor) -> torch.Tensor:
        for b in self._blocks:
            tokens = self.block_forward(b, tokens)
        return tokens

    def embedding_names(self) -> tuple[str, ...]:
        return tuple(self.base_prefix + p for p in self._embedding_paths())

    def head_modules(self) -> dict[str, nn.Module]:
        if self.base is self.model:  # the bare base model has no head
            return {}
        return {f"{name}.": child for name, child in self.model.named_children()
                if child is not self.base and any(True for _ in child.parameters())}

    def max_positions(self) -> int | None:
        """Longest sequence the embedding stage accepts (absolute position embeddings), ``None`` if any."""
        return self.config.max_position_embeddings

    def check_inputs(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Token-id batches ``(N, n)`` (see :func:`check_token_batches`)."""
        vocab = self.base.get_input_embeddings().num_embeddings
        check_token_batches(x, y, vocab_size=vocab, max_len=self.max_positions())


@register_adapter
class HFGPT2Adapter(_HFAdapter):
    family = "hf-gpt2"
    description = "Hugging Face GPT-2 (GPT2Model, GPT2LMHeadModel, GPT2ForSequenceClassification, ...)"

    base_classes = ("GPT2Model",)
    layers_path = "h"
    _names = {"LN1": "ln_1", "MHA": "attn", "LN2": "ln_2", "FC1": "mlp.c_fc", "FC2": "mlp.c_proj"}

    def _components(self, layer: nn.Module, prefix: str) -> BlockComponents:
        return BlockComponents(
            LN1=layer.ln_1, MHA=GPT2SelfAttention(layer.attn, self.config), LN2=layer.ln_2,
            FC1=ConvLinear(layer.mlp.c_fc), FC2=ConvLinear(layer.mlp.c_proj),
            prefix=prefix, names=self._names, layerscale={}, module=layer,
        )

    def block_forward(self, b: BlockComponents, h: torch.Tensor) -> torch.Tensor:
        # GPT2Block: h = h + attn(ln_1(h)); h = h + dropout(c_proj(act(c_fc(ln_2(h)))))
        h = h + b.MHA(b.LN1(h))
        mlp = b.module.mlp
        return h + mlp.dropout(b.FC2(mlp.act(b.FC1(b.LN2(h)))))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``(N, n)`` token ids -> ``(N, n, d)``: ``drop(wte(ids) + wpe(0..n-1))``, as GPT2Model.forward."""
        base = self.base
        return base.drop(base.wte(ids) + base.wpe(_positions(ids)))

    def _embedding_paths(self) -> tuple[str, ...]:
        return ("wte", "wpe")

    def unbounded_components(self) -> dict[str, str]:
        return {"MHA": "causal attention mask (the bound is derived for unmasked self-attention)"}


@register_adapter
class HFBertAdapter(_HFAdapter):
    family = "hf-bert"
    description = ("Hugging Face BERT family, post-LN (BertModel, RobertaModel, XLMRobertaModel and their "
                   "task models; MiniLM / sentence-transformers checkpoints)")

    base_classes = ("BertModel", "RobertaModel", "XLMRobertaModel")
    layers_path = "encoder.layer"
    _names = {"LN1": "attention.output.LayerNorm", "MHA": ("attention.self", "attention.output.dense"),
              "LN2": "output.LayerNorm", "FC1": "intermediate.dense", "FC2": "output.dense"}

    def _components(self, layer: nn.Module, prefix: str) -> BlockComponents:
        return BlockComponents(
            LN1=layer.attention.output.LayerNorm, MHA=BertSelfAttention(layer.attention, self.config),
            LN2=layer.output.LayerNorm, FC1=layer.intermediate.dense, FC2=layer.output.dense,
            prefix=prefix, names=self._names, layerscale={}, module=layer,
        )

    def block_forward(self, b: BlockComponents, h: torch.Tensor) -> torch.Tensor:
        # BertLayer: h1 = LN1(h + MHA(h)); h2 = LN2(dropout(FC2(act(FC1(h1)))) + h1)
        h1 = b.LN1(h + b.MHA(h))
        layer = b.module
        g = layer.intermediate.intermediate_act_fn(b.FC1(h1))
        return b.LN2(layer.output.dropout(b.FC2(g)) + h1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``(N, n)`` token ids -> ``(N, n, d)``: the model's ``embeddings`` module (token type 0)."""
        return self.base.embeddings(input_ids=ids)

    def _embedding_paths(self) -> tuple[str, ...]:
        return ("embeddings",)

    def unbounded_components(self) -> dict[str, str]:
        if self.config.is_decoder:
            return {"MHA": "causal attention mask (the bound is derived for unmasked self-attention)"}
        return {}

    def max_positions(self) -> int | None:
        # RoBERTa numbers positions from padding_idx + 1, so two of its position embeddings are unused
        emb = self.base.embeddings
        offset = emb.padding_idx + 1 if hasattr(emb, "padding_idx") else 0
        return self.config.max_position_embeddings - offset


@register_adapter
class HFLlamaAdapter(_HFAdapter):
    family = "hf-llama"
    description = "Hugging Face Llama (LlamaModel, LlamaForCausalLM, LlamaForSequenceClassification)"

    base_classes = ("LlamaModel",)
    layers_path = "layers"
    _names = {"LN1": "input_layernorm", "MHA": "self_attn", "LN2": "post_attention_layernorm",
              "FC1": ("mlp.gate_proj", "mlp.up_proj"), "FC2": "mlp.down_proj"}

    def _components(self, layer: nn.Module, prefix: str) -> BlockComponents:
        mlp = layer.mlp
        return BlockComponents(
            LN1=layer.input_layernorm, MHA=LlamaSelfAttention(layer.self_attn, self.base.rotary_emb, self.config),
            LN2=layer.post_attention_layernorm, FC1=StackedLinear(mlp.gate_proj, mlp.up_proj), FC2=mlp.down_proj,
            prefix=prefix, names=self._names, layerscale={}, module=layer,
        )

    def block_forward(self, b: BlockComponents, h: torch.Tensor) -> torch.Tensor:
        # LlamaDecoderLayer: h = h + attn(ln1(h)); h = h + down(act(gate(ln2(h))) * up(ln2(h)))
        h = h + b.MHA(b.LN1(h))
        gate, up = b.FC1(b.LN2(h)).chunk(2, dim=-1)
        return h + b.FC2(b.module.mlp.act_fn(gate) * up)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``(N, n)`` token ids -> ``(N, n, d)``: ``embed_tokens(ids)`` (rotary positions act in attention)."""
        return self.base.embed_tokens(ids)

    def _embedding_paths(self) -> tuple[str, ...]:
        return ("embed_tokens",)

    def unbounded_components(self) -> dict[str, str]:
        return {"MHA": "rotary position embedding (RoPE) and causal mask inside attention"}

    def max_positions(self) -> int | None:
        return None  # rotary positions: no table to run out of


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------

def classifier_pad_id(config) -> int | None:
    """The padding id a sequence classifier built from ``config`` uses: ``pad_token_id``, else the first
    ``eos_token_id`` (GPT-2 and Llama have no pad token; their classifier reads the last non-pad token)."""
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = getattr(config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _check_local_dir(path: Path, pretrained: bool) -> None:
    """A local model directory needs ``config.json`` and, for ``pretrained``, a weights file."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory (an HF model directory holds config.json + weights)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    if pretrained and not any((path / f).is_file() for f in _WEIGHT_FILES):
        raise FileNotFoundError(f"{path} has config.json but no weights ({', '.join(_WEIGHT_FILES)})")


def build_hf_model(
    source: str | Path,
    *,
    num_classes: int | None = None,
    task: str | None = None,
    pretrained: bool = True,
    **kwargs,
) -> nn.Module:
    """A ``transformers`` model from a local directory (``config.json`` + weights) or a hub id (internet).

    Args:
        source: the directory, installed model package or hub id (:func:`hf_source`); a leading ``hf:``
            is dropped.
        num_classes: classes of the sequence-classification head (implies ``task="classification"``).
        task: ``"features"`` (the bare base model, ``AutoModel``) or ``"classification"``
            (``AutoModelForSequenceClassification``, head newly initialised); default from ``num_classes``.
        pretrained: load the weights; ``False`` builds a randomly initialised model from the config.
        kwargs: passed to ``from_pretrained`` / ``from_config`` (e.g. ``attn_implementation="eager"``).

    GPT-2 and Llama classifiers get ``pad_token_id = eos_token_id`` when the config has none (HF's
    classifier reads the last non-pad token; raystudy's windows hold no padding).
    """
    import transformers

    source = hf_source(source)
    task = task or ("classification" if num_classes is not None else "features")
    if task not in HF_TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {HF_TASKS}")
    if task == "classification" and num_classes is None:
        raise ValueError("task='classification' needs num_classes")
    local = Path(source).expanduser()
    if local.exists() or source.startswith((".", "/", "~")):
        _check_local_dir(local, pretrained)
        source = str(local)
    config = transformers.AutoConfig.from_pretrained(source, local_files_only=local.is_dir())
    auto = transformers.AutoModel
    if task == "classification":
        auto = transformers.AutoModelForSequenceClassification
        config.num_labels = num_classes
        config.pad_token_id = classifier_pad_id(config)
    if not pretrained:
        return auto.from_config(config, **kwargs)
    if not interactive():  # its "Loading weights" bar would write carriage returns into a log
        transformers.utils.logging.disable_progress_bar()
    return auto.from_pretrained(source, config=config, local_files_only=local.is_dir(), **kwargs)
