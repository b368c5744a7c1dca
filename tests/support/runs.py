"""Finetuning runs as the tests stop and compare them: a run killed at its first checkpoint, a study's trials
against single-process runs, TensorBoard's events against the curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


class Killed(Exception):
    """Raised by :func:`kill_at_first_checkpoint`'s callback: the run stops there like a killed process."""


def kill_at_first_checkpoint(ft, ckdir) -> None:
    """Run the ``Finetuner`` ``ft`` until its first checkpoint, save it as ``ckdir/checkpoint_XXXXXXXX`` (the one
    layout, which ``train_local(checkpoint_dir=ckdir, resume=True)`` resumes from) and stop there."""
    from raystudy.core.finetune.checkpoint import save_checkpoint

    def kill(ev):
        if ev.checkpoint:
            save_checkpoint(ft, str(ckdir), keep=None)
            raise Killed

    with pytest.raises(Killed):
        ft.run(kill, progress=False)


def assert_trials_equal_single_process_runs(out: str, trial_ids, scratch: Path) -> None:
    """Every trial of the study ``out`` (local or a URI) ends as an uninterrupted single-process run of its own
    ``config.json`` (into ``scratch``) does: the same steps once each, train losses within 1e-6, and the same
    test and best val accuracies."""
    import dataclasses

    import pandas as pd
    import torch

    from raystudy.core.finetune import train_local
    from raystudy.distributed.train import split_legacy
    from raystudy.io import read_result
    from raystudy.storage import join, read_text

    trials = read_result(out, "trials").set_index("trial_id")
    curves = read_result(out, "curves")
    for tid in trial_ids:
        cfg, _ = split_legacy(json.loads(read_text(join(out, "trials", tid, "config.json"))))
        cfg = dataclasses.replace(cfg, out_dir=str(Path(scratch) / tid))
        ref, _ = train_local(cfg, tensorboard=False)
        ref_curves = pd.read_parquet(Path(scratch) / tid / "curves.parquet")
        got = curves[curves.trial_id == tid].sort_values("step")
        assert got.step.tolist() == ref_curves.step.tolist()  # every step once: none lost or repeated
        torch.testing.assert_close(torch.tensor(got.train_loss.values), torch.tensor(ref_curves.train_loss.values),
                                   rtol=1e-6, atol=0)
        assert trials.loc[tid, "test_acc"] == ref["test_acc"], tid
        assert trials.loc[tid, "best_val_acc"] == ref["best_val_acc"], tid


def assert_tensorboard_equals_curves(out: str, trial_ids) -> None:
    """Each trial's TensorBoard events in the study ``out`` (local or a URI), in its folder and under ``tb/``,
    as TensorBoard shows them: every step of ``curves.parquet`` once, with its train loss."""
    import tempfile

    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raystudy.io import read_result
    from raystudy.storage import download_dir, join

    curves = read_result(out, "curves")
    for tid in trial_ids:
        want = curves[curves.trial_id == tid].sort_values("step")
        for folder in (join(out, "trials", tid, "tb"), join(out, "tb", tid)):
            with tempfile.TemporaryDirectory() as tmp:
                download_dir(folder, tmp)
                events = EventAccumulator(tmp).Reload().Scalars("train/train_loss")
            assert [e.step for e in events] == want.step.tolist(), folder
            torch.testing.assert_close(torch.tensor([e.value for e in events]),
                                       torch.tensor(want.train_loss.values, dtype=torch.float32), msg=folder)
