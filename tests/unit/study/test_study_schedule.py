"""What Tune creates and starts next costs the same at the 5,000th trial as at the 200th
(:mod:`raystudy.study.schedule`): the grid's searcher behind Tune's own trial creation, and the FIFO choice of
the next trial among finished ones. In-process, no Ray started."""

from __future__ import annotations

import tempfile
import time
from types import SimpleNamespace

from ray.tune.experiment import Experiment, Trial
from ray.tune.schedulers import FIFOScheduler
from ray.tune.search import SearchGenerator

from raystudy.study.points import STUDY_TRIAL_ID, grid_point
from raystudy.study.schedule import FirstPending, GridPoints


def _points(n: int) -> list[dict]:
    return [grid_point("d", "All", "sgd", round(1e-4 * (k + 1), 6), 0) for k in range(n)]


def _noop(config):
    pass


def _creation_cost(n: int) -> tuple[float, list]:
    """CPU seconds per trial of creating all ``n`` trials of a grid through Tune's ``SearchGenerator`` over
    :class:`GridPoints` (the empty param space the study launches with), and the trials' configs."""
    generator = SearchGenerator(GridPoints(_points(n)))
    with tempfile.TemporaryDirectory() as tmp:
        generator.add_configurations([Experiment("grid", _noop, config={}, num_samples=n, storage_path=tmp)])
        t0 = time.process_time()
        trials = [generator.next_trial() for _ in range(n)]
        seconds = (time.process_time() - t0) / n
        assert generator.next_trial() is None and generator.is_finished()
    return seconds, [t.config for t in trials]


def test_a_grid_trial_is_created_at_the_same_cost_at_5000_points_as_at_200():
    """Tune's ``grid_search`` deep-copies the list of every point for each trial it creates (about 23 ms a
    trial at 5,000 points); through :class:`GridPoints` a trial costs the same at any grid size."""
    at_200, configs = _creation_cost(200)
    at_5000, big = _creation_cost(5000)
    print(f"trial creation: {1000 * at_200:.3f} ms a trial at 200 points, {1000 * at_5000:.3f} ms at 5,000")
    assert at_5000 <= 2 * at_200 and at_5000 <= 0.05
    points = _points(5000)
    assert [c["point"] for c in big] == points  # the grid's order, every point once
    assert all(c[STUDY_TRIAL_ID] == p["trial_id"] for c, p in zip(big, points))
    assert [c["point"] for c in configs] == _points(200)


def _controller(statuses: list[str]):
    trials = [SimpleNamespace(status=s, name=f"t{i}") for i, s in enumerate(statuses)]
    return SimpleNamespace(get_trials=lambda: trials), trials


def test_first_pending_chooses_what_fifo_chooses():
    statuses = [Trial.TERMINATED, Trial.ERROR, Trial.RUNNING, Trial.PAUSED, Trial.TERMINATED, Trial.PENDING]
    ours, fifo = FirstPending(), FIFOScheduler()
    controller, trials = _controller(statuses)
    for change in [(5, Trial.RUNNING), (3, Trial.TERMINATED), (2, Trial.TERMINATED), (5, Trial.PENDING),
                   (5, Trial.TERMINATED)]:
        assert ours.choose_trial_to_run(controller) is fifo.choose_trial_to_run(controller)
        trials[change[0]].status = change[1]
    assert ours.choose_trial_to_run(controller) is None and ours.start == len(trials)
    trials.append(SimpleNamespace(status=Trial.PENDING, name="new"))  # a trial added later
    assert ours.choose_trial_to_run(controller) is trials[-1]
    live = SimpleNamespace(status=Trial.RUNNING, name="live")  # a requeued trial moves to the end, PENDING
    trials.append(live)
    trials[-2].status = Trial.TERMINATED
    trials.remove(live)
    trials.append(live)
    live.status = Trial.PENDING
    assert ours.choose_trial_to_run(controller) is live is fifo.choose_trial_to_run(controller)


def test_first_pending_costs_the_same_after_5000_finished_trials_as_after_200():
    def cost(done: int) -> float:
        controller, trials = _controller([Trial.TERMINATED] * done + [Trial.RUNNING] * 2 + [Trial.PENDING])
        scheduler = FirstPending()
        scheduler.choose_trial_to_run(controller)  # the first call walks past the finished trials once
        t0 = time.process_time()
        for _ in range(2000):
            assert scheduler.choose_trial_to_run(controller) is trials[-1]
        return (time.process_time() - t0) / 2000

    at_200, at_5000 = cost(200), cost(5000)
    print(f"choice of the next trial: {1e6 * at_200:.1f} us after 200 trials, {1e6 * at_5000:.1f} us after 5,000")
    assert at_5000 <= 2 * at_200 + 2e-6
