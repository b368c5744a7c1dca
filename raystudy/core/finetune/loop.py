"""The loop: :class:`Finetuner` (build, optionally :meth:`~Finetuner.load`, then :meth:`~Finetuner.run`).

What runs it (checkpoints, reports, TensorBoard, outputs) is :mod:`.driver`'s."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from raystudy.core.change import change_rows, cka_to_start, first_images, weight_change
from raystudy.core.components import get_adapter
from raystudy.core.expressions import Adapter, parse
from raystudy.core.finetune.config import FinetuneConfig, evaluates_at, make_optimizer, make_scheduler
from raystudy.core.finetune.data import (
    CacheBatch,
    MicroBatches,
    applied_val_split,
    open_split_data,
    resident_bytes_per_image,
    to_device,
    trains_on_val,
)
from raystudy.core.finetune.masks import count_entries, hold_frozen_entries
from raystudy.core.finetune.outputs import run_summary
from raystudy.core.finetune.selection import build_finetune_model, enable_fused_attention, select_for
from raystudy.core.finetune.state import (
    fingerprint,
    read_rng,
    read_state,
    resume_config,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from raystudy.core.finetune.step import (
    StepResult,
    accuracy_of,
    analytic_memory,
    correct_by_batch,
    evaluate,
    measured_memory,
    set_matmul_precision,
    train_step,
)
from raystudy.core.peft_methods import adapted_layers, merge
from raystudy.data.modality import modality_of_model
from raystudy.data.store import Store
from raystudy.settings import accuracy_batch
from raystudy.terminal import progress_bar

log = logging.getLogger(__name__)


@dataclass
class Event:
    """What the loop hands its callback after a logged, evaluated or checkpointed step (every worker)."""

    step: int
    metrics: dict  # the curve row of this step (lr_now, train_loss, grad norms, images_per_s, val_* or None)
    checkpoint: bool  # this step is a checkpoint step: the callback should persist :meth:`Finetuner.save`
    final: bool = False  # the end of the run: ``metrics`` is the run summary


def steady_throughput(step_ends: list[float], batch_size: int, skip: int | None = None) -> float:
    """Images/s over the steady state: ``(n - skip) B / (t_n - t_skip)`` from the end of step ``skip`` to the
    end of the last of ``n`` steps (``step_ends`` on a training clock). ``skip`` defaults to
    ``min(10, n // 5)`` steps of warm-up (allocator, thread pools, first data)."""
    n = len(step_ends)
    if n < 2:
        return float("nan")
    skip = min(10, n // 5) if skip is None else skip
    skip = max(1, min(skip, n - 1))
    dt = step_ends[-1] - step_ends[skip - 1]
    return (n - skip) * batch_size / dt if dt > 0 else float("nan")


class ThroughputMeter:
    """The training clock of one attempt, in wall and in CPU seconds of this process.

    The clock runs during steps and metric reports (part of a run's cost) and stops inside :meth:`paused`
    (evaluations and checkpoints, which do not scale with the number of steps). CPU time is insensitive to
    other processes sharing the cores.
    """

    def __init__(self, batch_size: int, seconds_before: float = 0.0):
        self.batch_size = batch_size
        self.seconds_before = seconds_before  # training seconds of earlier attempts (a resumed run)
        self._start = (time.perf_counter(), time.process_time())
        self._paused = [0.0, 0.0]
        self.wall_ends: list[float] = []  # training clock at the end of each step of this attempt
        self.cpu_ends: list[float] = []
        self._window = (0.0, 0)  # clock and steps at the start of the current reporting window

    def step_done(self) -> None:
        self.wall_ends.append(time.perf_counter() - self._start[0] - self._paused[0])
        self.cpu_ends.append(time.process_time() - self._start[1] - self._paused[1])

    @property
    def train_seconds(self) -> float:
        return self.seconds_before + (self.wall_ends[-1] if self.wall_ends else 0.0)

    def window_images_per_s(self) -> float:
        """Images/s from the previous call (or the start) to the last step, then a new window starts."""
        (start, steps_before), now, steps = self._window, self.wall_ends[-1], len(self.wall_ends)
        self._window = (now, steps)
        return (steps - steps_before) * self.batch_size / (now - start) if now > start else float("nan")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self._paused[0] += time.perf_counter() - wall
            self._paused[1] += time.process_time() - cpu

    def images_per_s(self) -> float:
        """Steady-state images/s of this attempt (:func:`steady_throughput`)."""
        return steady_throughput(self.wall_ends, self.batch_size)

    def cpu_ms_per_image(self) -> float:
        """CPU milliseconds per image over the same steady-state window."""
        ips = steady_throughput(self.cpu_ends, self.batch_size)
        return 1000.0 / ips if ips > 0 else float("nan")


def curve_row(step: int, res: StepResult, images_per_s: float) -> dict:
    """One row of the run's curves (val columns filled in at evaluation steps)."""
    return {"step": step, "lr_now": res.lr, "train_loss": res.loss, "grad_norm": res.grad_norm,
            "component_grad_norm": res.component_grad_norm, "images_per_s": images_per_s,
            "val_loss": None, "val_acc": None}


class Finetuner:
    """A finetuning run: build with a config, optionally :meth:`load` a checkpoint, then :meth:`run`.

    Single-process use needs nothing else. A distributed worker passes its ``rank`` of ``world_size``, the
    ``device``, ``wrap`` (e.g. DDP) and ``all_reduce`` (in-place-free sum over workers of a tensor); each
    worker then processes ``share = batch_size / world_size`` images per step.

    On CUDA the run uses ``cfg``'s precision (default bf16 autocast; TF32 for what stays float32), fused
    optimizer kernels, channels-last inputs and weights (the patch embedding convolution) and, with
    ``cfg.compile``, ``torch.compile``; timm attention runs through SDPA (``cfg.attention``: fused) or by
    explicit matmuls (explicit). Frozen parameters have
    ``requires_grad=False`` and never get a gradient buffer.
    """

    def __init__(self, cfg: FinetuneConfig, *, rank: int = 0, world_size: int = 1,
                 device: torch.device | str | None = None, wrap: Callable[[nn.Module], nn.Module] | None = None,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.cfg = cfg.validate()
        if cfg.batch_size % world_size:
            raise ValueError(f"FinetuneConfig.batch_size={cfg.batch_size}: the global batch must split evenly "
                             f"over the {world_size} workers")
        self.rank, self.world_size, self.share = rank, world_size, cfg.batch_size // world_size
        self.device = torch.device(device or "cpu")
        self.all_reduce = all_reduce
        self.store = Store.open(cfg.store)  # dataset.json read once for the whole run
        self.meta = self.store.meta
        self.num_classes = cfg.num_classes or int(self.meta["num_classes"])
        self.precision = cfg.resolved_precision(self.device)
        self.channels_last = self.device.type == "cuda"
        self._build_model(wrap)
        self.optimizer = make_optimizer(self.trainable, cfg)  # fused kernels on CUDA
        if self.trained.masks:  # a :weights budget: gradients masked, frozen entries restored after each step
            hold_frozen_entries(self.optimizer, dict(self.trained.trainable), self.trained.masks)
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.train_data = open_split_data(cfg, "train", self.store)
        if cfg.drop_last and len(self.train_data) < cfg.loader_batch:
            unit = "loader_batch_size" if cfg.loader_batch_size else "batch_size"
            raise ValueError(f"{cfg.store}: drop_last: its {len(self.train_data)} train rows hold no whole batch of "
                             f"{unit}={cfg.loader_batch}")
        self._eval_data: dict[str, object] = {}  # split -> its data (open_split_data)
        self._eval_cache: dict[str, list] = {}
        # the run's progress and results (all of it is checkpointed, see state_dict)
        self.step, self.status, self.diverged_step = 0, "ok", None
        self.best_val_acc, self.best_val_step = -1.0, None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.last_val: tuple[float, float] | None = None  # (loss, acc) of the latest evaluation
        self.curves: list[dict] = []
        self.memory: dict[str, int] = {}
        self.restores: list[dict] = []
        self.skipped_checkpoints: list[str] = []  # the unusable checkpoints a resume moved aside, and why
        self.train_seconds = 0.0
        self.images_per_s = self.cpu_ms_per_image = self.test_acc = float("nan")
        # what finetuning changed (:meth:`measure_changes`, rank 0): the trainable parameters as built, before
        # step 1 and before any :meth:`load`, so a resumed run compares with its own start (the pretrained values)
        self.start_state = self.trainable_state() if rank == 0 else None
        self.changes: list[dict] = []

    def _build_model(self, wrap: Callable[[nn.Module], nn.Module] | None) -> None:
        """The model on the device with its selection frozen, :attr:`net` (wrapped, compiled) for training."""
        set_matmul_precision(self.device, self.precision)
        self.model = build_finetune_model(self.cfg, self.num_classes)
        get_adapter(self.model)  # fails early, listing the supported families
        enable_fused_attention(self.model, self.cfg.attention == "fused")
        self.trained = select_for(self.model, self.cfg)
        self.model.to(self.device)
        if self.channels_last:
            self.model.to(memory_format=torch.channels_last)  # only 4-d weights change: the patch embedding
        self.net = wrap(self.model) if wrap is not None else self.model  # forward/backward go through this
        if self.cfg.compile:
            self.net = torch.compile(self.net)
        self.trainable = [p for _, p in self.trained.trainable]
        self.group = [p for _, p in self.trained.group]

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self, callback: Callable[[Event], None] | None = None, *, progress: bool | None = None) -> dict:
        """Train from the current step to ``cfg.steps`` (or divergence), then test the best-validation state.

        Calls ``callback(Event)`` on every worker after each logged, evaluated or checkpointed step and
        once at the end (``final=True``). Returns the run summary (:meth:`summary`).
        """
        cfg = self.cfg
        meter = ThroughputMeter(cfg.batch_size, seconds_before=self.train_seconds)
        bar = self._progress_bar(progress)
        for micro in self._train_batches():
            res = train_step(self.net, self.optimizer, self.scheduler, micro, share=self.share,
                             trainable=self.trainable, group=self.group, clip_norm=cfg.clip_norm,
                             all_reduce=self.all_reduce, world_size=self.world_size, precision=self.precision)
            self.step += 1
            meter.step_done()
            bar.update(1)
            self.train_seconds = meter.train_seconds
            if res.finite and not self.memory:
                self._measure_memory()
            if not res.finite:
                self._mark_diverged()
            s = self.step
            log_step = s % cfg.log_period == 0 or s == cfg.steps or not res.finite
            eval_step = res.finite and (evaluates_at(s, cfg.steps, cfg.eval_period, cfg.eval_steps)
                                        or (s == cfg.steps and trains_on_val(cfg)))  # its tested step
            ckpt_step = res.finite and cfg.ckpt_period > 0 and s % cfg.ckpt_period == 0 and s < cfg.steps
            if not (log_step or eval_step or ckpt_step):
                continue
            row = curve_row(s, res, meter.window_images_per_s())
            if eval_step:
                with meter.paused():
                    self._eval_and_track(row)
            self.curves.append(row)
            if callback is not None:
                with meter.paused() if ckpt_step else contextlib.nullcontext():
                    callback(Event(step=s, metrics=dict(row), checkpoint=ckpt_step))
            if not res.finite:
                break
        bar.close()
        self.images_per_s, self.cpu_ms_per_image = meter.images_per_s(), meter.cpu_ms_per_image()
        self.test_acc = self._test_best()
        self.changes = self.measure_changes() if self.rank == 0 else []
        summary = self.summary()
        if callback is not None:
            callback(Event(step=self.step, metrics=dict(summary), checkpoint=True, final=True))
        return summary

    def _progress_bar(self, progress: bool | None):
        disable = (True if self.rank != 0 else None) if progress is None else not progress
        return progress_bar(total=self.cfg.steps, initial=self.step, desc=f"finetune {self.cfg.configuration}",
                    unit="step", disable=disable, leave=False)

    def _mark_diverged(self) -> None:
        self.status, self.diverged_step = "diverged", self.step
        log.warning("%s lr=%g: non-finite loss/gradient at step %d; run marked diverged",
                    self.cfg.configuration, self.cfg.lr, self.step)

    def _eval_and_track(self, row: dict) -> None:
        if trains_on_val(self.cfg):  # no val split: the last step is the one tested, no val accuracy
            if row["step"] == self.cfg.steps:
                self.best_val_acc, self.best_val_step = float("nan"), row["step"]
                self.best_state = self.trainable_state()
            return
        val_loss, val_acc = self.evaluate("val")
        row["val_loss"], row["val_acc"] = val_loss, val_acc
        self.last_val = (val_loss, val_acc)
        if val_acc > self.best_val_acc:
            self.best_val_acc, self.best_val_step = val_acc, row["step"]
            self.best_state = self.trainable_state()

    def _measure_memory(self) -> None:
        measured = measured_memory(self.trainable, self.optimizer)
        analytic = analytic_memory(sum(p.numel() for p in self.trainable), self.cfg.optimizer,  # whole tensors
                                   self.trainable[0].element_size())
        self.memory = {"grad_memory_bytes": measured["grad_bytes"],
                       "optimizer_memory_bytes": measured["optimizer_bytes"],
                       "grad_memory_bytes_analytic": analytic["grad_bytes"],
                       "optimizer_memory_bytes_analytic": analytic["optimizer_bytes"]}

    def _test_best(self) -> float:
        """Test accuracy of the best-validation state (NaN when no evaluation happened; for a run that diverged
        before it, with ``cfg.diverged_test`` ``class_0``, :meth:`class_0_accuracy`), of the merged model for an
        adapter (:func:`raystudy.core.peft_methods.merge`); the final trainable state is put back afterwards."""
        if self.best_state is None:
            if self.status == "diverged" and self.cfg.diverged_test == "class_0":
                return self.class_0_accuracy("test")
            return float("nan")
        with self.trainable_set_to(self.best_state):
            _, acc = self.evaluate("test", self.merged_model() if self.adapted else None)
        return acc

    def class_0_accuracy(self, split: str) -> float:
        """Accuracy on ``split`` of predicting class 0 for every row, as ``cfg.accuracy`` averages it (over the
        split's batches for ``per_batch``): what the paper authors report for a run whose weights went NaN
        (``argmax`` of all-NaN logits is index 0), :data:`raystudy.vocab.DIVERGED_TESTS`."""
        if split not in self._eval_data:
            self._eval_data[split] = open_split_data(self.cfg, split, self.store)
        labels = np.asarray(self._eval_data[split].labels)
        rows, size = len(labels), accuracy_batch(self.cfg, split)
        return accuracy_of(correct_by_batch(labels == 0, 0, rows, size), rows, size, self.cfg.accuracy)

    def measure_changes(self) -> list[dict]:
        """What finetuning changed (:func:`raystudy.core.change.change_rows`): the weight change of every
        (component, block) of the final merged model (:meth:`merged_model`) against its start
        (:attr:`start_state`; a frozen component gives exactly 0) and, with :meth:`change_images`, each
        block's linear CKA between the model at its start values and as it ended (the final state, not the
        best-validation one: what the run's training did)."""
        final = self.merged_model()
        weights = weight_change(final, self._start_of(final), final.state_dict())
        images = self.change_images()
        cka = None if images is None else cka_to_start(self.model, images.to(self.device), self.start_state)
        return change_rows(weights, cka)

    def _start_of(self, final: nn.Module) -> dict[str, torch.Tensor]:
        """The start values of ``final``'s parameters by name: the model's own (trainable ones from
        :attr:`start_state`, frozen ones as they are), or a merged copy made at the start values."""
        if final is self.model:
            return {**dict(final.named_parameters()), **self.start_state}
        with self.trainable_set_to(self.start_state):
            return self.merged_model().state_dict()

    def change_images(self) -> torch.Tensor | None:
        """The CKA's images (:func:`raystudy.core.change.first_images`): the first ``cfg.change_images`` rows
        of ``cfg.change_split`` of ``cfg.change_store``, eval transform; None without a store, with 0 images or
        for a text model (:meth:`~raystudy.data.modality.Modality.change_images`)."""
        cfg = self.cfg
        n = modality_of_model(cfg.model).change_images(cfg.change_images)
        if not cfg.change_store or n == 0:
            return None
        return first_images(cfg.change_store, cfg.change_split, n, cfg.img_size)

    @property
    def adapted(self) -> bool:
        """Whether the configuration is a PEFT method (``lora:r=8``, ``ia3``, ...: the model holds adapters)."""
        return isinstance(parse(self.cfg.configuration), Adapter)

    def merged_model(self) -> nn.Module:
        """The model as a plain timm model: a copy with the adapters merged, or the model itself."""
        return merge(self.model) if self.adapted else self.model

    def exported_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A trainable ``state`` under the names of a plain timm model. Without adapters it is ``state``; with
        them, each adapted layer's tensors (``lora_A`` / ``lora_B``, ``ia3_l``, ...) become its merged
        ``<layer>.weight`` (and ``<layer>.bias`` where merging changed it: IA3 scales an attention layer's),
        next to the head (and final norm): loaded over the pretrained model (``strict=False``) it gives the
        trained model."""
        if not self.adapted:
            return state
        layers = adapted_layers(state)
        with self.trainable_set_to(state):
            merged = self.merged_model().state_dict()
        base = dict(self.model.named_parameters())
        own = [f"{layer}.weight" for layer in layers] + [
            f"{layer}.bias" for layer in layers if f"{layer}.bias" in merged
            and not torch.equal(merged[f"{layer}.bias"], base[f"{layer}.base_layer.bias"])]
        plain = {n: t for n, t in state.items() if not n.startswith(tuple(f"{layer}." for layer in layers))}
        return {**plain, **{n: merged[n].detach().cpu() for n in sorted(own)}}

    def summary(self) -> dict:
        """The run's result (:func:`raystudy.core.finetune.outputs.run_summary`)."""
        nan = float("nan")
        evaluated = self.best_val_step is not None
        return run_summary(
            self.cfg, trainable_params=self.trained.num_trainable, status=self.status,
            best_val_acc=self.best_val_acc if evaluated else nan, best_val_step=self.best_val_step,
            test_acc=self.test_acc, final_val_loss=self.last_val[0] if self.last_val else nan,
            final_val_acc=self.last_val[1] if self.last_val else nan, wall_seconds=self.train_seconds,
            train_seconds=self.train_seconds, steps_completed=self.step, diverged_step=self.diverged_step,
            final_train_loss=self.curves[-1]["train_loss"] if self.curves else nan,
            images_per_s=self.images_per_s, cpu_ms_per_image=self.cpu_ms_per_image, workers=self.world_size,
            num_classes=self.num_classes, num_restores=len(self.restores),
            restored_from_step=self.restores[-1]["step"] if self.restores else None, precision=self.precision,
            compile=self.cfg.compile, units=self.trained.chosen, checkpoints_skipped=len(self.skipped_checkpoints),
            checkpoint_warnings=list(self.skipped_checkpoints), **self.memory,
            selection_entries=count_entries(self.trained.masks) if self.trained.masks else None,
            test_examples=len(self._eval_data["test"]) if "test" in self._eval_data else None,
        )

    # ---- data ---------------------------------------------------------------------------------------

    def _train_batches(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """This worker's micro-batches of every remaining step, one list per step."""
        if self.step >= self.cfg.steps or self.status != "ok":
            return
        ds = MicroBatches(self.train_data, self.cfg, self.rank, self.step, self.world_size)
        if self.cfg.loader_workers > 0:
            it = iter(torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False,
                                                  num_workers=self.cfg.loader_workers,
                                                  pin_memory=self.device.type == "cuda"))
        else:
            it = (ds[k] for k in range(len(ds)))
        put = self._to_device
        for _ in range(self.cfg.steps - self.step):
            yield [put(next(it)) for _ in ds.bounds]

    def _to_device(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return to_device(batch, self.device, size=self.cfg.img_size, channels_last=self.channels_last)

    def _eval_batches(self, split: str):
        """This worker's contiguous share of ``split`` in batches of ``eval_batch_size`` on the device.

        A share that fits in ``cfg.eval_cache_mb`` stays resident after its first pass, so that later
        evaluations only run the model: the decode path keeps its decoded float32 tensors (host memory), the
        cache path its uint8 rows on the device (4x smaller; made float there at every pass, as when read)."""
        if split in self._eval_cache:
            yield from (self._to_device(b) for b in self._eval_cache[split])
            return
        if split not in self._eval_data:
            self._eval_data[split] = open_split_data(self.cfg, split, self.store)
        data = self._eval_data[split]
        rows = self._eval_rows(len(data))
        per_image = resident_bytes_per_image(data, self.cfg.img_size)
        keep = per_image is not None and len(rows) * per_image <= self.cfg.eval_cache_mb * 2 ** 20
        out = []
        for i in range(0, len(rows), self.cfg.eval_batch_size):
            b = data.batch(rows[i:i + self.cfg.eval_batch_size], size=self.cfg.img_size, train=False)
            if isinstance(b, CacheBatch) and keep:  # no crops: its uint8 rows and labels stay on the device
                b = b._replace(images=b.images.to(self.device), labels=b.labels.to(self.device))
            if keep:
                out.append(b)
            yield self._to_device(b)
        if keep:
            self._eval_cache[split] = out

    def _eval_rows(self, rows: int) -> np.ndarray:
        """This worker's contiguous share of an evaluation split of ``rows`` rows."""
        return np.array_split(np.arange(rows), self.world_size)[self.rank]

    def evaluate(self, split: str, model: nn.Module | None = None) -> tuple[float, float]:
        """Mean loss and accuracy (``cfg.accuracy``: per sample, or the mean over the split's consecutive
        batches of ``cfg.eval_batch_size`` rows, on val ``cfg.val_batch_size`` when set, whichever worker holds
        them, of each batch's accuracy and each batch's mean loss; :func:`accuracy_of`) of ``model`` (default:
        the run's) on ``split`` over all workers (each evaluates its slice; sums all-reduced)."""
        loss_sum, hits, losses = evaluate(model if model is not None else self.model, self._eval_batches(split),
                                          device=self.device, precision=self.precision)
        rows, size = len(self._eval_data[split]), accuracy_batch(self.cfg, split)  # forward passes unchanged
        share = self._eval_rows(rows)
        first = int(share[0]) if len(share) else 0
        correct, batch_losses = correct_by_batch(hits, first, rows, size), correct_by_batch(losses, first, rows, size)
        if self.all_reduce is not None and self.world_size > 1:
            t = self.all_reduce(torch.tensor([loss_sum, *correct, *batch_losses], dtype=torch.float64,
                                             device=self.device)).cpu().numpy()
            loss_sum, correct, batch_losses = float(t[0]), t[1:1 + len(correct)], t[1 + len(correct):]
        per_batch = self.cfg.accuracy == "per_batch"  # the authors' eval_loss: the mean of per-batch means
        loss = accuracy_of(batch_losses, rows, size, "per_batch") if per_batch else loss_sum / rows
        return loss, accuracy_of(correct, rows, size, self.cfg.accuracy)

    # ---- state ------------------------------------------------------------------------------------

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable parameters (selection + head [+ final norm]) by name, detached CPU copies."""
        return {n: p.detach().cpu().clone() for n, p in self.trained.trainable}

    @contextlib.contextmanager
    def trainable_set_to(self, state: dict[str, torch.Tensor]) -> Iterator[None]:
        """The trainable parameters hold ``state`` inside the block and their current values again after."""
        current = self.trainable_state()
        self._set_trainable(state)
        try:
            yield
        finally:
            self._set_trainable(current)

    def _set_trainable(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.trained.trainable)
        with torch.no_grad():
            for n, t in state.items():
                params[n].copy_(t)

    def _data_position(self) -> dict:
        n, b, size = len(self.train_data), self.cfg.batch_size, self.cfg.loader_batch
        seen = self.step * b
        epoch, position = divmod(self.step * (b // size), n // size) if self.cfg.drop_last else divmod(seen, n)
        if self.cfg.drop_last:
            position *= size
        return {"step": self.step, "samples_seen": seen, "epoch": epoch, "position_in_epoch": position,
                "train_rows": n, "seed": self.cfg.seed, "batch_size": self.cfg.batch_size,
                "shuffle": self.cfg.shuffle, "drop_last": self.cfg.drop_last, "augment": self.cfg.augment,
                "data_path": self.cfg.data_path,
                "val_split": applied_val_split(self.cfg.val_split, self.store),
                "checksum": self.meta.get("checksum")}

    def state_dict(self) -> dict:
        """Everything needed to resume exactly, except RNG states (per worker, :meth:`save`)."""
        return {
            "step": self.step, "status": self.status, "diverged_step": self.diverged_step,
            "trainable": self.trainable_state(),
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "data": self._data_position(),
            "best": {"val_acc": self.best_val_acc, "step": self.best_val_step, "state": self.best_state,
                     "last_val": list(self.last_val) if self.last_val else None},
            "curves": self.curves, "memory": self.memory, "restores": self.restores,
            "train_seconds": self.train_seconds,
            "config": resume_config(self.cfg),
        }

    def load_state_dict(self, state: dict) -> None:
        if set(state["trainable"]) != set(self.trained.names):
            raise ValueError("checkpoint: trainable parameters differ from the configuration's")
        self._set_trainable(state["trainable"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.status, self.diverged_step = int(state["step"]), state["status"], state["diverged_step"]
        best = state["best"]
        self.best_val_acc, self.best_val_step, self.best_state = best["val_acc"], best["step"], best["state"]
        self.last_val = tuple(best["last_val"]) if best["last_val"] else None
        self.curves = list(state["curves"])
        self.memory = dict(state["memory"])
        self.restores = list(state["restores"])
        self.train_seconds = float(state["train_seconds"])

    def save(self, directory: str | os.PathLike) -> None:
        """Write this worker's part of a checkpoint: rank 0 the run state, every rank its RNG states."""
        write_checkpoint(directory, self.state_dict() if self.rank == 0 else None, rank=self.rank,
                         device=self.device)

    def load(self, directory: str | os.PathLike) -> dict:
        """Restore a checkpoint written by :meth:`save`; returns fingerprints of the live restored state
        (also appended to :attr:`restores`)."""
        state = read_state(directory, self.cfg, train_rows=len(self.train_data), checksum=self.meta.get("checksum"))
        rng = read_rng(directory, rank=self.rank)  # both files read before either is applied
        self.load_state_dict(state)
        if rng is not None:
            set_rng_state(rng, self.device)
        info = {
            "step": self.step,
            "optimizer": fingerprint(self.optimizer.state_dict()),
            "scheduler": fingerprint(self.scheduler.state_dict()),
            "scheduler_last_epoch": int(self.scheduler.last_epoch),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "rng": fingerprint(rng_state(self.device)),
            "trainable": fingerprint(self.trainable_state()),
        }
        self.restores.append(info)
        return info
