"""Building timm models, with pretrained weights from the hub (users with internet) or a local file."""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from raystudy.core.components import embedding_state, get_adapter
from raystudy.core.hf import build_hf_model
from raystudy.core.tensors import torch_load_reason
from raystudy.data.modality import modality_of_model
from raystudy.data.store import IMAGE_KIND, TEXT_KIND
from raystudy.vocab import RANDOM_BLOCKS, RANDOM_INIT

log = logging.getLogger(__name__)

_PREFIXES = ("module.", "model.", "_orig_mod.")  # DDP, wrappers, torch.compile


class WeightsError(ValueError):
    """A weights file that cannot be loaded into the model (names the file and the offending keys)."""


_WRAPPERS = ("state_dict", "model", "module", "state_dict_ema")  # checkpoints that wrap their weights


def _read_safetensors(path: Path) -> dict:
    """The tensors of a ``.safetensors`` file; an empty, truncated or garbage file is a :class:`WeightsError`."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # SafetensorError (header too small/large, incomplete), OSError, ...
        raise WeightsError(f"cannot read weights file {path}: not a valid .safetensors file ({e})") from e


#: how the files :func:`load_state_dict_file` reads begin: torch.save's zip archive, a pickle (protocol 2+:
#: torch.save's legacy format), and a safetensors header (8-byte little-endian length, then a JSON object)
_ZIP, _PICKLE = b"PK\x03\x04", b"\x80"


def _head(path: Path) -> bytes:
    """The first bytes of ``path``: enough to tell the formats apart."""
    with open(path, "rb") as f:
        return f.read(64)


def _looks_like_safetensors(head: bytes) -> bool:
    return len(head) >= 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 100_000_000


#: what :func:`_not_weights_reason` says of an empty file
_EMPTY = "the file is empty"


def _not_weights_reason(head: bytes) -> str | None:
    """Why a file beginning with ``head`` is neither a PyTorch checkpoint nor a safetensors file, or None."""
    if not head:
        return _EMPTY
    if head.startswith((_ZIP, _PICKLE)) or _looks_like_safetensors(head):
        return None
    try:
        kind = f"a text file (it begins {head.decode('utf-8').splitlines()[0][:40]!r})"
    except (UnicodeDecodeError, IndexError):
        kind = f"of an unknown format (it begins {head[:8]!r})"
    return (f"not a weights file: {kind}; expected a .safetensors file or a PyTorch checkpoint written by "
            f"torch.save")


def check_weights_format(path: str | Path) -> None:
    """Raise :class:`WeightsError` naming ``path`` when its first bytes show it is no weights file (empty,
    text, another format); cheap: nothing is loaded (:func:`load_state_dict_file` checks the rest). A
    ``.safetensors`` file is judged here only by being empty: its reader names what else is wrong."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file not found: {path}")
    reason = _not_weights_reason(_head(path))
    if reason is not None and (path.suffix != ".safetensors" or reason == _EMPTY):
        raise WeightsError(f"cannot read weights file {path}: {reason}")


def _read_torch(path: Path) -> object:
    """A PyTorch checkpoint read with ``torch.load(weights_only=True)``: a pickle that would build any object
    other than tensors and plain containers (and so could run code) is refused, never executed. A file that
    is neither (text, an image, ...) is refused from its first bytes, before the unpickler sees it."""
    check_weights_format(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError (refused globals), truncated zip, EOFError, ...
        raise WeightsError(f"cannot read weights file {path}: {torch_load_reason(e)}") from e
    for key in _WRAPPERS:
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            return state[key]
    return state


def check_finite(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Raise :class:`WeightsError` naming ``path``, the first tensor holding NaN or inf and how many values,
    and how many tensors are affected. NaN weights make every rate NaN and every finetuning step diverge:
    they are refused at load, before anything runs. Sparse and other non-strided tensors are refused too."""
    bad = []
    for name, value in state.items():
        if value.layout != torch.strided:
            raise WeightsError(f"{path}: tensor {name!r} has layout {value.layout}; expected dense tensors")
        if value.is_floating_point() or value.is_complex():
            n = int((~torch.isfinite(value)).sum())
            if n:
                bad.append((name, n, value.numel()))
    if bad:
        name, n, numel = bad[0]
        raise WeightsError(f"{path}: tensor {name!r} has {n} non-finite values (NaN/inf) of {numel} "
                           f"({len(bad)} of {len(state)} tensors affected); the file is corrupt or was saved "
                           f"from a diverged run")


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file or a PyTorch state dict (``torch.load(weights_only=True)``).

    A checkpoint that wraps its weights (``{"state_dict": ...}``, ``{"model": ...}``) is unwrapped, and
    the prefixes ``module.``, ``model.`` and ``_orig_mod.`` are stripped. An unreadable file (empty,
    truncated, garbage, a pickle of other objects), anything but a dict of name -> tensor, or a tensor with
    NaN/inf (:func:`check_finite`) raises :class:`WeightsError` naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    is_safetensors = path.suffix == ".safetensors" or _looks_like_safetensors(_head(path))
    state = _read_safetensors(path) if is_safetensors else _read_torch(path)
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise WeightsError(f"{path} does not hold a state dict of tensors")
    if not state:
        raise WeightsError(f"{path} holds no tensors")
    check_finite(state, path)
    for prefix in _PREFIXES:
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def _head_prefixes(model: nn.Module) -> tuple[str, ...]:
    try:
        return tuple(get_adapter(model).head_modules())
    except TypeError:
        return ("head.",)


#: how many keys an error of :func:`load_weights` lists (a file of another model differs in hundreds)
_LISTED = 3


def _more(items: list) -> str:
    """``" and 27 more"`` after the first :data:`_LISTED` of ``items``, or ``""``."""
    return f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""


def load_weights(model: nn.Module, path: str | Path, *, strict: bool = True) -> nn.Module:
    """Load a local weights file into ``model``.

    Keys go through timm's checkpoint filter for the model's module when it has one (it converts
    original-format checkpoints and resamples position embeddings to the model's resolution). Head
    parameters whose shape differs from the model's (another number of classes) are dropped, so the head
    stays freshly initialised, as it does when the file has no head at all (timm's ``*_in21k`` originals).
    Any other missing or unexpected key raises :class:`WeightsError` naming
    the file and the keys (``strict=False`` logs them instead).
    """
    import importlib

    state = load_state_dict_file(path)
    module = importlib.import_module(type(model).__module__)
    filter_fn = getattr(module, "checkpoint_filter_fn", None)
    if filter_fn is not None:
        try:
            state = filter_fn(state, model)
        except Exception as e:
            raise WeightsError(f"{path}: timm's checkpoint filter for {type(model).__name__} failed: {e}") from e
    own = model.state_dict()
    heads = _head_prefixes(model)
    reinit = [k for k in state if k.startswith(heads) and k in own and state[k].shape != own[k].shape]
    for k in reinit:
        del state[k]
    mismatched = [
        f"{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state.items() if k in own and v.shape != own[k].shape
    ]
    if mismatched:
        raise WeightsError(f"{path}: shape mismatch for {len(mismatched)} tensor(s): "
                           + "; ".join(mismatched[:_LISTED]) + _more(mismatched))
    result = model.load_state_dict(state, strict=False)
    # A checkpoint without a classifier (timm's *_in21k originals have num_classes=0) or with another class
    # count leaves the model's freshly initialised head in place: that is the finetuning protocol.
    headless = [k for k in result.missing_keys if k.startswith(heads)]
    missing = [k for k in result.missing_keys if k not in headless]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:_LISTED]}{_more(missing)}")
    if result.unexpected_keys:
        unexpected = list(result.unexpected_keys)
        problems.append(f"unexpected keys {unexpected[:_LISTED]}{_more(unexpected)}")
    if problems:
        msg = f"{path} does not match {type(model).__name__}: " + "; ".join(problems)
        if strict:
            raise WeightsError(msg)
        log.warning(msg)
    if reinit or headless:
        log.info("%s: head newly initialised (%d head tensors of another shape dropped, %d absent)",
                 path, len(reinit), len(headless))
    return model


def build_model(
    name: str,
    *,
    num_classes: int | None = None,
    pretrained: bool = False,
    weights: str | Path | None = None,
    img_size: int | None = None,
    strict: bool = True,
    **kwargs,
) -> nn.Module:
    """Create any timm model by name, or a Hugging Face model with ``name="hf:<dir or hub id>"``.

    ``hf:`` models are built by :func:`raystudy.core.hf.build_hf_model` from the directory's
    ``config.json`` and its own weights (a hub id needs internet); ``weights=FILE`` then overrides them.
    ``pretrained=True`` uses timm's hub download (needs internet). ``weights=FILE`` loads a local
    ``.safetensors`` / PyTorch state dict (see :func:`load_weights`); for the original ``.npz`` files use
    ``pretrained=True`` with ``pretrained_cfg_overlay=dict(file=FILE)``, which timm reads offline. When
    ``num_classes`` differs from the checkpoint's, the head is newly initialised. Dropout and drop-path
    stay at timm's defaults for the architecture (zero for ViTs) unless passed in ``kwargs``.
    """
    if weights is not None and pretrained:
        raise ValueError("pass either pretrained=True (hub) or weights=FILE (local), not both")
    return _library(name).build(name, num_classes=num_classes, pretrained=pretrained, weights=weights,
                                img_size=img_size, strict=strict, **kwargs)


def _build_timm(name: str, *, num_classes, pretrained: bool, weights, img_size, strict: bool, **kwargs) -> nn.Module:
    """The timm side of :func:`build_model`: ``timm.create_model``, then the weights file."""
    import timm

    if not timm.is_model(name):
        raise ValueError(f"unknown timm model {name!r} (see timm.list_models())")
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    if img_size is not None:
        kwargs["img_size"] = img_size
    model = timm.create_model(name, pretrained=pretrained, **kwargs)
    if weights is not None:
        load_weights(model, weights, strict=strict)
    return model


def resolve_img_size(model: str, model_kwargs: dict | None = None, img_size: int | None = None) -> int | None:
    """The input resolution a job uses: ``img_size``, else ``model_kwargs["img_size"]``, else the timm model's
    own (224 if it names none); ``None`` for a Hugging Face text model (its inputs are token windows,
    :meth:`~raystudy.data.modality.Modality.input_size`)."""
    kwargs = dict(model_kwargs or {})

    def configured() -> int:
        size = kwargs.get("img_size")
        if size:
            return size if isinstance(size, int) else size[-1]
        return _timm_img_size(model, json.dumps(kwargs, sort_keys=True))

    size = modality_of_model(model).input_size(img_size, configured)
    return None if size is None else int(size)


@functools.lru_cache(maxsize=64)
def _timm_img_size(model: str, kwargs_json: str) -> int:
    """The input size of timm's ``model`` built with ``kwargs_json`` on the meta device (no memory)."""
    import timm  # heavy (~1 s): only when a size must be looked up

    if not timm.is_model(model):
        raise ValueError(f"unknown timm model {model!r} (see timm.list_models())")
    with torch.device("meta"):
        net = timm.create_model(model, pretrained=False, **json.loads(kwargs_json))
    size = getattr(getattr(net, "patch_embed", None), "img_size", None)
    if size is None:
        size = getattr(net, "pretrained_cfg", {}).get("input_size", (3, 224, 224))[1:]
    return int(size[-1] if isinstance(size, tuple | list) else size)


def _build_hf(name: str, *, num_classes, pretrained: bool, weights, img_size, strict: bool, **kwargs) -> nn.Module:
    """The ``hf:`` side of :func:`build_model` (module docstring of :mod:`raystudy.core.hf`): the folder's own
    weights unless ``weights`` is given (``pretrained`` does not apply); text models take no ``img_size``."""
    if img_size is not None:
        raise ValueError("img_size does not apply to a Hugging Face text model")
    model = build_hf_model(name, num_classes=num_classes, pretrained=weights is None, **kwargs)
    if weights is not None:
        load_weights(model, weights, strict=strict)
    return model


def build_seeded_model(model: str, *, seed: int, weights: str | Path | None = None, pretrained: bool = False,
                       model_kwargs: dict | None = None, img_size: int | None = None) -> nn.Module:
    """The model a measurement (plasticity, bounds) uses, identical in every process: :func:`build_model` of
    ``model`` (an ``hf:`` name resolved by its modality, :mod:`raystudy.data.modality`) with the weights
    file, else a random init seeded with ``seed`` without touching the caller's torch RNG state.

    ``img_size`` (else ``model_kwargs["img_size"]``) is the image models' input size.
    """
    kwargs = dict(model_kwargs or {})
    img_size = img_size or kwargs.pop("img_size", None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(modality_of_model(model).build_name(model), weights=weights, pretrained=pretrained,
                           img_size=img_size, **kwargs)


def build_control_model(model: str, *, seed: int, model_kwargs: dict | None = None,
                        img_size: int | None = None) -> nn.Module:
    """The random-init control of ``model``: the same architecture (``model_kwargs``, ``img_size`` as
    :func:`build_seeded_model`) at its library's own initialisation (timm's ``create_model``, Hugging Face's
    ``from_config``), drawn under ``torch.manual_seed(seed)`` without touching the caller's RNG state; no
    weights are loaded."""
    kwargs = dict(model_kwargs or {})
    img_size = img_size or kwargs.pop("img_size", None)
    name = modality_of_model(model).build_name(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _library(name).control(name, img_size=img_size, **kwargs)


def build_controls(model: str, measured: nn.Module, *, seed: int, model_kwargs: dict | None = None,
                   img_size: int | None = None) -> dict[str, nn.Module]:
    """The controls of a plasticity measurement of ``measured`` (the model ``model``), by their weights
    (:data:`raystudy.vocab.CONTROL_WEIGHTS`): ``random_init``, :func:`build_control_model` under ``seed``;
    ``random_blocks``, that model with ``measured``'s embedding stage copied in (:func:`component_control`)."""
    random_init = build_control_model(model, seed=seed, model_kwargs=model_kwargs, img_size=img_size)
    return {RANDOM_INIT: random_init, RANDOM_BLOCKS: component_control(random_init, measured)}


def component_control(control: nn.Module, measured: nn.Module) -> nn.Module:
    """The component control: a copy of ``control`` (a random init of ``measured``'s architecture) holding
    ``measured``'s embedding-stage state-dict entries (:func:`raystudy.core.components.embedding_state`:
    patch embedding, class/register tokens, position embedding; a text model's token and position
    embeddings), every other entry ``control``'s. Its blocks are the random init's, fed the measured model's
    own embeddings. ``control`` is left as it was; an entry of another name or shape is a ``RuntimeError``."""
    out = copy.deepcopy(control)
    unexpected = out.load_state_dict(embedding_state(measured), strict=False).unexpected_keys
    if unexpected:
        raise RuntimeError(f"component control: {type(measured).__name__}'s embedding entries {unexpected} are "
                           f"not in {type(control).__name__}")
    return out


def _control_timm(name: str, *, img_size, **kwargs) -> nn.Module:
    """timm's own initialisation of ``name`` (:func:`build_model` without weights)."""
    return build_model(name, img_size=img_size, **kwargs)


def _control_hf(name: str, *, img_size, **kwargs) -> nn.Module:
    """Hugging Face's ``from_config`` initialisation of the ``hf:`` model ``name`` (no ``img_size``)."""
    return build_hf_model(name, pretrained=False, **kwargs)


class ModelLibrary(NamedTuple):
    """How the models of one modality are built: :func:`build_model`'s work, and the random-init control of
    :func:`build_control_model`."""

    build: Callable[..., nn.Module]
    control: Callable[..., nn.Module]


#: modality kind (:attr:`raystudy.data.modality.Modality.kind`) -> the library that builds its models:
#: timm for images, Hugging Face ``transformers`` for ``hf:`` text models
LIBRARIES = {IMAGE_KIND: ModelLibrary(_build_timm, _control_timm), TEXT_KIND: ModelLibrary(_build_hf, _control_hf)}


def _library(name: str) -> ModelLibrary:
    """The library that builds the model ``name``, by its modality
    (:func:`~raystudy.data.modality.modality_of_model`)."""
    return LIBRARIES[modality_of_model(name).kind]


def weights_load_error(model: str, weights: str | Path, *, num_classes: int | None = None,
                       img_size: int | None = None, model_kwargs: dict | None = None) -> str | None:
    """Why the local ``weights`` file cannot be loaded into ``model`` as a run loads it, in one line naming
    the file, the model and the reason; None when it loads.

    Builds the model once with the file (:func:`build_seeded_model`: the modality's build name, ``img_size``
    else ``model_kwargs["img_size"]``, ``num_classes`` outputs), so a file that is no weights file (text,
    empty, truncated), holds NaN, or belongs to another architecture (missing or unexpected keys, shapes)
    is refused by every command before Ray starts, instead of inside each worker.
    """
    if not Path(weights).is_file():
        return f"weights file not found: {weights}"
    kwargs = dict(model_kwargs or {})
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    try:
        build_seeded_model(model, seed=0, weights=weights, model_kwargs=kwargs, img_size=img_size)
    except (ValueError, TypeError, RuntimeError, OSError) as e:  # WeightsError is a ValueError
        return f"{weights} cannot be loaded into {model}: {e}"
    return None
