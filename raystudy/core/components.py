"""The component registry: which module computes LN1, MHA, LN2, FC1 and FC2 in every block.

A pre-norm transformer block computes::

    x = x + MHA(LN1(x))          # LN1: LayerNorm before attention; MHA: attention incl. output projection
    x = x + FC2(act(FC1(LN2(x))))  # LN2: LayerNorm before the MLP; FC1 / FC2: the two MLP linear layers

Finetuning *configurations* are the five component names (that component trainable in every block,
everything else frozen), ``Emb`` (the embedding stage alone, see :func:`embedding_parameters`), ``All``
(every parameter trainable) and ``Head`` (only the classifier). The classification head is trainable in
every configuration but is never part of a selection returned here; callers add :func:`head_parameters`
themselves.

Each supported architecture family has exactly one :class:`Adapter` that maps these names to modules and
parameters. Unsupported models fail with :class:`UnsupportedModelError`, which lists the families.

LayerScale (DINOv2-style ``ls1`` / ``ls2``, BEiT's and Eva's ``gamma_1`` / ``gamma_2``) is *not* part of
any component by default: the paper's components are the LayerNorms, the attention module and the two
linear layers. Pass ``include_layerscale=True`` to :func:`trainable_parameters` to attach the first to MHA
and the second to FC2 (the component whose output each one scales). Plasticity always measures the
component without it.

Gated MLPs (SwiGLU / GLU, ``FC2(act(W_g x) * W_x x)``): FC1 is the input projection *including the gate*,
the linear map ``x -> [W_g x ; W_x x]`` (``d -> 2h``; :class:`StackedLinear` where the two projections are
separate modules, the fused ``fc1`` where they are one), FC2 the output projection ``h -> d``. The gating
product ``act(W_g x) * W_x x`` belongs to no component, exactly like GELU between FC1 and FC2 of a plain
MLP; so does a normalisation inside the MLP (EVA-02's ``mlp.norm`` applied to the gated activation before
``fc2``): it is trained only by ``All``, and in ``hidden`` mode FC2's input is what ``fc2`` receives, i.e.
the normalised activation.

timm's Eva family (EVA-02, DINOv3; :class:`TimmEvaAdapter`): embedding stage = ``patch_embed``, the class
and register tokens, the absolute position embedding where there is one (EVA-02; DINOv3 has none),
``norm_pre``, exactly as ``Eva.forward_features`` before its blocks. Its positions are mostly the rotary
embedding (RoPE) that ``Eva._pos_embed`` computes for the image's patch grid and every ``block.attn``
applies to queries and keys (``rope=``): it is part of MHA's computation in both plasticity modes, so an
MHA rate is that of attention *with* RoPE; it has no parameters. Components: ``norm1``, ``attn`` (incl.
``q_norm`` / ``k_norm`` / ``norm`` / ``proj``), ``norm2``, FC1 as above (``mlp.fc1`` for GELU ``Mlp`` and the
packed ``GluMlp``, ``[mlp.fc1_g; mlp.fc1_x]`` for ``SwiGLU``), ``mlp.fc2``; LayerScale ``gamma_1`` /
``gamma_2``. Post-norm blocks (``use_post_norm``) and per-block mixed RoPE are not supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from raystudy.core.input_checks import check_pair_batches
from raystudy.vocab import COMPONENTS, CONFIGURATIONS


class UnsupportedModelError(TypeError):
    """Raised for a model that no adapter in the registry supports."""


@dataclass(frozen=True)
class BlockComponents:
    """The modules of one block, by component name.

    ``LN1``/``LN2`` map ``(B, n, d) -> (B, n, d)``; ``MHA`` maps ``(B, n, d) -> (B, n, d)``;
    ``FC1`` is a linear ``d -> h`` and ``FC2`` a linear ``h -> d`` (``h = 4d`` in a standard ViT). FC1 and
    FC2 only need ``weight`` ``(out, in)``, ``in_features`` and a forward: a view such as
    :class:`StackedLinear` qualifies.

    ``inputs`` maps a component that is such a view (never called by the model's forward) to a module the
    forward *does* call with the component's input as first argument (a gated MLP's ``fc1_g``): ``hidden``
    mode reads the component's input there. Components not listed are called themselves.
    """

    LN1: nn.Module
    MHA: nn.Module
    LN2: nn.Module
    FC1: nn.Linear
    FC2: nn.Linear
    prefix: str  # parameter-name prefix of the block, e.g. "blocks.3."
    # component -> module path(s) relative to the block, e.g. {"MHA": "attn", "FC1": ("mlp.fc1_g", "mlp.fc1_x")}
    names: dict[str, str | tuple[str, ...]]
    layerscale: dict[str, str]  # component -> name (relative to the block) of the LayerScale scaling its output
    module: nn.Module  # the whole block: (B, n, d) -> (B, n, d)
    inputs: dict[str, nn.Module] = field(default_factory=dict)  # view component -> module called with its input

    def __getitem__(self, component: str) -> nn.Module:
        if component not in COMPONENTS:
            raise KeyError(f"unknown component {component!r}; expected one of {COMPONENTS}")
        return getattr(self, component)

    def input_module(self, component: str) -> nn.Module:
        """The module the model's forward calls with ``component``'s input as first argument."""
        return self.inputs.get(component, self[component])


class StackedLinear(nn.Module):
    """Several linear layers reading the same input, as one linear map ``x -> [W_1 x + b_1; ...; W_k x + b_k]``.

    ``(..., d) -> (..., h_1 + ... + h_k)``. A view for the component registry (a gated MLP's FC1 =
    ``[W_g; W_x]``): it holds the layers without registering them as submodules, so it adds no parameters
    and the model's forward never calls it.
    """

    def __init__(self, *parts: nn.Linear):
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("StackedLinear needs at least one nn.Linear, all with the same in_features")
        self._parts = tuple(parts)  # a tuple: not registered as submodules
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def parts(self) -> tuple[nn.Linear, ...]:
        """The stacked layers, in order (a SwiGLU's ``(fc1_g, fc1_x)``)."""
        return self._parts

    @property
    def weight(self) -> torch.Tensor:
        """The stacked weight ``(h_1 + ... + h_k, d)``."""
        return torch.cat([p.weight for p in self._parts], dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self._parts], dim=-1)


class Adapter:
    """Maps one architecture family's modules to component names. Subclass and :func:`register_adapter`."""

    family: str = ""
    description: str = ""

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        raise NotImplementedError

    def __init__(self, model: nn.Module):
        self.model = model

    def blocks(self) -> list[BlockComponents]:
        """The components of every block, in depth order (layer 0 first)."""
        raise NotImplementedError

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Embedding stage: ``(N, 3, H, W)`` images -> ``(N, n, d)`` tokens fed to the first block."""
        raise NotImplementedError

    def check_inputs(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Validate a pair of input batches for :meth:`embed`; raises ``PlasticityInputError``.

        Default: image batches ``(N, C, H, W)`` (:func:`raystudy.core.input_checks.check_pair_batches`);
        text adapters check token-id batches ``(N, n)`` instead.
        """
        check_pair_batches(x, y)

    def embedding_names(self) -> tuple[str, ...]:
        """Model attributes (modules or bare parameters) holding the parameters :meth:`embed` uses.

        Names the model lacks, or sets to ``None``, are skipped by :func:`embedding_parameters`.
        """
        raise NotImplementedError

    def attention_kwargs(self) -> dict:
        """Model-level keyword arguments every MHA call needs (e.g. a shared relative position bias).

        They may depend on the batch last passed to :meth:`embed` (Eva's rotary embedding follows the
        image's patch grid): call :meth:`embed` first, on the same adapter.
        """
        return {}

    def unbounded_components(self) -> dict[str, str]:
        """Components whose upper bound's assumptions this model breaks, with the reason (e.g. RoPE in MHA).

        :func:`raystudy.core.bounds.upper_bounds` reports their bound as NaN with a warning.
        """
        return {}

    def run_blocks(self, tokens: torch.Tensor) -> torch.Tensor:
        """All blocks in order, exactly as the model's forward runs them: ``(N, n, d) -> (N, n, d)``."""
        for b in self.blocks():
            tokens = b.module(tokens)
        return tokens

    def head_modules(self) -> dict[str, nn.Module]:
        """Classifier module(s) by parameter-name prefix (e.g. ``{"head.": model.head}``)."""
        raise NotImplementedError


_ADAPTERS: list[type[Adapter]] = []


def register_adapter(cls: type[Adapter]) -> type[Adapter]:
    """Class decorator adding an adapter to the registry (first match wins)."""
    _ADAPTERS.append(cls)
    return cls


def supported_families() -> list[str]:
    return [f"{a.family} ({a.description})" for a in _ADAPTERS]


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for ``model``; raises :class:`UnsupportedModelError` listing the supported families.

    The Hugging Face adapters (:mod:`raystudy.core.hf`) are registered by importing :mod:`raystudy.core`
    (its ``__init__``), which every import of this module runs first."""
    for cls in _ADAPTERS:
        if cls.matches(model):
            return cls(model)
    raise UnsupportedModelError(
        f"unsupported model {type(model).__module__}.{type(model).__name__}: raystudy supports the families "
        + "; ".join(supported_families())
    )


_PRE_NORM_NAMES = {"LN1": "norm1", "MHA": "attn", "LN2": "norm2", "FC1": "mlp.fc1", "FC2": "mlp.fc2"}


def _is_linear(module: nn.Module | None) -> bool:
    """An ``nn.Linear``, or a wrapper of one (a peft LoRA layer: ``base_layer``, see :mod:`raystudy.core.lora`)."""
    return isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Linear)


def _pre_norm_block(model: nn.Module, i: int, blk: nn.Module, layerscale: dict[str, str]) -> BlockComponents:
    """Components of a timm pre-norm ``Block`` (``norm1, attn, norm2, mlp.fc1, mlp.fc2``) at ``blocks.{i}``.

    ``layerscale`` maps MHA / FC2 to the block attribute scaling their output; entries whose attribute is
    absent, ``None`` or ``nn.Identity`` are dropped. Raises :class:`UnsupportedModelError` for other blocks.
    """
    missing = [a for a in ("norm1", "attn", "norm2", "mlp") if not hasattr(blk, a)]
    mlp = getattr(blk, "mlp", None)
    if not missing and not (_is_linear(getattr(mlp, "fc1", None)) and _is_linear(getattr(mlp, "fc2", None))):
        missing.append("mlp.fc1/mlp.fc2 as nn.Linear")
    if missing or type(blk).__name__ != "Block":
        raise UnsupportedModelError(
            f"block {i} of {type(model).__name__} is a {type(blk).__name__} (missing: {missing or 'none'}); "
            "this family's adapter needs timm's pre-norm `Block`. "
            "Supported families: " + "; ".join(supported_families())
        )
    present = {c: a for c, a in layerscale.items()
               if getattr(blk, a, None) is not None and not isinstance(getattr(blk, a), nn.Identity)}
    return BlockComponents(
        LN1=blk.norm1, MHA=blk.attn, LN2=blk.norm2, FC1=blk.mlp.fc1, FC2=blk.mlp.fc2,
        prefix=f"blocks.{i}.", names=_PRE_NORM_NAMES, layerscale=present, module=blk,
    )


class _TimmPreNormAdapter(Adapter):
    """Shared part of the timm adapters: a ``blocks`` list of pre-norm ``Block``s, a model class to match.

    Subclasses set ``model_class`` (``"module:ClassName"``) and ``layerscale_attrs`` (the block attributes
    scaling the MHA and FC2 outputs), and implement :meth:`embed` and :meth:`head_modules`; a family with
    other blocks overrides :meth:`_block`. Every block is called with :meth:`attention_kwargs`.
    """

    model_class: str = ""
    layerscale_attrs: dict[str, str] = {}

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        import importlib

        module, name = cls.model_class.split(":")
        try:
            klass = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # pragma: no cover - timm is a dependency
            return False
        return isinstance(model, klass)

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self._blocks = [self._block(i, blk) for i, blk in enumerate(model.blocks)]

    def _block(self, i: int, blk: nn.Module) -> BlockComponents:
        return _pre_norm_block(self.model, i, blk, self.layerscale_attrs)

    def blocks(self) -> list[BlockComponents]:
        return self._blocks

    def run_blocks(self, tokens: torch.Tensor) -> torch.Tensor:
        kwargs = self.attention_kwargs()
        for b in self._blocks:
            tokens = b.module(tokens, **kwargs)
        return tokens


# --------------------------------------------------------------------------------------------------
# timm VisionTransformer family: ViT, DeiT (incl. distilled), DeiT-III, DINOv2-style (LayerScale, registers)
# --------------------------------------------------------------------------------------------------


@register_adapter
class TimmViTAdapter(_TimmPreNormAdapter):
    family = "timm-vit"
    description = (
        "timm VisionTransformer and subclasses with pre-norm blocks: vit_*, deit_* (incl. distilled), "
        "deit3_*, *_dinov2 (LayerScale, register tokens)"
    )

    model_class = "timm.models.vision_transformer:VisionTransformer"
    layerscale_attrs = {"MHA": "ls1", "FC2": "ls2"}

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        # Exactly what VisionTransformer.forward_features applies before its blocks.
        m = self.model
        x = m.patch_embed(images)
        x = m._pos_embed(x)
        x = m.patch_drop(x)
        x = m.norm_pre(x)
        return x

    def embedding_names(self) -> tuple[str, ...]:
        # patch_embed: the patch projection (and its norm, if any); cls/reg/dist tokens: the prepended
        # tokens (DINOv2-style registers, DeiT-distilled's distillation token); pos_embed; norm_pre: the
        # LayerNorm CLIP-style models apply to the embedded tokens before block 0 (Identity elsewhere).
        return ("patch_embed", "cls_token", "reg_token", "dist_token", "pos_embed", "norm_pre")

    def head_modules(self) -> dict[str, nn.Module]:
        heads = {"head.": self.model.head}
        if isinstance(getattr(self.model, "head_dist", None), nn.Module):
            heads["head_dist."] = self.model.head_dist
        return heads


# --------------------------------------------------------------------------------------------------
# timm BEiT family: BEiT / BEiT-v2 (relative position bias, LayerScale as bare parameters gamma_1/gamma_2)
# --------------------------------------------------------------------------------------------------


@register_adapter
class TimmBeitAdapter(_TimmPreNormAdapter):
    family = "timm-beit"
    description = "timm Beit: beit_*, beitv2_* (relative position bias inside MHA, LayerScale gamma_1/gamma_2)"

    model_class = "timm.models.beit:Beit"
    layerscale_attrs = {"MHA": "gamma_1", "FC2": "gamma_2"}

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        # Exactly what Beit.forward_features applies before its blocks.
        m = self.model
        x = m.patch_embed(images)
        x = torch.cat((m.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        if m.pos_embed is not None:
            x = x + m.pos_embed
        return m.pos_drop(x)

    def embedding_names(self) -> tuple[str, ...]:
        # The pretrained beit_* / beitv2_* models have no absolute position embedding (pos_embed None):
        # their positions are the relative position bias inside every block's attention (part of MHA; a
        # shared ``rel_pos_bias`` belongs to no component, only to ``All``).
        return ("patch_embed", "cls_token", "pos_embed")

    def attention_kwargs(self) -> dict:
        rel = self.model.rel_pos_bias
        return {"shared_rel_pos_bias": rel() if rel is not None else None}

    def head_modules(self) -> dict[str, nn.Module]:
        return {"head.": self.model.head}


# --------------------------------------------------------------------------------------------------
# timm Eva family: EVA-02, DINOv3, ROPE-ViTs (rotary position embedding, registers, LayerScale, SwiGLU)
# --------------------------------------------------------------------------------------------------

_UNSET = object()


def _eva_fc1(i: int, mlp: nn.Module) -> tuple[nn.Module, str | tuple[str, ...], dict[str, nn.Module]]:
    """FC1 of an Eva MLP: ``(module, path(s) relative to the block, hidden-mode input module if a view)``.

    ``Mlp`` (GELU) and ``GluMlp`` (SwiGLU with one fused ``fc1`` ``d -> 2h``, gate first): ``mlp.fc1``.
    ``SwiGLU`` (separate ``fc1_g`` / ``fc1_x``, both ``d -> h``): the stacked map ``[W_g; W_x]``.
    """
    kind = type(mlp).__name__
    if kind in ("Mlp", "GluMlp") and isinstance(getattr(mlp, "fc1", None), nn.Linear):
        return mlp.fc1, "mlp.fc1", {}
    if kind == "SwiGLU":
        return StackedLinear(mlp.fc1_g, mlp.fc1_x), ("mlp.fc1_g", "mlp.fc1_x"), {"FC1": mlp.fc1_g}
    raise UnsupportedModelError(f"block {i}: Eva MLP {kind} is not supported (expected Mlp, GluMlp or SwiGLU)")


def _eva_block(model: nn.Module, i: int, blk: nn.Module) -> BlockComponents:
    """Components of a timm pre-norm ``EvaBlock`` at ``blocks.{i}``: ``norm1, attn, norm2``, FC1 as in
    :func:`_eva_fc1`, ``mlp.fc2``; LayerScale ``gamma_1`` / ``gamma_2`` (bare parameters) where present."""
    if type(blk).__name__ != "EvaBlock":
        raise UnsupportedModelError(
            f"block {i} of {type(model).__name__} is a {type(blk).__name__}; the Eva adapter needs the pre-norm "
            "`EvaBlock` (use_post_norm=False). Supported families: " + "; ".join(supported_families())
        )
    fc1, fc1_names, inputs = _eva_fc1(i, blk.mlp)
    names = {"LN1": "norm1", "MHA": "attn", "LN2": "norm2", "FC1": fc1_names, "FC2": "mlp.fc2"}
    layerscale = {c: a for c, a in (("MHA", "gamma_1"), ("FC2", "gamma_2")) if getattr(blk, a) is not None}
    return BlockComponents(
        LN1=blk.norm1, MHA=blk.attn, LN2=blk.norm2, FC1=fc1, FC2=blk.mlp.fc2, prefix=f"blocks.{i}.",
        names=names, layerscale=layerscale, module=blk, inputs=inputs,
    )


@register_adapter
class TimmEvaAdapter(_TimmPreNormAdapter):
    """Eva: the rotary position embedding (RoPE) is computed once per batch by the embedding stage
    (``Eva._pos_embed`` returns it next to the tokens) and passed to every ``block.attn`` as ``rope=``;
    :meth:`attention_kwargs` returns the one of the batch last passed to :meth:`embed`."""

    family = "timm-eva"
    description = (
        "timm Eva with pre-norm blocks: eva02_*, *_dinov3, vit_*_rope_* (rotary position embedding inside MHA, "
        "register tokens, LayerScale gamma_1/gamma_2, SwiGLU/GLU MLPs; FC1 = the stacked input projections)"
    )

    model_class = "timm.models.eva:Eva"

    def __init__(self, model: nn.Module):
        if getattr(model, "rope_mixed", False):
            raise UnsupportedModelError(
                f"{type(model).__name__} with rope_type='mixed' (a different learned RoPE per block) is not "
                "supported: raystudy passes one rotary embedding to every block"
            )
        super().__init__(model)
        self._rope = _UNSET

    def _block(self, i: int, blk: nn.Module) -> BlockComponents:
        return _eva_block(self.model, i, blk)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        # Exactly what Eva.forward_features applies before its blocks; the rope it returns is kept for them.
        m = self.model
        x, self._rope = m._pos_embed(m.patch_embed(images))
        return m.norm_pre(x)

    def embedding_names(self) -> tuple[str, ...]:
        # patch_embed; cls/reg tokens (DINOv3 has 4 registers); pos_embed (EVA-02; None in DINOv3);
        # norm_pre (use_pre_transformer_norm; Identity otherwise); rope: the rotary position embedding
        # module, parameter-free for the supported rope types (buffers only).
        return ("patch_embed", "cls_token", "reg_token", "pos_embed", "norm_pre", "rope")

    def attention_kwargs(self) -> dict:
        if self._rope is _UNSET:  # nothing embedded yet: the rope of an image at the model's own size
            rope = self.model.rope
            if rope is None:
                return {"rope": None}
            grid = None if getattr(rope, "feat_shape", None) is not None else self.model.patch_embed.grid_size
            return {"rope": rope.get_embed(shape=grid)}
        return {"rope": self._rope}

    def unbounded_components(self) -> dict[str, str]:
        if self.model.rope is None:
            return {}
        return {"MHA": "rotary position embedding (RoPE) inside attention"}

    def head_modules(self) -> dict[str, nn.Module]:
        return {"head.": self.model.head}


# --------------------------------------------------------------------------------------------------
# Parameter selections
# --------------------------------------------------------------------------------------------------


def _named(model: nn.Module, names: list[str]) -> list[tuple[str, nn.Parameter]]:
    """Parameters of ``model`` that are, or belong to a module at, one of ``names`` (model order)."""
    exact = set(names)
    dotted = tuple(f"{n}." for n in names)
    return [(n, p) for n, p in model.named_parameters() if n in exact or n.startswith(dotted)]


def _component_names(adapter: Adapter, component: str, include_layerscale: bool) -> list[str]:
    names = []
    for b in adapter.blocks():
        paths = b.names[component]
        names.extend(b.prefix + p for p in ((paths,) if isinstance(paths, str) else paths))
        if include_layerscale and component in b.layerscale:
            names.append(b.prefix + b.layerscale[component])  # a module, or a bare parameter (BEiT)
    return names


def embedding_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The ``Emb`` configuration: every parameter the model applies before its first block.

    The authors' ``emb`` (patch embedding, class token, position embedding), per family:

    * timm ViT / DeiT / DeiT-III / DINOv2-style: ``patch_embed.*``, ``cls_token``, ``reg_token``
      (register tokens), ``dist_token`` (distilled DeiT), ``pos_embed``, and ``norm_pre.*`` where the
      model has a pre-block LayerNorm (CLIP-style ``pre_norm=True``; an Identity without parameters
      otherwise). ``vit_base_patch16_224``: 590,592 + 768 + 151,296 = 742,656 parameters.
    * timm BEiT: ``patch_embed.*``, ``cls_token`` and ``pos_embed`` when the model has an absolute one
      (the pretrained ``beit_*`` / ``beitv2_*`` have none). Relative position biases are attention
      parameters (MHA, or only ``All`` for a shared ``rel_pos_bias``).
    * timm Eva (EVA-02, DINOv3): ``patch_embed.*``, ``cls_token``, ``reg_token`` (DINOv3's 4 registers),
      ``pos_embed`` where the model has an absolute one (EVA-02; DINOv3 has none), ``norm_pre.*`` where
      present, and ``rope.*`` (no parameters for the supported rope types: the rotary embedding is fixed).
      ``vit_small_patch16_dinov3``: 295,296 (16x16 conv, 3 -> 384, and bias) + 384 + 4 * 384 = 297,216.
    """
    return _named(model, list(get_adapter(model).embedding_names()))


def embedding_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The embedding stage's state-dict entries ``{name: tensor}``: the parameters of
    :func:`embedding_parameters` and the buffers beside them (a BERT's ``position_ids``, a rotary
    embedding's tables), every entry that is, or belongs to a module at, one of the adapter's
    ``embedding_names()``."""
    names = get_adapter(model).embedding_names()
    dotted = tuple(f"{n}." for n in names)
    return {k: v for k, v in model.state_dict().items() if k in names or k.startswith(dotted)}


def head_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The classifier's parameters ``(name, parameter)``: trainable in every configuration."""
    prefixes = tuple(get_adapter(model).head_modules())
    return [(n, p) for n, p in model.named_parameters() if n.startswith(prefixes)]


def trainable_parameters(
    model: nn.Module, config: str, *, include_layerscale: bool = False
) -> list[tuple[str, nn.Parameter]]:
    """Parameters selected by a finetuning configuration, excluding the classification head.

    ``config`` is one of :data:`CONFIGURATIONS`: a component name selects that component in every block;
    ``Emb`` the embedding stage (:func:`embedding_parameters`); ``All`` every non-head parameter
    (embeddings and the final norm included); ``Head`` nothing (the caller adds :func:`head_parameters`).
    Order follows ``model.named_parameters()``.
    """
    if config not in CONFIGURATIONS:
        raise ValueError(f"unknown configuration {config!r}; expected one of {CONFIGURATIONS}")
    adapter = get_adapter(model)
    head = tuple(adapter.head_modules())
    if config == "Head":
        return []
    if config == "All":
        return [(n, p) for n, p in model.named_parameters() if not n.startswith(head)]
    if config == "Emb":
        return embedding_parameters(model)
    return _named(model, _component_names(adapter, config, include_layerscale))


def count_parameters(params: list[tuple[str, nn.Parameter]]) -> int:
    return sum(p.numel() for _, p in params)
