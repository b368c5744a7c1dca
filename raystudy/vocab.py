"""The vocabulary of a study and the schema of every table: defined here once, derived everywhere else.

Names (CLI choices, spec validation, Tune config keys and table columns all come from these tuples):

* a **component** is one of the five per-block modules the paper measures, :data:`COMPONENTS`;
* a **configuration** is what a finetuning trial trains, :data:`CONFIGURATIONS`: one component in every
  block, ``Emb`` (the embedding stage: patch embedding, class/register tokens, position embedding; the
  authors' ``emb``, not one of the paper's seven), ``All`` (every parameter) or ``Head`` (only the
  classifier). A trials table may also hold :data:`LINEAR_PROBE` rows (:data:`TRIALS_CONFIGURATIONS`);
* optimizers :data:`OPTIMIZERS`, trial statuses :data:`STATUSES` (of which :data:`FINAL_STATUSES` end a
  trial for good: ``failed`` is retried on resume), plasticity modes :data:`MODES`, lr searches
  :data:`SEARCHES`.

Tables (one Parquet file each in a study directory; extra columns are allowed and kept):
:data:`SCHEMAS` maps a table name to its required columns and their Arrow types. ``trials.parquet`` of
studies written before the vocabulary was unified calls its ``configuration`` column ``component``;
:func:`upgrade_columns` renames it on read.

This module imports nothing heavier than pyarrow, so the science core, the data layer and the CLI can all
use it.
"""

from __future__ import annotations

import difflib
import re

import pyarrow as pa

COMPONENTS: tuple[str, ...] = ("LN1", "MHA", "LN2", "FC1", "FC2")
BASELINES: tuple[str, ...] = ("All", "Head")
#: What a finetuning trial may train. The paper's seven are ``COMPONENTS + BASELINES``.
CONFIGURATIONS: tuple[str, ...] = COMPONENTS + ("Emb",) + BASELINES
#: The configuration name of a linear-probe row: written by the probe (logistic regression on frozen
#: features, fit once per dataset), never trained by a trial, so it is not in CONFIGURATIONS.
LINEAR_PROBE: str = "LP"
#: Every name a trials table's ``configuration`` column may hold: trained configurations and the probe.
TRIALS_CONFIGURATIONS: tuple[str, ...] = CONFIGURATIONS + (LINEAR_PROBE,)
#: a word of a configuration expression that is a name alone (``MHA``, ``bias``, ``ia3``), no ``:``, ``@`` or ``+``
BARE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
STATUSES: tuple[str, ...] = ("ok", "diverged", "failed")
FINAL_STATUSES: tuple[str, ...] = ("ok", "diverged")
MODES: tuple[str, ...] = ("embedding", "hidden")
SEARCHES: tuple[str, ...] = ("grid", "optuna")
#: selection criteria a budget may rank units by beside plasticity (``auto``) and ``random``
#: (:mod:`raystudy.core.criteria`): Auto-RGN, GPS-style accumulated |g|, first-order Taylor |g theta|,
#: empirical Fisher, weight magnitude
CRITERIA: tuple[str, ...] = ("rgn", "grad", "taylor", "fisher", "magnitude")
#: A trials row's stage of the benchmark protocol (VTAB-1k: VPT, NOAH): ``search`` a grid trial (trained on
#: train, lr chosen on val), ``final`` the refit at the val-chosen lr on train + val, test reported.
PHASES: tuple[str, ...] = ("search", "final")
#: VTAB-1k's task groups, in the benchmark's order (its tables: Natural | Specialized | Structured).
VTAB_GROUPS: tuple[str, ...] = ("Natural", "Specialized", "Structured")
#: VTAB-1k's 19 task folders (NOAH, VPT) in the benchmark's order -> (group, classes of the task: NOAH's
#: ``nb_classes``); read by the data layer (raystudy.data.vtab) and the analysis' per-task table.
VTAB_TASKS: dict[str, tuple[str, int]] = {
    "cifar": ("Natural", 100), "caltech101": ("Natural", 102), "dtd": ("Natural", 47),
    "oxford_flowers102": ("Natural", 102), "oxford_iiit_pet": ("Natural", 37), "svhn": ("Natural", 10),
    "sun397": ("Natural", 397),
    "patch_camelyon": ("Specialized", 2), "eurosat": ("Specialized", 10), "resisc45": ("Specialized", 45),
    "diabetic_retinopathy": ("Specialized", 5),
    "clevr_count": ("Structured", 8), "clevr_dist": ("Structured", 6), "dmlab": ("Structured", 6),
    "kitti": ("Structured", 4), "dsprites_loc": ("Structured", 16), "dsprites_ori": ("Structured", 16),
    "smallnorb_azi": ("Structured", 18), "smallnorb_ele": ("Structured", 9),
}
#: The precision a run runs in (finetuning, probe, plasticity, pretraining): fp32 (the paper's) or bf16
#: autocast with fp32 master weights (norms and reductions stay float32).
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
#: What the ``precision`` setting may say: one of :data:`PRECISIONS`, or ``auto``: bf16 where the run has a
#: CUDA device, fp32 on a CPU (:func:`raystudy.precision.resolve_precision`).
PRECISION_CHOICES: tuple[str, ...] = (*PRECISIONS, "auto")
#: How a trial reads images: a checksummed uint8 cache augmented on the device, or decode every step.
DATA_PATHS: tuple[str, ...] = ("cache", "decode")
#: The built-in procedural datasets (:mod:`raystudy.data.synthetic`): the pretraining one and its shifts.
VARIANTS: tuple[str, ...] = ("pretrain", "shift-color", "shift-noise", "shift-texture")
#: How a store's test split is drawn where the source has none: raystudy's hashed rule, or the authors'.
SPLIT_RULES: tuple[str, ...] = ("hashed", "authors")
#: Text store sources (:mod:`raystudy.data.text`).
TEXT_SOURCES: tuple[str, ...] = ("agnews", "wikitext103", "textfolder")
#: What one WikiText-103 row is (``unit``): an article, a paragraph or a non-empty line.
WIKITEXT_UNITS: tuple[str, ...] = ("document", "paragraph", "line")
#: Image store sources, one reader each (:mod:`raystudy.data.sources`, :mod:`raystudy.data.readers`).
SOURCES: tuple[str, ...] = ("cifar10", "cifar100", "cifar10c", "domainnet", "flowers102", "pets", "imagenet",
                             "imagefolder", "vtab1k", "synthetic")
#: What preparing a store does with an image that does not decode: stop with its name, or skip it.
BAD_IMAGE_POLICIES: tuple[str, ...] = ("error", "skip")
#: The low-data variants of a store: VTAB-1k's 800 + 200 rows, or the authors' low-data draw.
LOW_DATA: tuple[str, ...] = ("vtab1k", "authors")
#: Official splits a store may pool (``--pool``): ``val`` folds it into train, ``test`` redraws an 80/20 split.
POOLABLE: tuple[str, ...] = ("val", "test")
#: experiment trackers a study can log to through Ray Tune's own integrations (``tracking: [wandb]``)
TRACKERS: tuple[str, ...] = ("wandb", "mlflow")
#: ``scipy.stats.wilcoxon`` alternatives; ``"greater"``: the reference configuration is better.
ALTERNATIVES: tuple[str, ...] = ("greater", "two-sided", "less")
#: What one Wilcoxon pair is: a dataset (best-lr means over seeds) or a (dataset, seed) pair.
PAIR_BY: tuple[str, ...] = ("dataset", "dataset_seed")
#: How the best learning rate of a sweep is chosen: by its mean test accuracy over seeds (the paper's
#: Table 8) or by its mean best-validation accuracy (validation only: test never chooses; VTAB-1k's rule).
SELECT_BY: tuple[str, ...] = ("test", "val")
#: How a new head is initialised: truncated normal (std 0.02, zero bias; timm's), zeros (the original ViT
#: finetuning recipe) or nn.Linear's own default (the paper authors' head).
HEAD_INITS: tuple[str, ...] = ("trunc_normal", "zero", "torch_default")
#: How val/test accuracy is averaged: over images, or the mean over eval batches of each batch's
#: accuracy (the paper authors' run_evaluation, where a short last batch weighs as a full one).
ACCURACIES: tuple[str, ...] = ("per_sample", "per_batch")
#: At which steps a run evaluates val (:func:`raystudy.core.finetune.config.evaluates_at`): every
#: ``eval_period``-th step and the last one, or the paper authors' ``train.py`` loop: every
#: ``min(eval_period, steps)``-th step only (the last one only when it is such a multiple: 10,000 steps every
#: 350 end at 9,800).
EVAL_STEPS: tuple[str, ...] = ("every_and_last", "authors")
#: The linear warmup's factor at update ``k`` (0-based) of ``w`` warmup steps (:func:`raystudy.core.finetune.
#: config.warmup_cosine`): ``(k + 1) / w`` (the first update at ``lr / w``, the last warmup one at ``lr``) or
#: ``k / w``, the paper authors' ``lr_cosine`` (``src/vitef/optim.py``: their first update runs at lr 0).
WARMUP_FACTORS: tuple[str, ...] = ("k_plus_1", "k")
#: How a timm attention module computes softmax(q k^T / sqrt(d)) v: PyTorch's fused
#: ``scaled_dot_product_attention`` or the explicit matmul-softmax-matmul (timm's ``fused_attn=False``; the
#: paper authors' ViT has ``flash=False``).
ATTENTIONS: tuple[str, ...] = ("fused", "explicit")
#: What a run that diverged before its first evaluation reports as its test accuracy: nothing (``excluded``
#: from the analysis), or that of predicting class 0 for every test image (``class_0``): the paper authors'
#: run keeps training into NaN weights, its NaN logits' argmax is 0, and it reports that accuracy.
DIVERGED_TESTS: tuple[str, ...] = ("excluded", "class_0")
#: Which rows a run trains on and validates on: the store's own train/val split, or the store's train and
#: val rows pooled and split anew by the run's seed in the same sizes (the paper authors' random_split per
#: run): ``per_seed`` by raystudy's own permutation (:func:`raystudy.core.finetune.data.per_seed_rows`),
#: ``authors`` by theirs, row for row (torch's, :func:`raystudy.core.finetune.data.authors_rows`).
VAL_SPLITS: tuple[str, ...] = ("fixed", "per_seed", "authors")
#: How an image becomes ``size x size`` without augmentation (evaluation; training with ``augment`` off):
#: ``crop`` the shorter side resized to ``size`` then the centre square (the paper's); ``stretch`` the whole
#: image resized to ``size x size``, bicubic, aspect ratio not kept (VTAB-1k's benchmark: VPT, NOAH's
#: ``Resize((224, 224), interpolation=3)``, V-PETL Bench), :func:`raystudy.data.transforms.eval_geometry`.
RESIZES: tuple[str, ...] = ("crop", "stretch")
#: Which store splits a run trains on: ``train`` (validated on val), or ``train+val`` the union of the two
#: (VTAB-1k's final fit on train800val200: no validation, the last step is tested).
TRAIN_SPLITS: tuple[str, ...] = ("train", "train+val")
#: Where a study trial trains: ``train`` a Ray Train worker group per trial (any number of workers, worker
#: restarts from checkpoints); ``actor`` inside the trial's own Tune actor, reused from trial to trial (one
#: worker; no per-trial worker-group start); ``auto``: ``actor`` for one worker per trial, else ``train``.
EXECUTIONS: tuple[str, ...] = ("auto", "train", "actor")
#: How plasticity pairs pretraining and downstream images: seeded random, or the i-th with the i-th
#: (the authors' unshuffled loaders; :mod:`raystudy.data.pairing`).
PAIRINGS: tuple[str, ...] = ("random", "sequential")
#: what MHA receives in ``embedding`` mode: the embeddings themselves (the paper's definition) or the
#: embeddings through the block's LN1 (the authors' GPT-2 script, ``get_decomposition``)
MHA_INPUTS: tuple[str, ...] = ("raw", "normed")
#: the rows of a text side: non-overlapping windows of real tokens, or each text's first n tokens padded to n
#: (the authors' GPT-2 loaders: ``truncation=True, padding="max_length"``)
TEXT_ROWS: tuple[str, ...] = ("windows", "padded")
#: FC1 of a gated MLP (SwiGLU): the stacked input projections [W_g; W_x] or the value projection W_x alone
#: (timm's ``fc1_x``, the ``up_proj`` the authors' DINOv3 script measures)
GATED_FC1: tuple[str, ...] = ("stacked", "up")
#: the formulas of the plasticity upper bounds (:mod:`raystudy.core.bounds`): the paper's (Section 4: rows of
#: W_Q/W_K/W_V per head, max|gamma|/sigma, FC2 on the lifted tokens W_2[:, :d]) or those the authors' Fig. 7
#: computes (``apps/plots/theory.py``: columns per head, max(gamma), the whole W_2); the first is the default
BOUNDS_FORMULAS: tuple[str, ...] = ("paper", "authors")
#: the values of ``plasticity.bounds`` (``--bounds``): one of the formulas, or ``both``: the rows of each, told
#: apart by the bounds table's column ``bounds`` (the paper's formulas and what the authors' Fig. 7 plots)
BOUNDS_CHOICES: tuple[str, ...] = (*BOUNDS_FORMULAS, "both")

_str, _int, _float = pa.string(), pa.int64(), pa.float64()

#: Every table's required columns with their Arrow types, in column order.
SCHEMAS: dict[str, pa.Schema] = {
    # per (dataset, layer, component): mean rate over pairs (rates.parquet reduced)
    "plasticity": pa.schema([
        ("model", _str), ("dataset", _str), ("mode", _str), ("layer", _int), ("component", _str),
        ("plasticity", _float), ("std", _float), ("ci95", _float), ("n_pairs", _int),
    ]),
    # the plasticity table of the model at a step of its pretraining (raystudy.study.pretrain_path)
    "plasticity_pretraining": pa.schema([
        ("model", _str), ("dataset", _str), ("mode", _str), ("step", _int), ("layer", _int), ("component", _str),
        ("plasticity", _float), ("std", _float), ("ci95", _float), ("n_pairs", _int),
    ]),
    # per pair: ||f(x) - f(y)||_F / ||x - y||_F
    "rates": pa.schema([
        ("model", _str), ("dataset", _str), ("mode", _str), ("pair", _int), ("layer", _int),
        ("component", _str), ("rate", _float),
    ]),
    # which pretraining and downstream rows form pair ``pair`` of a dataset
    "pairs": pa.schema([
        ("dataset", _str), ("pair", _int), ("pretrain_index", _int), ("downstream_index", _int),
    ]),
    # per (layer, component): the theoretical upper bound on plasticity
    "bounds": pa.schema([
        ("model", _str), ("layer", _int), ("component", _str), ("bound", _float), ("radius", _float),
        ("seq_len", _int),
    ]),
    # one row per finetuning trial; accuracies are fractions in [0, 1]; null where a failed trial has none
    "trials": pa.schema([
        ("trial_id", _str), ("dataset", _str), ("model", _str), ("configuration", _str), ("optimizer", _str),
        ("lr", _float), ("seed", _int), ("steps", _int), ("batch_size", _int), ("trainable_params", _int),
        ("status", _str), ("best_val_acc", _float), ("best_val_step", _int), ("test_acc", _float),
        ("final_val_loss", _float), ("wall_seconds", _float),
    ]),
    # one row per logged step of a trial; val columns null between evaluations; ``lr_now`` the learning rate
    # of that step's update (the schedule's: warmup, cosine decay), the trial's base rate being trials' ``lr``
    "curves": pa.schema([
        ("trial_id", _str), ("step", _int), ("lr_now", _float), ("train_loss", _float), ("grad_norm", _float),
        ("val_loss", _float), ("val_acc", _float),
    ]),
    # what finetuning changed, per trial (raystudy.core.change): measure weight_change per (layer, component),
    # cka per layer (component null: the block's output against the pretrained model's)
    "changes": pa.schema([
        ("trial_id", _str), ("layer", _int), ("component", _str), ("measure", _str), ("value", _float),
    ]),
}

#: Counts of a run's summary that ``trials.parquet`` stores beside the schema's columns: nullable integers
#: (null where a failed trial has none), whichever row is written first.
TRIAL_COUNT_EXTRAS: tuple[str, ...] = (
    "steps_completed", "diverged_step", "workers", "num_classes", "num_restores", "restored_from_step",
    "worker_failures", "trial_restarts", "checkpoints_skipped", "grad_memory_bytes", "optimizer_memory_bytes",
    "grad_memory_bytes_analytic", "optimizer_memory_bytes_analytic", "selection_entries", "test_examples",
)

#: The columns of one run's own ``curves.parquet`` (a trial directory: no ``trial_id`` yet, two extras).
RUN_CURVE_COLUMNS: tuple[str, ...] = (
    "step", "lr_now", "train_loss", "grad_norm", "component_grad_norm", "images_per_s", "val_loss", "val_acc",
)

#: The measures of the ``changes`` table: the relative weight change ||W_ft - W_0|| / ||W_0|| of a (component,
#: block), and the linear CKA of a block's output tokens between the pretrained and the finetuned model.
CHANGE_MEASURES: tuple[str, ...] = ("weight_change", "cka")

#: Old column names, per table, and the name they have now (curves' ``lr`` was the scheduled rate of the step,
#: ``lr_now`` now: ``lr`` means the trial's base rate in every table).
RENAMED_COLUMNS: dict[str, dict[str, str]] = {"trials": {"component": "configuration"}, "curves": {"lr": "lr_now"}}

#: Which weights a plasticity / rates row was measured with: the model's own (``pretrained``: its weights
#: file, or whatever the job measured before the control existed); the same architecture at its library's
#: own seeded initialisation (``random_init``: timm's / Hugging Face's init, no weights loaded), the whole-model
#: control; or that random init with the measured model's embedding stage copied in (``random_blocks``: the
#: state-dict entries of the adapter's ``embedding_names()``, everything else the same seeded init), the
#: component control: random-init blocks fed the model's own embeddings, so that each component sees the
#: inputs the pretrained one sees. pretrained / random_blocks is the component weights' own effect,
#: random_blocks / random_init the effect of the inputs (the embedding's).
WEIGHTS: tuple[str, ...] = ("pretrained", "random_init", "random_blocks")
PRETRAINED, RANDOM_INIT, RANDOM_BLOCKS = WEIGHTS
#: The weights a control measures beside the model, each on the same pairs under the same ``control_seed``.
CONTROL_WEIGHTS: tuple[str, ...] = WEIGHTS[1:]
#: The control a plasticity measurement runs beside the model: ``random_init`` (the default: every
#: :data:`CONTROL_WEIGHTS`) or ``none``.
CONTROLS: tuple[str, ...] = (RANDOM_INIT, "none")
#: The paper's ranking of the components by plasticity, most plastic first.
PAPER_RANKING: tuple[str, ...] = ("MHA", "FC1", "FC2", "LN2", "LN1")

#: Columns a table holds beside its schema, with the value older tables (without them) read as.
#: (a plasticity table without ``precision`` was measured in fp32, the only precision before it; a bounds table
#: without ``bounds`` holds the paper's formulas, the only ones before the authors' were offered).
DEFAULTED_COLUMNS: dict[str, dict[str, str]] = {"plasticity": {"weights": PRETRAINED, "precision": PRECISIONS[0]},
                                                "rates": {"weights": PRETRAINED},
                                                "bounds": {"bounds": BOUNDS_FORMULAS[0]}}


def bounds_formulas(choice: str) -> tuple[str, ...]:
    """The formulas a ``plasticity.bounds`` value computes, in :data:`BOUNDS_FORMULAS` order (``both``: all);
    ``ValueError`` naming the choices for another value."""
    if choice not in BOUNDS_CHOICES:
        raise ValueError(f"unknown bounds formulas {choice!r}; choose one of {list(BOUNDS_CHOICES)}")
    return BOUNDS_FORMULAS if choice == BOUNDS_CHOICES[-1] else (choice,)


def columns(table: str) -> list[str]:
    """The required column names of ``table``."""
    return list(SCHEMAS[table].names)


def upgrade_columns(df, table: str):
    """Rename the old columns of ``table`` (a pandas DataFrame from an older study) to today's names and
    add its :data:`DEFAULTED_COLUMNS` where absent (a plasticity table without ``weights`` is ``pretrained``).
    A frame holding both names (a dataset folder whose older part files have the old one) takes the old
    column's value in the rows where the new one is null, then drops the old column."""
    for old, new in RENAMED_COLUMNS.get(table, {}).items():
        if old in df.columns and new not in df.columns:
            df = df.rename(columns={old: new})
        elif old in df.columns:
            df = df.assign(**{new: df[new].where(df[new].notna(), df[old])}).drop(columns=[old])
    missing = {c: v for c, v in DEFAULTED_COLUMNS.get(table, {}).items() if c not in df.columns}
    return df.assign(**missing) if missing else df


def pretrained_rows(df):
    """The rows of a plasticity or rates frame measured with the model's own weights (all rows of a frame
    without a ``weights`` column, which predates the control); ``None`` stays ``None``."""
    if df is None or "weights" not in df.columns:
        return df
    return df[df["weights"] == PRETRAINED].reset_index(drop=True)


def control_rows(df):
    """The control rows of a plasticity or rates frame (``weights`` one of :data:`CONTROL_WEIGHTS`: the
    random init and the component control); ``None`` when it has no random-init rows."""
    if df is None or "weights" not in df.columns or not (df["weights"] == RANDOM_INIT).any():
        return None
    return df[df["weights"].isin(CONTROL_WEIGHTS)].reset_index(drop=True)


def did_you_mean(name: object, choices) -> str:
    """``"; did you mean 'FC1'?"`` for the choice closest to ``name`` (``fc1``), or ``""`` when none is close.

    Case is ignored (a choice equal to ``name`` but for case wins), then ``difflib.get_close_matches``
    (ratio >= 0.6) picks the closest: the one rule of every "unknown X" message (presets, spec fields,
    configuration names, choices)."""
    by_folded = {str(c).casefold(): str(c) for c in choices}
    folded = str(name).casefold()
    close = [folded] if folded in by_folded else difflib.get_close_matches(folded, list(by_folded), n=1)
    return f"; did you mean {by_folded[close[0]]!r}?" if close else ""


def misspelt_configuration(word: object, names: tuple[str, ...] = CONFIGURATIONS) -> bool:
    """Whether ``word``, when it is a bare name (letters, digits, ``_``: no expression), names no configuration
    of ``names`` for certain: it is none of them, yet one of them up to case (``fc1``), or capitalised (every
    other word of the expression grammar is lower-case: a budget's strategy, a PEFT method, an adapter's layer).
    Told from the names alone, before the grammar (:mod:`raystudy.core.expressions`, which loads torch), so that
    such a name is refused within a second; ``False`` leaves the word to the grammar."""
    if not isinstance(word, str) or not BARE_NAME.fullmatch(word) or word in names:
        return False
    return word[0].isupper() or word.casefold() in {n.casefold() for n in names}


def check_name(value: str, allowed: tuple[str, ...], what: str) -> str:
    """``value`` if it is one of ``allowed``; else ``ValueError`` naming ``what``, the closest choice and all."""
    if value not in allowed:
        raise ValueError(f"{what}: unknown value {value!r}{did_you_mean(value, allowed) or ';'} expected one of "
                         f"{list(allowed)}")
    return value
