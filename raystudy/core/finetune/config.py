"""The finetuning protocol: :class:`FinetuneConfig`, its validation, the learning-rate schedule, the optimizer.

A config holds the protocol only (what is trained, how, on which data, for how long). Where and on how many
workers a run executes is the caller's business (:class:`raystudy.distributed.train.TrainResources` for Ray
Train; one process for :func:`raystudy.core.finetune.train_local`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields

import torch

from raystudy.core.expressions import Budgeted, Combination, ExpressionError, parse
from raystudy.core.models import resolve_img_size
from raystudy.data.modality import absolute_model
from raystudy.precision import resolve_precision, upgrade_settings
from raystudy.setting_roles import absolute_paths, legacy_values
from raystudy.settings import (
    HubWeights,
    ModelSettings,
    ProtocolSettings,
    RunSettings,
    problems,
    warmup_of,
)
from raystudy.storage import absolute_path
from raystudy.vocab import EVAL_STEPS, OPTIMIZERS

log = logging.getLogger(__name__)

#: Keys of older ``config.json`` files and their names now.
RENAMED_KEYS = {"component": "configuration"}
#: Keys of older ``config.json`` files that are no longer protocol settings: Ray Train's resources (now
#: :class:`raystudy.distributed.train.TrainResources`) and the former test hook ``fail_after_step`` (now
#: :mod:`raystudy.faults`). :meth:`FinetuneConfig.from_dict` ignores them.
MOVED_KEYS = ("workers", "gpus_per_worker", "cpus_per_worker", "max_failures", "keep_checkpoints",
              "cleanup_checkpoints", "fail_after_step")
# What a setting means to a run is declared on the setting (raystudy.setting_roles.ROLES): the fields a checkpoint
# must agree on are ``fields_with(FinetuneConfig, "resume")`` (others, e.g. eval_period or the workers, may
# change), the paths made absolute on construction ``fields_with(FinetuneConfig, "path")`` (Ray workers do not
# run in the caller's directory), and what an older ``config.json`` lacks ``legacy_values(FinetuneConfig)``.


@dataclass
class FinetuneConfig(RunSettings, ModelSettings, HubWeights, ProtocolSettings):
    """One finetuning run: the model (:class:`~raystudy.settings.ModelSettings`), the protocol
    (:class:`~raystudy.settings.ProtocolSettings`: steps, batch, schedule, precision, data path, ...; each
    setting's default and help text are defined there once) and the run's own settings
    (:class:`~raystudy.settings.RunSettings`: store, configuration, optimizer, lr, seed, out_dir, ...).
    Defaults are the paper's protocol (ViT-B/16 at 224 px, SGD, 10,000 steps).

    ``batch_size`` is the *global* batch (all workers together); each worker processes its share in
    micro-batches of at most ``micro_batch_size`` (None: the whole share at once). ``model`` is a timm name;
    ``model_kwargs`` go to ``timm.create_model`` (e.g. a tiny ViT: ``dict(img_size=32, patch_size=8,
    embed_dim=48, depth=3, num_heads=4)``); an ``img_size`` in them must equal ``img_size`` (``None``: the
    model's own, resolved on construction). ``weights`` is a local file (see
    :func:`raystudy.core.models.load_weights`), ``pretrained=True`` downloads timm's weights instead (needs
    internet); with neither the backbone is random (tests). ``num_classes`` None takes the store's.
    ``warmup_steps`` None is 20% of ``steps``; ``checkpoint_period`` None equals ``eval_period``; ``0``
    disables periodic checkpoints. Paths (``store``, ``out_dir``, ``weights``, ``cache_dir``,
    ``tokenizer``) are made absolute on construction: Ray workers run in another directory.

    Speed settings: ``precision`` ``auto`` picks bf16 on CUDA and fp32 elsewhere
    (:func:`~raystudy.precision.resolve_precision`); ``compile`` wraps the training forward/backward in
    ``torch.compile``; ``data_path`` ``cache`` (default) reads uint8 rows of a per-store cache under
    ``cache_dir`` (None: ``STORE/cache``) and augments on the training device, ``decode`` decodes every
    image at every step (the data path before the cache; older ``config.json`` files load with it).

    ``configuration`` is a configuration expression (:mod:`raystudy.core.expressions`: ``MHA``,
    ``MHA@8-11+FC1``, ``auto:5%``, ``random:2M``, ``lora:r=8``). ``selection`` is the combination a budget
    (``auto:B`` / ``random:B``) was resolved to, e.g. ``MHA@10-11+FC1@11``: the run trains exactly it, so
    that workers need no plasticity table and a resumed run trains what the first attempt did
    (:func:`raystudy.study.jobs.finetune_job` resolves it once per trial). ``auto:B`` and a criterion's
    budget (``fisher:B``, ...; ``selection_scores`` its units' scores) require it;
    ``random:B`` without it resolves its units from ``seed``. A ``:weights`` budget (``fisher:1%:weights``)
    trains the entries of the masks in ``selection_mask`` (a safetensors file ``{param_name: bool tensor}``;
    ``random:B:weights`` without it draws them from ``seed``); its ``selection`` is then the units the masks
    touch, for the record only.

    Text classifiers: ``model="hf:<dir>"`` (a Hugging Face BERT / GPT-2 / Llama family model, see
    :mod:`raystudy.core.hf`) on a text store (``kind: text``) gets a sequence-classification head; each
    text is tokenised by ``tokenizer`` (None: the model folder's ``tokenizer.json``) with the model's
    special tokens, truncated and padded to ``seq_len`` tokens with an attention mask (None: the store's
    longest text, at most the model's positions); see :mod:`raystudy.core.finetune.text`. ``img_size``,
    ``augment`` and ``data_path`` do not apply to text.
    """


    def __post_init__(self):
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        self.model_kwargs = dict(self.model_kwargs or {})
        absolute_paths(self, absolute_path)
        self.model = absolute_model(self.model)
        if self.img_size is None:
            self.img_size = resolve_img_size(self.model, self.model_kwargs)

    def validate(self) -> FinetuneConfig:
        """Raise ``ValueError`` naming the first offending field; returns ``self``."""
        for name, why in self._problems():
            raise ValueError(f"FinetuneConfig.{name}={getattr(self, name)!r}: {why}")
        return self

    def _configuration_problems(self) -> Iterator[tuple[str, str]]:
        """``configuration`` parses; ``selection`` is a combination, given with a budget only (and with
        ``auto:B``, which cannot be resolved without the dataset's plasticity table); ``selection_mask`` with a
        ``:weights`` budget only, and required by a criterion's."""
        try:
            tree = parse(self.configuration)
        except (ExpressionError, TypeError) as e:
            yield "configuration", str(e)
            return
        budgeted = isinstance(tree, Budgeted)
        weights = budgeted and tree.weights
        if self.selection_mask is not None and not weights:
            yield "selection_mask", f"only a :weights budget has a mask, not {self.configuration!r}"
        if weights and self.selection_mask is None and tree.strategy != "random":
            yield "configuration", (f"{tree.strategy}:<budget>:weights needs `selection_mask`, the file of the "
                                    "masks its scores choose (raystudy.study.jobs.finetune_job sets it)")
        if self.selection is None:
            if budgeted and not weights and tree.strategy != "random":
                source = "plasticity table" if tree.strategy == "auto" else f"{tree.strategy} scores"
                yield "configuration", (f"{tree.strategy}:<budget> needs `selection`, the units it resolves to "
                                        f"from the dataset's {source} (raystudy.study.jobs.finetune_job sets it)")
            return
        if not budgeted:
            yield "selection", ("only a budget (auto:, random:, a criterion) has a selection, not "
                                f"{self.configuration!r}")
            return
        try:
            ok = isinstance(parse(self.selection), Combination)
        except (ExpressionError, TypeError) as e:
            yield "selection", str(e)
            return
        if not ok:
            yield "selection", "expected a combination of units such as MHA@10-11+FC1@11"

    def _problems(self) -> Iterator[tuple[str, str]]:
        """The settings' own checks (:func:`raystudy.settings.problems`), then what relates fields."""
        yield from self._configuration_problems()
        yield from problems(self)
        if self.seq_len is not None and not (isinstance(self.seq_len, int) and self.seq_len >= 2):
            yield "seq_len", "must be None or an integer >= 2"
        if self.loader_batch_size is not None and self.batch_size % self.loader_batch_size:
            yield "loader_batch_size", f"must divide batch_size={self.batch_size}"
        if self.warmup_steps is not None and not (0 <= self.warmup_steps <= self.steps):
            yield "warmup_steps", f"must be None or in [0, steps={self.steps}]"
        if self.weights is not None and self.pretrained:
            yield "weights", "pass either weights=FILE or pretrained=True, not both"
        if self.img_size is not None and self.model_kwargs.get("img_size", self.img_size) != self.img_size:
            yield "img_size", f"differs from model_kwargs['img_size']={self.model_kwargs['img_size']}; set both alike"
        if "num_classes" in self.model_kwargs:
            yield "model_kwargs", "num_classes belongs in FinetuneConfig.num_classes (None: from the store)"
        if not self.store:
            yield "store", "a prepared store directory is required"

    @property
    def warmup(self) -> int:
        """Warmup steps actually used: ``warmup_steps`` or ``round(0.2 * steps)``."""
        return warmup_of(self.steps, self.warmup_steps)

    def resolved_precision(self, device: torch.device | str) -> str:
        """The precision the run runs in on ``device``: :func:`~raystudy.precision.resolve_precision`."""
        return resolve_precision(self.precision, torch.device(device).type == "cuda")

    @property
    def loader_batch(self) -> int:
        """Rows of one loader batch, the unit ``drop_last`` cuts epochs into: ``loader_batch_size`` or
        ``batch_size``."""
        return self.loader_batch_size or self.batch_size

    @property
    def ckpt_period(self) -> int:
        return self.eval_period if self.checkpoint_period is None else self.checkpoint_period

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> FinetuneConfig:
        """The config of ``d`` (e.g. a run's ``config.json``); the keys of older files are accepted:
        :data:`RENAMED_KEYS` are renamed, :data:`MOVED_KEYS` ignored, older settings upgraded
        (:func:`~raystudy.precision.upgrade_settings`), missing fields declared with a ``legacy`` value
        (:func:`~raystudy.setting_roles.legacy_values`) and ``precision`` filled in with what such a file's run
        did (fp32 before the setting existed)."""
        d = upgrade_settings({**legacy_values(cls), **d}, "FinetuneConfig.")
        d.setdefault("precision", "fp32")
        for old, new in RENAMED_KEYS.items():
            if old in d:
                d.setdefault(new, d.pop(old))
        moved = [k for k in MOVED_KEYS if d.pop(k, None) is not None]
        if moved:
            log.debug("FinetuneConfig.from_dict: %s are no longer protocol settings; ignored", moved)
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown FinetuneConfig field(s) {unknown}")
        return cls(**d)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, factor: str = "k_plus_1") -> float:
    """Learning-rate factor of update ``step`` (0-based): linear warmup then cosine decay.

    ``(step + 1) / w`` for ``step < w``, then ``0.5 (1 + cos(pi (step - w) / (T - w)))``: the factor
    reaches 1 at the last warmup step and decays towards 0 at ``T`` (the same curve as ``transformers``'
    ``get_cosine_schedule_with_warmup``, shifted by one step so the first update is not wasted).
    ``factor="k"`` (:data:`raystudy.vocab.WARMUP_FACTORS`): ``step / w`` during warmup, the paper authors'
    ``lr_cosine`` with ``min_factor=0`` (their first update at lr 0, the factor 1 first at ``step = w``).
    """
    if step < warmup_steps:
        return (step + (factor == "k_plus_1")) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def evaluates_at(step: int, steps: int, eval_period: int, rule: str) -> bool:
    """Whether update ``step`` (1-based, of ``steps``) evaluates val under ``rule`` (:data:`~raystudy.vocab.
    EVAL_STEPS`): ``every_and_last``: ``step % eval_period == 0 or step == steps``; ``authors``: ``step % p == 0``
    with ``p = min(eval_period, steps)`` (their ``TrainingConfig.__post_init__`` sets ``eval_period = n_steps``
    when it exceeds ``n_steps``; no evaluation at step 0 nor at a last step that is no multiple of ``p``)."""
    if rule == "authors":
        return step % min(eval_period, steps) == 0
    if rule == "every_and_last":
        return step % eval_period == 0 or step == steps
    raise ValueError(f"eval_steps={rule!r}: expected one of {list(EVAL_STEPS)}")


def make_optimizer(params: list[torch.nn.Parameter], cfg: FinetuneConfig, *,
                   fused: bool | None = None) -> torch.optim.Optimizer:
    """SGD (momentum ``cfg.momentum``, no Nesterov) or AdamW (``cfg.betas``), weight decay ``cfg.weight_decay``.

    ``fused`` None: the fused CUDA kernels when every parameter is on a CUDA device (one launch per step
    instead of several per tensor), PyTorch's default (foreach) otherwise.
    """
    if fused is None:
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
    fused = fused or None  # None (not False) keeps PyTorch's foreach default
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                 fused=fused)
    raise ValueError(f"FinetuneConfig.optimizer={cfg.optimizer!r}: expected one of {list(OPTIMIZERS)}")


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: FinetuneConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """:func:`warmup_cosine` over ``cfg.steps`` updates with ``cfg.warmup`` warmup steps and
    ``cfg.warmup_factor``, times ``cfg.lr``."""
    warmup, total, factor = cfg.warmup, cfg.steps, cfg.warmup_factor
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, total, factor))
