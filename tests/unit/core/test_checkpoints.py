"""Unusable checkpoints (another run's, a truncated one) are moved aside, kept and reported; the run goes on from
what it can use."""

from __future__ import annotations

from tests.support.models import STUDY_MODEL, STUDY_TINY


def test_unusable_checkpoints_are_moved_aside_and_reported(tmp_path):
    """Another run's checkpoints in a run's folder, then a truncated one: each is moved aside (kept), the run
    goes on from what it can use, and its summary and the study's line for the trial say so."""
    import dataclasses

    from raystudy.core.finetune import FinetuneConfig, train_local
    from raystudy.study.progress import Progress
    from raystudy.study.results import trial_row
    from tests.support.stores import make_store

    store = make_store(tmp_path / "store", n_per_split=(16, 8, 8))
    ck = tmp_path / "ck"
    a = FinetuneConfig(model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32, store=store, configuration="MHA",
                       steps=6, batch_size=8, eval_period=2, checkpoint_period=2, lr=0.1, out_dir=str(tmp_path / "a"))
    train_local(a, checkpoint_dir=ck, tensorboard=False)  # leaves checkpoint_00000002 and _00000004 (not the last)
    b = dataclasses.replace(a, lr=0.05, out_dir=str(tmp_path / "b"))
    summary, _ = train_local(b, checkpoint_dir=ck, resume=True, tensorboard=False)
    fresh, _ = train_local(dataclasses.replace(b, out_dir=str(tmp_path / "fresh")), tensorboard=False)
    assert summary["status"] == "ok" and summary["num_restores"] == 0 and summary["checkpoints_skipped"] == 2
    assert summary["test_acc"] == fresh["test_acc"] and summary["final_val_loss"] == fresh["final_val_loss"]
    assert all("belongs to another run" in w and ".foreign-1" in w for w in summary["checkpoint_warnings"])
    for step in (2, 4):
        assert (ck / f"checkpoint_{step:08d}.foreign-1" / "state.pt").is_file()  # kept, never read again
    # b's own checkpoints are there now: the newest truncated, the run resumes from the one before
    state = ck / "checkpoint_00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    again, _ = train_local(dataclasses.replace(b, out_dir=str(tmp_path / "again")), checkpoint_dir=ck, resume=True,
                           tensorboard=False)
    assert again["restored_from_step"] == 2 and again["checkpoints_skipped"] == 1
    assert (ck / "checkpoint_00000004.corrupt-1").is_dir() and ".corrupt-1" in again["checkpoint_warnings"][0]
    lines = []
    progress = Progress(total=1, done_before=0, prefix="s", echo=lines.append)
    row = trial_row({"trial_id": "t1", "dataset": "d", "configuration": "All", "optimizer": "sgd", "lr": 0.1,
                     "seed": 0}, "m", {**again, "wall_seconds": 1.0})
    progress.trial_finished("t1", row)
    # the terminal names the checkpoint moved aside and where it went, then where the others are listed
    assert (f"(1 unusable checkpoint(s) moved aside, the first: {again['checkpoint_warnings'][0]}; "
            "checkpoint_warnings in trials/t1/summary.json)") in lines[0]
    assert "checkpoint_00000004" in lines[0] and ".corrupt-1" in lines[0]

