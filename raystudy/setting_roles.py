"""What a setting affects, declared on the setting itself: its roles (``setting(..., roles={"trial",
"resume"}, path=True, per_dataset=True, legacy=V)``, :func:`raystudy.settings.setting`).

Every list of the settings one concern covers (the fields a checkpoint must agree on, those that change what
a study's trial means, the columns of a trial's row, the paths made absolute, the ``raystudy study`` flags,
...) is derived from these declarations by :func:`fields_with`, computed from the dataclass's fields at each
call: none is kept by hand, and a setting declared with a role (in a group, or in a subclass) is in its
list with no other edit. Like :mod:`raystudy.settings`, this module imports neither torch nor Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import MISSING
from typing import Any

#: Role -> what a setting declared with it affects.
ROLES: dict[str, str] = {
    "resume": "a finetuning run's checkpoint records it and a resume must agree on it (a checkpoint of another "
              "value is refused: raystudy.core.finetune.state.resume_config)",
    "trial": "changing it changes what a study's trials mean: a study resumed with another value is refused, the "
             "field named (StudySpec.conflicts, the value as StudySpec.trial_value resolves it)",
    "row": "each trial's row in trials.parquet records it (raystudy.core.finetune.outputs.run_summary) and every "
           "launch compares it with the finished rows (StudySpec.row_conflicts)",
    "plasticity": "changing it changes which pairs (or bounds) a measured dataset's plasticity rows mean: refused "
                  "on a study's resume (StudySpec.conflicts)",
    "probe": "changing it changes what a finished linear probe means: refused on a study's resume "
             "(StudySpec.conflicts)",
    "study_flag": "a flag of `raystudy study` sets it (raystudy.commands.study; a preset's value stands when "
                  "the flag is not given)",
}
#: Declarations of a setting beside its roles, asked like a role by :func:`fields_with`: ``path``: a user's
#: path, made absolute where the setting enters a job (Ray workers run in another directory;
#: :func:`absolute_paths`); ``per_dataset``: a dataset entry of a study spec may override it
#: (:class:`raystudy.study.spec_values.DatasetOverrides`). ``legacy=V`` (:func:`legacy_values`): the value a
#: config, checkpoint or probe result written before the setting existed ran with.
FLAGS: tuple[str, ...] = ("path", "per_dataset")


def roles_metadata(roles: Iterable[str], *, path: bool = False, per_dataset: bool = False,
                   legacy: Any = MISSING) -> dict[str, Any]:
    """The field-metadata entries of a setting's roles (:func:`raystudy.settings.setting` adds them); an
    unknown role is refused where it is declared."""
    roles = frozenset(roles)
    unknown = sorted(roles - set(ROLES))
    if unknown:
        raise ValueError(f"unknown setting role(s) {unknown}; the roles are {sorted(ROLES)}")
    meta: dict[str, Any] = {"roles": roles, "path": path, "per_dataset": per_dataset}
    if legacy is not MISSING:
        meta["legacy"] = legacy
    return meta


def fields_with(cls: type | Any, role: str) -> tuple[str, ...]:
    """The names of the settings of dataclass ``cls`` (or an instance's class) that carry ``role`` (one of
    :data:`ROLES` or :data:`FLAGS`), in field order; read from ``dataclasses.fields`` at each call, so a
    setting declared with the role (in a group, or in a subclass) is in the list with no other edit."""
    if role not in ROLES and role not in FLAGS:
        raise ValueError(f"unknown setting role {role!r}; the roles are {sorted(ROLES)} and {list(FLAGS)}")
    if role in FLAGS:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(role))
    return tuple(f.name for f in dataclasses.fields(cls) if role in f.metadata.get("roles", ()))


def legacy_values(cls: type | Any) -> dict[str, Any]:
    """``{field: value}`` of ``cls``'s settings declared with ``legacy=``: what a config, checkpoint or result
    written before the setting existed ran with (filled in where such a file lacks the field)."""
    return {f.name: f.metadata["legacy"] for f in dataclasses.fields(cls) if "legacy" in f.metadata}


def absolute_paths(obj: Any, absolute: Callable[[Any], Any]) -> None:
    """Pass every ``path`` setting of dataclass ``obj`` through ``absolute`` (e.g.
    :func:`raystudy.storage.absolute_path`), each entry of a list alike; done where the settings enter a job."""
    for name in fields_with(obj, "path"):
        value = getattr(obj, name)
        setattr(obj, name, [absolute(v) for v in value] if isinstance(value, list) else absolute(value))
