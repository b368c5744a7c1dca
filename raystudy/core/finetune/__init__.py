"""Component-wise finetuning in pure PyTorch: the paper's protocol, one step at a time (no Ray here).

One run = one configuration (``LN1``, ``MHA``, ``LN2``, ``FC1``, ``FC2``, ``All`` or ``Head``) finetuned on
one prepared store with one optimizer, learning rate and seed. :class:`Finetuner` holds everything a run
needs (model, parameter selection, optimizer, schedule, data order, best-validation state, curves) and can
run single-process as it is (:func:`train_local`, the reference loop), inside a Ray Train worker, which
passes its rank and world size, a DDP wrapper and an all-reduce (:mod:`raystudy.distributed.train`), or in
a study trial's actor (:mod:`raystudy.distributed.inprocess`). All of them are :func:`run` with their own
checkpointer and reporter, and execute the same code.

Protocol (paper, Appendix D; every value is a :class:`FinetuneConfig` field):

* classification head newly initialised (truncated normal, std 0.02, zero bias; seeded by ``seed``) and
  trainable in every configuration; everything outside the configuration's selection frozen, the final
  norm included unless ``train_final_norm`` (``All`` trains it anyway);
* SGD with momentum 0.9 and no weight decay, or AdamW with betas (0.9, 0.999) (weight decay 0 by default,
  like SGD; ``lr`` is used as given: the paper's AdamW grid is ``1e-2 x`` the SGD grid, the caller scales);
* cosine decay with linear warmup, :func:`warmup_cosine` (the paper: 2000 warmup steps of 10,000; a shorter
  run keeps the same 20% fraction unless ``warmup_steps`` is set);
* gradient clipping at global norm 1; global batch 512, split evenly over the workers, each worker
  accumulating micro-batches of ``micro_batch_size`` when its share does not fit;
* evaluation on ``val`` every ``eval_period`` steps and at the last step (``eval_steps: authors``: every
  ``min(eval_period, steps)`` steps only, :func:`~raystudy.core.finetune.config.evaluates_at`); the
  best-validation trainable state is kept and the run's result is its **test** accuracy.

Exactness: the data order is a pure function of ``(seed, step)`` sliced contiguously over the workers
(:mod:`.data`), and each worker's loss is normalised by its share so that DDP's average is the gradient
of the global batch's mean loss (:mod:`.step`): ``W`` workers with batch ``b`` compute what one worker
with batch ``W b`` computes, and a resumed run continues exactly.

Modules: :mod:`.config` (the protocol, schedule, optimizer), :mod:`.selection` (model, head, freezing),
:mod:`.data` (data order, the decode and cache data paths), :mod:`.augment` (batched augmentation on the
training device), :mod:`.step` (the step, evaluation, memory), :mod:`.state` (checkpoint files,
RNG, fingerprints), :mod:`.loop` (:class:`Finetuner`), :mod:`.checkpoint` (the checkpoint layout and its
completion marker, checkpointers), :mod:`.driver` (:func:`run`, the one run driver, with TensorBoard,
reports, the test fault and the summary; :func:`train_local`), :mod:`.outputs` (summary, curves, weights).
"""

from raystudy.core.finetune.checkpoint import (
    CHECKPOINT_PREFIX,
    COMPLETE_MARKER,
    Checkpointer,
    DirectoryCheckpointer,
    NoCheckpoints,
    checkpoint_steps,
    resume_latest,
    save_checkpoint,
)
from raystudy.core.finetune.config import (
    MOVED_KEYS,
    RENAMED_KEYS,
    FinetuneConfig,
    make_optimizer,
    make_scheduler,
    warmup_cosine,
)
from raystudy.core.finetune.data import (
    CacheBatch,
    CachedSplitData,
    MicroBatches,
    SplitData,
    epoch_permutation,
    global_batch,
    open_split_data,
    prepare_caches,
    to_device,
)
from raystudy.core.finetune.driver import (
    INJECTED_MARKER,
    ForwardReports,
    InjectedFailure,
    Reporter,
    TensorBoardLogger,
    event_metrics,
    failed_summary,
    finished_summary,
    run,
    save_weights,
    train_local,
)
from raystudy.core.finetune.loop import (
    Event,
    Finetuner,
    ThroughputMeter,
    curve_row,
    steady_throughput,
)
from raystudy.core.finetune.outputs import (
    CURVE_COLUMNS,
    HPARAM_KEYS,
    HPARAM_METRICS,
    MEMORY_KEYS,
    RESULT_DEFAULTS,
    curves_frame,
    run_hparams,
    run_summary,
    save_safetensors,
    write_outputs,
)
from raystudy.core.finetune.selection import (
    TrainedParameters,
    build_finetune_model,
    enable_fused_attention,
    final_norm_parameters,
    reset_head,
    select_and_freeze,
    select_for,
)
from raystudy.core.finetune.state import (
    RNG_FILE,
    STATE_FILE,
    fingerprint,
    read_state,
    restore_rng,
    resume_config,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from raystudy.core.finetune.step import (
    StepResult,
    analytic_memory,
    autocast,
    evaluate,
    measured_memory,
    set_matmul_precision,
    train_step,
)

__all__ = [
    "CacheBatch", "CachedSplitData", "enable_fused_attention",
    "open_split_data", "prepare_caches", "set_matmul_precision", "to_device",
    "CURVE_COLUMNS", "HPARAM_KEYS", "HPARAM_METRICS", "MEMORY_KEYS", "MOVED_KEYS",
    "RENAMED_KEYS", "RESULT_DEFAULTS", "RNG_FILE", "STATE_FILE",
    "Event", "FinetuneConfig", "Finetuner", "MicroBatches", "TrainedParameters", "SplitData", "StepResult",
    "TensorBoardLogger", "ThroughputMeter", "analytic_memory", "autocast", "build_finetune_model", "curve_row",
    "curves_frame", "epoch_permutation", "evaluate", "final_norm_parameters", "fingerprint", "global_batch",
    "make_optimizer", "make_scheduler", "measured_memory", "read_state", "reset_head", "restore_rng",
    "resume_config", "rng_state", "run_hparams", "run_summary", "save_safetensors", "select_and_freeze",
    "select_for", "set_rng_state", "steady_throughput", "train_local", "train_step", "warmup_cosine",
    "write_checkpoint", "write_outputs", "save_weights",
    "CHECKPOINT_PREFIX", "COMPLETE_MARKER", "INJECTED_MARKER", "Checkpointer", "DirectoryCheckpointer",
    "ForwardReports", "InjectedFailure", "NoCheckpoints", "Reporter", "checkpoint_steps", "event_metrics",
    "failed_summary", "finished_summary", "resume_latest", "run", "save_checkpoint",
]
