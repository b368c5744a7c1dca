"""Finetuning on Ray Train (V2): a thin layer over :class:`raystudy.core.finetune.Finetuner`.

``run_finetune(cfg)`` builds a ``TorchTrainer`` (:func:`make_trainer`) with ``cfg.workers`` workers, fits it
and writes the run's outputs into ``cfg.out_dir``:

* ``summary.json``: the ``trials.parquet`` columns of the run (the caller adds trial_id, dataset, model)
  plus memory, throughput and restore figures; ``curves.parquet``: step, lr, train_loss, grad_norm,
  component_grad_norm, images_per_s, val_loss, val_acc (val columns null between evaluations);
* ``tb/``: TensorBoard events (written by worker 0); ``best_trainable.safetensors``: the trainable
  parameters and head of the best-validation step; ``config.json``, ``restores.json``;
* ``ray/train/``: Ray Train's run directory with the checkpoints (unless a ``run_config`` says otherwise),
  deleted when the run ends ``ok`` or ``diverged`` (``cleanup_checkpoints``), kept when it ``failed``.

Each worker builds the same model (seeded), freezes it by configuration, wraps it in DDP through
``ray.train.torch.prepare_model`` (gloo on CPU, NCCL on GPU) and reads its own contiguous slice of every
global batch from the prepared store (see the core module for why this order is exact). Metrics are
reported with ``ray.train.report`` at every log step and evaluation; every ``checkpoint_period`` steps the
workers report a checkpoint (worker 0: trainable parameters, optimizer, schedule, step, data position,
best-validation state, curves; every worker: its RNG states), from which ``FailureConfig(max_failures)``
restarts resume exactly. Re-running a run that failed (or whose driver died) with the same ``out_dir`` (or
the same ``RunConfig`` name and storage) resumes from the latest checkpoint of the previous attempt.

A non-finite loss ends the run with status ``diverged`` (recorded, not raised); a run whose workers fail
more often than ``max_failures`` is recorded with status ``failed`` and the error message.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from pathlib import Path

from raystudy.core.finetune import (
    Event,
    FinetuneConfig,
    Finetuner,
    TensorBoardLogger,
    save_safetensors,
    write_outputs,
)

log = logging.getLogger(__name__)


class InjectedFailure(RuntimeError):
    """Raised by the ``FinetuneConfig.fail_after_step`` testing hook."""


def _all_reduce_sum(t):
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _clean_metrics(metrics: dict) -> dict:
    """Ray metrics: plain floats/ints/strings, None dropped (val columns between evaluations)."""
    out = {}
    for k, v in metrics.items():
        if v is None:
            continue
        out[k] = float(v) if isinstance(v, float) else v
    return out


def train_loop_per_worker(config: dict) -> dict | None:
    """The Ray Train worker function: ``config = {"cfg": FinetuneConfig.to_dict()}``.

    Returns the run payload (summary, curves, restores) on worker 0, ``None`` on the others.
    """
    import ray.train
    import ray.train.collective
    import ray.train.torch
    import torch
    from ray.train import Checkpoint

    cfg = FinetuneConfig.from_dict(config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    ft = Finetuner(
        cfg, rank=rank, world_size=world, device=device,
        wrap=lambda m: ray.train.torch.prepare_model(m, move_to_device=device,
                                                     parallel_strategy="ddp" if world > 1 else None),
        all_reduce=_all_reduce_sum if world > 1 else None,
    )
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            info = ft.load(d)
        log.info("rank %d resumed at step %d from %s", rank, info["step"], checkpoint.path)
    tb = TensorBoardLogger(cfg.out_dir, purge_step=ft.step + 1 if ft.step else None) if rank == 0 else None

    def callback(ev: Event) -> None:
        if tb is not None:
            tb(ev)
        metrics = _clean_metrics(ev.metrics)
        metrics["step"], metrics["final"] = ev.step, ev.final
        if ev.checkpoint:
            with tempfile.TemporaryDirectory(prefix="raystudy-ckpt-") as d:
                ft.save(d)
                if ev.final and rank == 0:
                    write_outputs(d, ev.metrics, ft.curves, config=cfg.to_dict(), restores=ft.restores)
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            ray.train.report(metrics)
        if cfg.fail_after_step is not None and ev.step == cfg.fail_after_step and not ft.restores and not ev.final:
            # Every worker's report (and checkpoint) is queued before anyone dies, so the controller
            # registers this checkpoint before it sees the failure.
            ray.train.collective.barrier()
            raise InjectedFailure(f"injected failure after step {ev.step} (FinetuneConfig.fail_after_step)")

    try:
        summary = ft.run(callback, progress=False)
    finally:
        if tb is not None:
            tb.close()
    if rank != 0:
        return None
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if ft.best_state is not None:
        save_safetensors(ft.best_state, out / "best_trainable.safetensors")
    if cfg.save_final:
        save_safetensors(ft.model.state_dict(), out / "final_model.safetensors")
    return {"summary": summary, "curves": ft.curves, "restores": ft.restores}


def make_trainer(cfg: FinetuneConfig, run_config=None, callbacks: list | None = None):
    """The ``TorchTrainer`` of one run.

    Without ``run_config``: ``RunConfig(name="train", storage_path=<out_dir>/ray,
    failure_config=FailureConfig(max_failures=cfg.max_failures),
    checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints), callbacks=callbacks)``. A given
    ``run_config`` (e.g. ``RunConfig(callbacks=[TuneReportCallback()], storage_path=..., name=...)`` inside a
    Tune trial) is used as is, except that a failure or checkpoint config left at Ray's default takes the
    values above and ``callbacks`` are appended to its own.
    """
    import dataclasses

    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg.validate()
    failure = FailureConfig(max_failures=cfg.max_failures)
    keep = CheckpointConfig(num_to_keep=cfg.keep_checkpoints)
    if run_config is None:
        run_config = RunConfig(name="train", storage_path=str(Path(cfg.out_dir).absolute() / "ray"),
                               failure_config=failure, checkpoint_config=keep, callbacks=list(callbacks or []))
    else:
        changes = {}
        if run_config.failure_config == FailureConfig():
            changes["failure_config"] = failure
        if run_config.checkpoint_config == CheckpointConfig():
            changes["checkpoint_config"] = keep
        if callbacks:
            changes["callbacks"] = list(run_config.callbacks or []) + list(callbacks)
        if changes:
            run_config = dataclasses.replace(run_config, **changes)
    use_gpu = cfg.gpus_per_worker > 0
    resources = {"CPU": cfg.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = cfg.gpus_per_worker
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.to_dict()},
        scaling_config=ScalingConfig(num_workers=cfg.workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=run_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
    )


def _failed_summary(cfg: FinetuneConfig, error: BaseException) -> dict:
    nan = float("nan")
    try:
        from raystudy.core.finetune import build_finetune_model, select_and_freeze
        from raystudy.data.store import read_meta

        model = build_finetune_model(cfg, cfg.num_classes or int(read_meta(cfg.store)["num_classes"]))
        trainable = select_and_freeze(model, cfg.component, train_final_norm=cfg.train_final_norm,
                                      include_layerscale=cfg.include_layerscale).num_trainable
    except Exception:  # the failure may be the model itself
        trainable = -1
    return {
        "component": cfg.component, "optimizer": cfg.optimizer, "lr": float(cfg.lr), "seed": cfg.seed,
        "steps": cfg.steps, "batch_size": cfg.batch_size, "trainable_params": trainable, "status": "failed",
        "best_val_acc": nan, "best_val_step": -1, "test_acc": nan, "final_val_loss": nan, "final_val_acc": nan,
        "steps_completed": -1, "error": f"{type(error).__name__}: {error}"[:2000],
    }


def run_finetune(cfg: FinetuneConfig, *, run_config=None, callbacks: list | None = None) -> dict:
    """Run one finetuning run on Ray Train and return its summary (also written to ``cfg.out_dir``).

    Never raises for a run that diverges (status ``diverged``) or whose workers fail beyond
    ``cfg.max_failures`` (status ``failed``, with ``error``); invalid configurations raise ``ValueError``.
    ``wall_seconds`` is the driver's wall time of ``fit()``, Ray Train start-up included.
    """
    from ray.train import TrainingFailedError

    cfg.validate()
    t0 = time.perf_counter()
    trainer = make_trainer(cfg, run_config, callbacks)
    payload, error, result = None, None, None
    try:
        result = trainer.fit()
        payload = result.return_value
        if payload is None:
            error = RuntimeError("Ray Train returned no result from worker 0")
    except TrainingFailedError as e:
        error = e
        log.error("finetune run %s failed: %s", cfg.out_dir, e)
    wall = time.perf_counter() - t0
    if payload is not None:
        summary, curves, restores = dict(payload["summary"]), payload["curves"], payload["restores"]
    else:
        summary, curves, restores = _failed_summary(cfg, error), [], []
    summary["wall_seconds"] = wall
    summary["workers"] = cfg.workers
    write_outputs(cfg.out_dir, summary, curves, config=cfg.to_dict(), restores=restores)
    if cfg.cleanup_checkpoints and result is not None and summary["status"] in ("ok", "diverged"):
        _delete_run_dir(result)
    return summary


def _delete_run_dir(result) -> None:
    """Remove the finished run's Ray Train directory (its checkpoints) from local or remote storage."""
    try:
        result.filesystem.delete_dir(result.path)
    except (FileNotFoundError, OSError) as e:
        log.warning("could not delete the checkpoints of %s: %s", result.path, e)


def format_summary(summary: dict) -> str:
    """A short human-readable block of a run summary (used by ``raystudy finetune``)."""
    def fmt(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.6g}"
        return str(v)

    keys = ["component", "optimizer", "lr", "seed", "steps", "batch_size", "workers", "trainable_params", "status",
            "best_val_acc", "best_val_step", "test_acc", "final_val_loss", "images_per_s", "grad_memory_bytes",
            "optimizer_memory_bytes", "num_restores", "wall_seconds", "error"]
    width = max(len(k) for k in keys)
    return "\n".join(f"{k:<{width}}  {fmt(summary[k])}" for k in keys if k in summary)
