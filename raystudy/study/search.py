"""Optuna over the learning rate through Ray Tune, one search per (dataset, configuration, optimizer, seed).

:class:`GroupedOptunaSearch` is the Tune searcher of a study with ``search: optuna``; :func:`optuna_plan`
says how many runs each cell still needs (``samples`` minus its final rows) and what the cell already
measured (a resumed study hands that history to the cell's searcher).
"""

from __future__ import annotations

from optuna.distributions import FloatDistribution
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from raystudy.study.points import grid_point, tune_config
from raystudy.study.results import ResultTables
from raystudy.study.spec import StudySpec
from raystudy.vocab import FINAL_STATUSES

Cell = tuple  # (dataset, configuration, optimizer, seed)


def optuna_plan(spec: StudySpec, tables: ResultTables) -> tuple[dict[Cell, int], dict[Cell, list]]:
    """Remaining runs per cell (``samples`` minus the cell's final rows) and each cell's past (lr, objective)."""
    budget, history = {}, {}
    rows = list(tables.rows.values())
    for g in spec.groups():
        cell = (g["dataset"], g["configuration"], g["optimizer"], g["seed"])
        past = [
            (float(r["lr"]), float(r["best_val_acc"]) if r["status"] == "ok" else 0.0)
            for r in rows
            if r["status"] in FINAL_STATUSES
            and (r["dataset"], r["configuration"], r["optimizer"], int(r["seed"])) == cell
        ]
        history[cell] = past
        budget[cell] = max(spec.samples - len(past), 0)
    return budget, history


class GroupedOptunaSearch(Searcher):
    """One :class:`OptunaSearch` (TPE over ``lr``, log scale) per study cell, ``budget[cell]`` runs each.

    Cells are served round-robin so they progress side by side; earlier results of a cell (a resumed
    study) are given to its searcher as evaluated points. The objective is ``best_val_acc`` (0 for a
    diverged run). No metric is declared to Tune: intermediate Ray Train reports do not carry it.
    """

    def __init__(self, spec: StudySpec, budget: dict[Cell, int], history: dict[Cell, list], seed: int = 0):
        super().__init__(metric=None, mode=None)
        self.spec = spec
        self.cells = [c for c in budget if budget[c] > 0]
        self.left = dict(budget)
        self.searchers = {cell: self._cell_search(cell, history.get(cell, []), seed + i)
                          for i, cell in enumerate(self.cells)}
        self.owner: dict[str, Cell] = {}
        self.used_ids: set[str] = set()
        self._next = 0

    def _cell_search(self, cell: Cell, past: list, seed: int) -> OptunaSearch:
        lo, hi = self.spec.lr_range(cell[2], cell[0])
        return OptunaSearch(
            space={"lr": FloatDistribution(lo, hi, log=True)}, metric="objective", mode="max", seed=seed,
            points_to_evaluate=[{"lr": lr} for lr, _ in past] or None,
            evaluated_rewards=[v for _, v in past] or None,
        )

    def set_search_properties(self, metric, mode, config, **spec):
        return True

    def suggest(self, trial_id: str):
        open_cells = [c for c in self.cells if self.left[c] > 0]
        if not open_cells:
            return Searcher.FINISHED
        cell = open_cells[self._next % len(open_cells)]
        self._next += 1
        params = self.searchers[cell].suggest(trial_id)
        if params is None or params == Searcher.FINISHED:
            return params
        self.left[cell] -= 1
        self.owner[trial_id] = cell
        dataset, configuration, optimizer, seed = cell
        point = grid_point(dataset, configuration, optimizer, float(f"{params['lr']:.4g}"), seed)
        if point["trial_id"] in self.used_ids:  # two samples that round alike: keep more digits
            point = grid_point(dataset, configuration, optimizer, float(params["lr"]), seed)
        self.used_ids.add(point["trial_id"])
        return tune_config(point)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        pass  # intermediate Ray Train reports have no objective yet

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        cell = self.owner.get(trial_id)
        if cell is not None:
            self.searchers[cell].on_trial_complete(trial_id, result, error)
