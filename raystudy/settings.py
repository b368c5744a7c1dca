"""Every setting of raystudy, defined once: its type, default, help text and check, in typed groups.

A *group* is a dataclass of settings that travel together (the model, the finetuning protocol, the
resources of a run, the plasticity measurement, the linear probe). Each consumer composes the groups it
uses instead of restating their fields, so a default, a help text and a check exist in one place:

=====================  ===================================================================================
group                  composed by
=====================  ===================================================================================
:class:`ModelSettings`     ``FinetuneConfig``, ``StudySpec``, ``PlasticityJob``, ``ProbeJob``; every command's
                           model flags
:class:`DeviceSettings`    (inside :class:`ProtocolSettings`) and ``ProbeJob``: precision and where images
                           come from
:class:`ProtocolSettings`  ``FinetuneConfig`` and ``StudySpec`` (``raystudy finetune`` / ``raystudy study``)
:class:`ResourceSettings`  ``TrainResources`` and ``StudySpec`` (as ``workers_per_trial``, ``worker_retries``)
:class:`PlasticitySettings`  ``PlasticitySpec`` (the spec's ``plasticity:``), ``PlasticityJob``,
                           ``raystudy plasticity``
:class:`ProbeSettings`     ``ProbeSpec`` (the spec's ``probe:``), ``ProbeJob``, ``raystudy probe``
=====================  ===================================================================================

A field is declared with :func:`setting` (its help text and check ride in the field's metadata); a
consumer that names a group's setting differently declares it with :func:`same_as`, which copies the
definition. Command-line flags are generated from the same fields (:func:`add_flags`), and a job takes a
group's values from its source with :func:`values`. This module imports neither torch nor Ray: the CLI's
``--help`` and the study spec use it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, dataclass
from typing import Any

from raystudy import vocab
from raystudy.setting_roles import roles_metadata
from raystudy.vocab import (
    ACCURACIES,
    BOUNDS_CHOICES,
    CONTROLS,
    DATA_PATHS,
    GATED_FC1,
    HEAD_INITS,
    MHA_INPUTS,
    MODES,
    OPTIMIZERS,
    PAIRINGS,
    PRECISION_CHOICES,
    RESIZES,
    TEXT_ROWS,
    TRAIN_SPLITS,
    VAL_SPLITS,
)

#: The default model: timm's ViT-B/16 pretrained on ImageNet-21k with AugReg. Not the paper's weights: the
#: authors load Google's original ImageNet-21k checkpoint (timm's ``vit_base_patch16_224.orig_in21k``),
#: which the paper presets set.
DEFAULT_MODEL = "vit_base_patch16_224.augreg_in21k"
#: Fraction of a run spent in linear warmup when ``warmup_steps`` is None (paper: 2000 of 10,000 steps).
WARMUP_FRACTION = 0.2


def warmup_of(steps: int, warmup_steps: int | None) -> int:
    """Warmup steps a run uses: ``warmup_steps``, or ``round(WARMUP_FRACTION * steps)`` when it is None."""
    return warmup_steps if warmup_steps is not None else int(round(WARMUP_FRACTION * steps))


def accuracy_batch(protocol: Any, split: str) -> int:
    """The batch size a ``per_batch`` accuracy on ``split`` averages over: ``val_batch_size`` (default
    ``eval_batch_size``) on val, ``eval_batch_size`` elsewhere."""
    if split == "val":
        return protocol.val_batch_size or protocol.eval_batch_size
    return protocol.eval_batch_size


def accuracy_batches(protocol: Any) -> tuple[int, int] | None:
    """The batch sizes ``(val, test)`` a ``per_batch`` accuracy averages over (``val_batch_size``, default
    ``eval_batch_size``; then ``eval_batch_size``), ``None`` for ``per_sample``: what such an accuracy means,
    compared by a resume and by a study directory."""
    if protocol.accuracy != "per_batch":
        return None
    return (accuracy_batch(protocol, "val"), accuracy_batch(protocol, "test"))


# --------------------------------------------------------------------------------------------------
# Declaring a setting
# --------------------------------------------------------------------------------------------------


def setting(default: Any = MISSING, *, help: str, factory: Callable[[], Any] | None = None,
            choices: tuple | None = None, check: str | None = None, flag: str | None = None,
            aliases: tuple[str, ...] = (), metavar: str | None = None, cli: bool = True,
            roles: Iterable[str] = (), path: bool = False, per_dataset: bool = False, legacy: Any = MISSING) -> Any:
    """A dataclass field with its definition: ``default`` (or ``factory`` for a mutable one), ``help``
    (one sentence, shown by every flag made from it), ``choices``, ``check`` (one of :data:`CHECKS`),
    the flag's name (default ``--field-name``), its ``aliases`` and ``metavar``; ``cli=False`` keeps it off
    the command line. What the setting affects: its ``roles``, ``path``, ``per_dataset`` and ``legacy``
    (:mod:`raystudy.setting_roles`)."""
    meta = {"help": help, "choices": choices, "check": check, "flag": flag, "aliases": tuple(aliases),
            "metavar": metavar, "cli": cli, **roles_metadata(roles, path=path, per_dataset=per_dataset, legacy=legacy)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def same_as(group: type, name: str, **changes: Any) -> Any:
    """A field defined by ``group``'s field ``name`` (default, help text, check), for a consumer that names
    the setting differently (``StudySpec.workers_per_trial`` is :class:`ResourceSettings`' ``workers``);
    ``changes`` override metadata such as ``flag`` or ``roles`` (what the setting affects in the consumer;
    the group's roles otherwise)."""
    f = _field(group, name)
    if "roles" in changes:
        changes["roles"] = roles_metadata(changes["roles"])["roles"]
    meta = {**f.metadata, **changes, "origin": (group.__name__, name)}
    if f.default_factory is not MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=meta)
    return dataclasses.field(default=f.default, metadata=meta)


def _field(cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


def default_of(cls: type, name: str) -> Any:
    """The default value of setting ``name`` of dataclass ``cls`` (a fresh copy for a mutable one)."""
    f = _field(cls, name)
    return f.default_factory() if f.default_factory is not MISSING else f.default


def origin_of(cls: type, name: str) -> tuple[str, str]:
    """``(group, field)`` that defines ``cls``'s field ``name``: the group that declared it with
    :func:`setting` (found along the class's bases) or the one :func:`same_as` copied it from."""
    f = _field(cls, name)
    if "origin" in f.metadata:
        return f.metadata["origin"]
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base) and name in getattr(base, "__annotations__", {}):
            return base.__name__, name
    return cls.__name__, name


def values(group: type, source: Any, **renamed: str) -> dict[str, Any]:
    """The values of ``group``'s settings held by ``source`` (an object composing the group, or a mapping),
    deep-copied; ``renamed`` maps a group field to the source's name for it (``workers="workers_per_trial"``)."""
    get = source.get if isinstance(source, dict) else (lambda k, d=None: getattr(source, k, d))
    out = {}
    for f in dataclasses.fields(group):
        key = renamed.get(f.name, f.name)
        value = get(key, MISSING)
        if value is not MISSING:
            out[f.name] = copy.deepcopy(value)
    return out


# --------------------------------------------------------------------------------------------------
# Checking a group's values
# --------------------------------------------------------------------------------------------------


def base_type(hint: Any) -> Any:
    """``int | None`` -> ``int``; other hints unchanged."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and type(None) in typing.get_args(hint) and len(args) == 1 else hint


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


#: the largest batch a run or a plasticity pass may ask for (a larger one only exhausts memory: its index
#: arrays alone take gigabytes before the first image is read)
MAX_BATCH_SIZE = 65_536

#: check name -> (holds, what it requires)
CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "batch_size": (lambda v: _is_int(v) and 1 <= v <= MAX_BATCH_SIZE,
                   f"must be an integer between 1 and {MAX_BATCH_SIZE:,}"),
    "positive_int": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    "optional_positive_int": (lambda v: v is None or (_is_int(v) and v >= 1), "must be None or an integer >= 1"),
    "non_negative_int": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "optional_non_negative_int": (lambda v: v is None or (_is_int(v) and v >= 0),
                                  "must be None or an integer >= 0"),
    "non_negative": (lambda v: _is_number(v) and v >= 0, "must be a number >= 0"),
    "positive": (lambda v: _is_number(v) and v > 0, "must be a positive number"),
    "optional_positive": (lambda v: v is None or (_is_number(v) and v > 0), "must be None or a positive number"),
}


def problems(obj: Any, group: type | None = None) -> Iterator[tuple[str, str]]:
    """``(field, why)`` for every setting of ``obj`` (of ``group``'s fields only, if given) whose value
    fails its definition's ``choices`` or ``check``."""
    for f in dataclasses.fields(group or obj):
        value = getattr(obj, f.name)
        choices, check = f.metadata.get("choices"), f.metadata.get("check")
        if choices is not None and value is not None and value not in choices:
            yield f.name, f"expected one of {list(choices)}"
        elif check is not None and not CHECKS[check][0](value):
            yield f.name, CHECKS[check][1]


def _to_number(value: Any, kind: type, name: str, error: type[Exception]) -> Any:
    if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
        raise error(f"{name}: {value!r} is not {'an integer' if kind is int else 'a number'}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise error(f"{name}: {value!r} is not {'an integer' if kind is int else 'a number'}") from None


def coerce(obj: Any, *, prefix: str = "", error: type[Exception] = ValueError) -> None:
    """Give every ``int`` / ``float`` setting of dataclass ``obj`` its type, as its annotation says (YAML
    reads ``1e-3`` as a string, ``2.0`` where an int belongs); ``None`` stays where the type allows it.
    ``error(f"{prefix}{field}: ...")`` names the first value that is no number."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        kind, value = base_type(hints[f.name]), getattr(obj, f.name)
        if kind in (int, float) and not (value is None and type(None) in typing.get_args(hints[f.name])):
            setattr(obj, f.name, _to_number(value, kind, prefix + f.name, error))


# --------------------------------------------------------------------------------------------------
# The groups
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelSettings:
    """The model every job builds: a timm name (or ``hf:DIR``, a Hugging Face text model), its
    ``timm.create_model`` arguments, its local weights and its input resolution."""

    model: str = setting(DEFAULT_MODEL, help="timm model name, or hf:DIR for a Hugging Face text model",
                         roles={"trial", "resume", "study_flag"})
    model_kwargs: dict = setting(factory=dict, help='extra timm.create_model arguments, e.g. {"depth": 3}',
                                 roles={"trial", "resume", "study_flag"})
    weights: str | None = setting(None, help="local weights file (.safetensors or a PyTorch state dict)",
                                  metavar="FILE", roles={"trial", "study_flag"}, path=True)
    img_size: int | None = setting(None, check="optional_positive_int",
                                   help="input resolution; None: the model's (model_kwargs' img_size, else "
                                        "the timm model's own; no size for a text model)",
                                        roles={"trial", "resume", "study_flag"})


@dataclass
class HubWeights:
    """timm's pretrained weights instead of a local file (a hub download: needs internet)."""

    pretrained: bool = setting(False, help="download timm's pretrained weights (needs internet)")


@dataclass
class DeviceSettings:
    """How a model runs on its device and where its images come from."""

    precision: str = setting("auto", choices=PRECISION_CHOICES,
                             help="the forward passes' precision (finetuning, probe, plasticity, pretraining): "
                                  "fp32: the paper's; bf16: autocast with fp32 master weights, norms in fp32; "
                                  "auto: bf16 where the run has a CUDA device, fp32 on a CPU",
                             roles={"trial", "resume", "row"})
    data_path: str = setting("cache", choices=DATA_PATHS,
                             help="cache: decode each image once into a uint8 cache and augment on the device; "
                                  "decode: decode and augment every image on the CPU at every step",
                                  roles={"trial", "resume", "row"}, legacy="decode")
    cache_dir: str | None = setting(None, help="root of the uint8 caches (None: beside each store)", path=True)


@dataclass
class ProtocolSettings(DeviceSettings):
    """The finetuning protocol (the paper's, Appendix D): what every run of a study shares."""

    steps: int = setting(10_000, check="positive_int", help="optimizer steps of a run",
                         roles={"trial", "resume", "row", "study_flag"}, per_dataset=True)
    batch_size: int = setting(512, check="batch_size", help="global batch over all workers",
                              roles={"trial", "resume", "row"})
    criteria_batches: int = setting(8, check="positive_int", roles={"trial"}, legacy=8,
                                    help="rgn:/grad:/taylor:/fisher: budgets: the run's first training batches "
                                         "their scores are computed on (SPT's 8)")
    eval_period: int = setting(500, check="positive_int", help="evaluate on val every this many steps",
                               roles={"trial"}, per_dataset=True)
    eval_steps: str = setting("every_and_last", choices=vocab.EVAL_STEPS, roles={"trial"},
                              help="every eval_period steps and the last; authors: every min(eval_period, steps) only")
    warmup_steps: int | None = setting(None, check="optional_non_negative_int",
                                       help="linear warmup steps; None: 20% of steps (the paper's 2000/10000)",
                                       roles={"trial", "resume"}, per_dataset=True)
    warmup_factor: str = setting("k_plus_1", choices=vocab.WARMUP_FACTORS, roles={"trial", "resume"}, legacy="k_plus_1",
                                 help="warmup lr factor at update k: (k + 1) / w, or k / w (the authors' lr_cosine)")
    log_period: int = setting(10, check="positive_int", help="training curve (loss, grad norm, lr) every N steps",
                              roles={"trial"}, per_dataset=True)
    micro_batch_size: int | None = setting(None, check="optional_positive_int",
                                           help="per-worker micro-batch (gradient accumulation); None: the "
                                                "whole share at once", per_dataset=True)
    loader_batch_size: int | None = setting(None, check="optional_positive_int", roles={"trial", "resume"},
                                            per_dataset=True, legacy=None, help="drop_last: epochs of whole batches "
                                            "of N rows, batch_size / N a step (the authors' 128 x 4); None: batch_size")
    augment: bool = setting(True, help="random-resized crop and flip on the train split", roles={"trial", "resume"})
    resize: str = setting("crop", choices=RESIZES,
                          help="without augmentation (val, test; train with augment off): crop: shorter side "
                               "to img_size, centre crop (the paper's); stretch: the whole image to img_size x "
                               "img_size, bicubic (VTAB-1k's VPT/NOAH)", roles={"trial", "resume"}, legacy="crop")
    shuffle: bool = setting(True, help="a new seeded order of the train rows every epoch (else store order)",
                            roles={"trial", "resume"})
    drop_last: bool = setting(False, help="each epoch is whole batches only, its last train_rows mod batch_size "
                                          "rows left out (the authors' DataLoader drop_last=True)",
                                          roles={"trial", "resume"}, legacy=False)
    checkpoint_period: int | None = setting(None, check="optional_non_negative_int",
                                            help="checkpoint every N steps; None: every eval_period; 0: off")
    train_final_norm: bool = setting(False, help="also train the norm after the last block", roles={"trial", "resume"})
    compile: bool = setting(False, help="torch.compile the training step (minutes of start-up)")
    momentum: float = setting(0.9, check="non_negative", help="SGD momentum (no Nesterov)", roles={"trial", "resume"})
    betas: tuple[float, float] = setting((0.9, 0.999), cli=False, help="AdamW betas", roles={"trial", "resume"})
    weight_decay: float = setting(0.0, check="non_negative", help="weight decay of SGD and AdamW",
                                  roles={"trial", "resume"})
    clip_norm: float | None = setting(1.0, check="optional_positive",
                                      help="gradient clipping at this global norm (None: no clipping)",
                                      roles={"trial", "resume"})
    head_init: str = setting("trunc_normal", choices=HEAD_INITS, help="initialisation of the new head",
                             roles={"trial", "resume"})
    include_layerscale: bool = setting(False, help="train a component's LayerScale with it", roles={"trial", "resume"})
    norm_eps: float | None = setting(None, check="optional_positive", roles={"trial", "resume"}, legacy=None,
                                     help="eps of every LayerNorm; None: the model's (timm: 1e-6; the authors': 1e-12)")
    attention: str = setting("fused", choices=vocab.ATTENTIONS, roles={"trial", "resume"}, legacy="fused",
                             help="fused: scaled_dot_product_attention; explicit: by matmuls (the authors')")
    diverged_test: str = setting("excluded", choices=vocab.DIVERGED_TESTS, roles={"trial", "resume"}, legacy="excluded",
                                 help="diverged before any evaluation: no test accuracy, or class 0's (the authors')")
    eval_batch_size: int = setting(256, check="positive_int", help="images per evaluation forward pass")
    accuracy: str = setting("per_sample", choices=ACCURACIES,
                            help="val/test accuracy and loss: over images (per_sample) or the mean over the "
                                 "split's consecutive eval_batch_size batches (per_batch: the authors' eval.py)",
                                 roles={"trial", "resume"}, legacy="per_sample")
    val_batch_size: int | None = setting(None, check="optional_positive_int",
                                         help="per_batch accuracy on val: the batches it averages over (None: "
                                              "eval_batch_size; the authors' ViT-L, speckle: 128)", per_dataset=True)
    val_split: str = setting("fixed", choices=VAL_SPLITS,
                             help="fixed: the store's train/val split for every seed; per_seed: train and val "
                                  "pooled and split anew by each run's seed, sizes kept; authors: the same, "
                                  "the authors' very rows (torch's random_split after manual_seed(seed))",
                                  roles={"trial", "resume"}, legacy="fixed")
    eval_cache_mb: int = setting(512, check="non_negative_int",
                                 help="val/test data kept resident per worker up to this size")
    loader_workers: int = setting(0, check="non_negative_int", help="DataLoader processes per worker (decode path)")
    change_images: int = setting(64, check="non_negative_int",
                                 help="images of change_store a run's per-block CKA to the pretrained model uses "
                                      "(raystudy.core.change; 0: weight change only)")


@dataclass
class ResourceSettings:
    """Where and on how many workers one finetuning run executes (Ray Train's view of it)."""

    workers: int = setting(1, check="positive_int", help="DDP workers of a run (they split the global batch)")
    gpus_per_worker: float = setting(0.0, check="non_negative", help="GPUs per worker (0: CPU)")
    cpus_per_worker: float = setting(1.0, check="positive", help="logical CPUs per worker")
    max_failures: int = setting(1, help="worker failures a run recovers from its last checkpoint (-1: forever)")
    keep_checkpoints: int = setting(2, check="positive_int", help="latest checkpoints kept while a run lives")
    cleanup_checkpoints: bool = setting(True, help="delete a run's checkpoints once it ended ok or diverged")


@dataclass
class PlasticitySettings:
    """One plasticity measurement: how pretraining and downstream inputs are paired and the pool that
    computes the rates (:mod:`raystudy.distributed.plasticity`)."""

    pairs: int = setting(12800, check="positive_int", help="pairs N per downstream dataset", roles={"plasticity"})
    batch_size: int = setting(256, check="positive_int",
                              help="pairs per actor call; with sequential pairing also where a short side "
                                   "starts over (after its last full batch)")
    mode: str = setting("embedding", choices=MODES, help="rate definition (embedding: the paper's)",
                        roles={"plasticity"})
    mha_input: str = setting("raw", choices=MHA_INPUTS,
                             help="embedding mode: MHA of the embeddings (raw: the paper's) or of LN1 of them "
                                  "(normed: the authors' GPT-2 script)", roles={"plasticity"})
    pairing: str = setting("random", choices=PAIRINGS,
                           help="random: a seeded shuffle of each side; sequential: the i-th input of each "
                                "side in store order (the authors' way)", roles={"plasticity"})
    pretrain_split: str | list[str] = setting("test", metavar="SPLIT",
                                              help="split(s) of the pretraining store: a split, a comma list "
                                                   "or 'all'; test falls back to val", roles={"plasticity"})
    radius: float | None = setting(None, check="optional_positive",
                                   help="fixed token radius r of the bounds (the paper's 19.4); None: measured",
                                   roles={"plasticity"})
    bounds: str = setting("paper", choices=BOUNDS_CHOICES,
                          help="the bounds' formulas: the paper's (Section 4), those of the authors' Fig. 7 "
                               "(apps/plots/theory.py: max(gamma), per-head column slices, the whole W2), or "
                               "both (the rows of each)",
                          roles={"plasticity"})
    seed: int = setting(0, check="non_negative_int",
                        help="seed of the random pairing (and of the random init without weights)",
                        roles={"plasticity"})
    control: str = setting("random_init", choices=CONTROLS,
                           help="random_init: also measure, on the same pairs, the same architecture at its "
                                "library's own seeded init (rows weights=random_init) and its random-init blocks fed "
                                "the model's own embeddings (rows weights=random_blocks); none: the model only")
    control_seed: int = setting(0, check="non_negative_int", help="torch seed of the control's random init",
                                roles={"plasticity"})
    workers: int = setting(1, check="positive_int", help="actors in the pool, each holding the model once")
    gpus_per_worker: float = setting(0.0, check="non_negative", help="GPUs per actor (0: CPU)")
    cpus_per_worker: float = setting(0.5, check="positive",
                                     help="logical CPUs per actor (fractional: Ray Data's feeding tasks need CPUs)")
    torch_threads: int | None = setting(None, check="optional_positive_int",
                                        help="intra-op threads of a CPU actor; None: its CPUs")
    seq_len: int | None = setting(None, check="optional_positive_int", metavar="N",
                                  help="text stores: tokens per window (each side of a pair is one window)",
                                  roles={"plasticity"})
    gated_fc1: str = setting("stacked", choices=GATED_FC1,
                             help="a gated MLP's FC1: the stacked [W_g; W_x] or the value projection W_x alone "
                                  "(up: timm's fc1_x, the authors' DINOv3 script)", roles={"plasticity"})
    text_rows: str = setting("windows", choices=TEXT_ROWS,
                             help="text stores: windows of seq_len real tokens, or each text's first seq_len "
                                  "tokens padded to seq_len (padded: the authors' GPT-2 loaders)", roles={"plasticity"})
    tokenizer: str | None = setting(None, metavar="FILE",
                                    help="text models: the tokenizer.json (None: the hf: model folder's)", path=True)


@dataclass
class ProbeSettings:
    """The linear probe (configuration ``LP``): logistic regression on the frozen model's features."""

    augment: bool = setting(True, help="the train split through the training transforms once (the authors')",
                            roles={"probe"})
    seed: int = setting(42, check="non_negative_int",
                        help="LogisticRegression's random_state and the augmentation seed (the authors' 42)",
                        roles={"probe"})
    batch_size: int | None = setting(None, check="optional_positive_int",
                                     help="images per forward pass; None: 512 on the cache path, 64 decoding")
    drop_last_batch: int | None = setting(None, check="optional_positive_int", roles={"probe"}, legacy=None,
                                          help="fit on the first floor(n / N) N rows of a seeded permutation (the "
                                               "authors' drop_last batches of 512); None: every train row")
    workers: int = setting(1, check="positive_int", help="actors of the feature pass")
    gpus_per_worker: float = setting(0.0, check="non_negative", help="GPUs per actor (0: CPU)")
    cpus_per_worker: float = setting(0.5, check="positive", help="logical CPUs per actor")


@dataclass(kw_only=True)
class PlasticityRun:
    """One plasticity job's stores, output directory and pipeline knobs (beside its model and
    :class:`PlasticitySettings`)."""

    pretrain: str = setting(flag="--pretrain-store", metavar="STORE",
                            help="prepared store of the pretraining side (x)", path=True)
    downstream: list[str] = setting(flag="--downstream", aliases=("--downstream-stores",), metavar="STORE",
                                    help="prepared downstream store(s) (y)", path=True)
    out_dir: str = setting(flag="--out", metavar="DIR", help="output directory", path=True)
    precision: str = same_as(DeviceSettings, "precision")
    figures: bool = setting(True, cli=False, help="write the per-dataset figures")
    loaders: int | None = setting(None, check="optional_positive_int", cli=False,
                                  help="load tasks at once (None: one per CPU left beside the actors)")
    stage_dir: str | None = setting(None, cli=False, help="where the staging directory is made (None: out_dir)",
                                    path=True)


@dataclass
class RunSettings:
    """What one finetuning run trains, on which store, into which directory: the axes a study's grid
    spans (configuration, optimizer, lr, seed) and the run's own files."""

    store: str = setting("", flag="--store", metavar="STORE", help="prepared store directory (raystudy data prepare)",
                         path=True)
    configuration: str = setting("MHA", aliases=("--component", "--config"), metavar="EXPR",
                                 help="what to train: a component in every block (LN1 MHA LN2 FC1 FC2), Emb, All "
                                      "or Head; unions and blocks (MHA+FC1, MHA@8-11, FC1@0,2,4); "
                                      "bias (BitFit; bias@8-11); random:<budget> (5%, 2M, 500k); "
                                      "lora|dora|loha|lokr|vera:r=<rank>[:targets], ia3[:targets] (peft). "
                                      "auto:<budget> needs a study's plasticity table (raystudy study)",
                                      roles={"resume"})
    selection: str | None = setting(None, cli=False, help="auto:/random: only: the units they were resolved to",
                                    roles={"resume"})
    selection_scores: dict = setting(factory=dict, cli=False,
                                     help="a criterion's budget only: its chosen units' scores, in chosen order")
    selection_mask: str | None = setting(None, cli=False, path=True,
                                         help=":weights budgets only: their masks' file, {param_name: bool tensor}")
    selection_seconds: float | None = setting(None, cli=False,
                                              help="a budget's selection cost: its scoring pass's wall seconds")
    optimizer: str = setting("sgd", choices=OPTIMIZERS, help="sgd (momentum) or adamw", roles={"resume"})
    lr: float = setting(1e-2, check="positive", help="learning rate as used (AdamW: the caller scales)",
                        roles={"resume"})
    seed: int = setting(0, check="non_negative_int", help="seed of the head, the data order and augmentation",
                        roles={"resume"})
    out_dir: str = setting("finetune_run", flag="--out", metavar="DIR", help="run directory", path=True)
    train_splits: str = setting("train", choices=TRAIN_SPLITS,
                                help="train: train on train, validate on val; train+val: train on their union "
                                     "(a store with a val split of its own), no validation, test the last step",
                                     roles={"resume"}, legacy="train")
    num_classes: int | None = setting(None, check="optional_positive_int",
                                      help="classes of the head; None: the store's", roles={"resume"})
    save_final: bool = setting(False, help="also write the final full model to out_dir/final_model.safetensors")
    seq_len: int | None = setting(None, metavar="N",
                                  help="text: tokens per text (None: the store's longest, capped at the model's)",
                                  roles={"resume"})
    tokenizer: str | None = same_as(PlasticitySettings, "tokenizer", roles={"resume"}, path=True)
    change_store: str | None = setting(None, metavar="STORE",
                                       help="store whose first change_images rows of change_split a run's CKA to "
                                            "the pretrained model reads (a study: its plasticity pretraining "
                                            "store; None: weight change only)", path=True)
    change_split: str | list[str] = same_as(PlasticitySettings, "pretrain_split", cli=False, roles=())
    hparams: dict = setting(factory=dict, cli=False,
                            help="more hyperparameters for the run's TensorBoard HParams record (a study's "
                                 "trial: dataset and phase)")


#: every group, by name
GROUPS: dict[str, type] = {c.__name__: c for c in (ModelSettings, HubWeights, DeviceSettings, ProtocolSettings,
                                                    RunSettings, ResourceSettings, PlasticitySettings, PlasticityRun,
                                                    ProbeSettings)}
