"""Reading the values of a study spec: ``datasets`` entries with their overrides, optimizer and seed
mappings, and ``--set key=value`` overrides (:meth:`raystudy.study.spec.StudySpec.with_overrides`). Every
error names the field (``datasets.<name>.<field>``) as :class:`~raystudy.study.checks.SpecError`."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml

from raystudy.setting_roles import fields_with
from raystudy.settings import ProtocolSettings
from raystudy.study.checks import SpecError
from raystudy.vocab import did_you_mean


def per_dataset_fields() -> tuple[str, ...]:
    """The protocol settings a dataset entry may override (see :class:`DatasetOverrides`): those of
    :class:`~raystudy.settings.ProtocolSettings` declared ``per_dataset``."""
    return fields_with(ProtocolSettings, "per_dataset")


@dataclass
class DatasetOverrides:
    """What one entry of ``datasets`` changes of the study's protocol and grid; ``None``: the study's value.

    ``optimizers`` replaces the study's ``optimizers`` on this dataset; ``seeds`` is a list (the seeds of
    every optimizer of the dataset) or a mapping optimizer -> seeds (optimizers it does not name keep the
    study's ``seeds``).
    """

    steps: int | None = None
    eval_period: int | None = None
    warmup_steps: int | None = None
    log_period: int | None = None
    micro_batch_size: int | None = None
    loader_batch_size: int | None = None
    val_batch_size: int | None = None
    optimizers: dict[str, list[float]] | None = None
    seeds: list[int] | dict[str, list[int]] | None = None


@dataclass(frozen=True)
class DatasetProtocol:
    """The resolved protocol and grid of one dataset (:meth:`raystudy.study.spec.StudySpec.protocol`): its
    :class:`DatasetOverrides`, else
    the study's values. ``seeds`` maps each of its optimizers to that optimizer's seeds."""

    steps: int
    eval_period: int
    warmup_steps: int
    log_period: int
    micro_batch_size: int | None
    loader_batch_size: int | None
    val_batch_size: int | None
    optimizers: dict[str, list[float]]
    seeds: dict[str, list[int]]

    def trials(self, configurations: int) -> int:
        """Grid points of this dataset for ``configurations`` configurations."""
        return configurations * sum(len(lrs) * len(self.seeds[o]) for o, lrs in self.optimizers.items())


def _sub(cls, value, where):
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a mapping, got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {unknown}{did_you_mean(unknown[0], known)} "
                        f"(known: {sorted(known)})")
    return cls(**value)




def _dataset_entry(store: str, overrides: dict[str, Any] | None) -> str | dict[str, Any]:
    """A ``datasets`` entry as written in a spec file: the store path, or a mapping when it overrides."""
    set_ = {k: v for k, v in (overrides or {}).items() if v is not None}
    return {"store": store, **set_} if set_ else store


def _parse_entry(name: str, entry: dict[str, Any]) -> tuple[str, DatasetOverrides]:
    """A ``datasets`` entry mapping -> (store path, its overrides), values typed; errors name
    ``datasets.<name>.<field>``."""
    where = f"datasets.{name}"
    known = ["store", *(f.name for f in dataclasses.fields(DatasetOverrides))]
    unknown = sorted(set(entry) - set(known))
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {unknown}{did_you_mean(unknown[0], known)} (a dataset entry may "
                        f"set {known})")
    store = entry.get("store")
    values: dict[str, Any] = {}
    for f in per_dataset_fields():
        if entry.get(f) is not None:
            values[f] = _to_int(entry[f], f"{where}.{f}")
    if entry.get("optimizers") is not None:
        values["optimizers"] = _optimizers(entry["optimizers"], f"{where}.optimizers")
    if entry.get("seeds") is not None:
        values["seeds"] = _seeds(entry["seeds"], f"{where}.seeds")
    return (name if store is None else str(store)), DatasetOverrides(**values)


def _optimizers(value: Any, where: str) -> dict[str, list[float]]:
    """``{optimizer: lr or [lrs]}`` -> ``{optimizer: [float lrs]}``."""
    if isinstance(value, list | tuple) or (value is not None and not isinstance(value, dict)):
        raise SpecError(f"{where}: expected a mapping optimizer -> list of learning rates, e.g. {{sgd: [0.01]}}")
    return {
        str(k): [_to_float(v, f"{where}.{k}") for v in (lrs if isinstance(lrs, list | tuple) else [lrs])]
        for k, lrs in (value or {}).items()
    }


def _seeds(value: Any, where: str) -> list[int] | dict[str, list[int]]:
    """A dataset's ``seeds``: a seed or a list (every optimizer), or a mapping optimizer -> seed(s)."""
    def as_list(v, w):
        return [_to_int(s, w) for s in (v if isinstance(v, list | tuple) else [v])]

    if isinstance(value, dict):
        return {str(opt): as_list(v, f"{where}.{opt}") for opt, v in value.items()}
    return as_list(value, where)


def _seeds_of(seeds: list[int] | dict[str, list[int]] | None, optimizer: str, default: list[int]) -> list[int]:
    """The seeds of ``optimizer`` on a dataset whose entry says ``seeds`` (None: the study's ``default``)."""
    if seeds is None:
        return default
    if isinstance(seeds, dict):
        return seeds.get(optimizer, default)
    return seeds






def _override_target(data: dict[str, Any], key: str, sections: Iterable[str]) -> dict[str, Any]:
    """The mapping inside ``data`` (a spec's :meth:`StudySpec.to_dict`) that ``--set key=...`` writes into;
    a dataset entry that is a plain store path becomes ``{store: path}`` to take an override."""
    parts = key.split(".")
    target = data
    for depth, p in enumerate(parts[:-1]):
        if depth == 1 and parts[0] == "datasets" and isinstance(target.get(p), str):
            target[p] = {"store": target[p]}
        if p not in target or not isinstance(target[p], dict):
            raise SpecError(f"--set {key}: {p!r} is not a section of the spec{did_you_mean(p, sections)} "
                            f"(sections: {', '.join(sections)}, datasets.<name>)")
        target = target[p]
    leaf = parts[-1]
    if len(parts) == 3 and parts[0] == "datasets":
        known = ["store", *(f.name for f in dataclasses.fields(DatasetOverrides))]
        if leaf not in known:
            raise unknown_field(f"--set {key}", leaf, known)
    elif leaf not in target:
        raise unknown_field(f"--set {key}", leaf, target)
    return target



def _split_names(text: str) -> list[str]:
    """``"MHA, LN1"`` -> ``["MHA", "LN1"]`` (comma-separated names from a flag or a YAML string)."""
    return [v.strip() for v in text.split(",") if v.strip()]


def _split_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise SpecError(f"--set {text!r}: expected key=value")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


def is_free_mapping(spec_cls: type, parts: list[str]) -> bool:
    """Whether the field of ``spec_cls`` (a :class:`~raystudy.study.spec.StudySpec`) that a ``--set`` key names
    (``parts``: ``model_kwargs``, ``pretrain.model_kwargs``) is a free-form mapping (typed ``dict``), whose value
    must be a mapping."""
    sections = spec_cls.SECTIONS
    if len(parts) > 2 or (len(parts) == 2 and parts[0] not in sections):
        return False  # a dataset's entry: its overrides are no free-form mapping
    cls = sections[parts[0]] if len(parts) == 2 else spec_cls
    return typing.get_type_hints(cls).get(parts[-1]) is dict


def _parse_value(key: str, text: str, *, mapping: bool = False) -> Any:
    """The value of ``--set key=text``: ``text`` read as YAML, else the text itself (a path, a name). A text
    with a YAML tag the safe loader refuses (``!!python/object:...``) is refused, naming ``--set key``; so is
    a value that is no mapping where ``mapping`` (a free-form mapping such as ``model_kwargs``)."""
    must = f"the value must be a mapping, e.g. {key.rsplit('.', 1)[-1]}={{name: value}}"
    try:
        value = load_yaml(text, "--set")
    except SpecError:
        tag = _yaml_tag(text)
        if tag is not None:
            raise SpecError(f"--set {key}: YAML tags such as {tag} are refused; "
                            f"{must if mapping else 'give a plain value'}") from None
        value = text
    if mapping and value is not None and not isinstance(value, dict):
        raise SpecError(f"--set {key}: {must}, not {text!r}")
    return value


def _yaml_tag(text: str) -> str | None:
    """The first YAML tag in ``text`` (``!!python/object:os.system``, ``!custom``), or None."""
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, yaml.TagToken):
                handle, suffix = token.value
                return f"{handle or ''}{suffix}"
    except yaml.YAMLError:
        return None
    return None


#: the largest spec text read (the paper's preset is ~10 KB; parsing tens of megabytes takes minutes)
MAX_SPEC_BYTES = 1 << 20


def load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)``, refusing aliases (``*name``: a few hundred bytes of them expand into
    gigabytes once the spec is copied) and texts over :data:`MAX_SPEC_BYTES`, with a one-line error naming
    ``where``, the line and column."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"{where}: {len(text):,} bytes, more than the {MAX_SPEC_BYTES:,} a spec may hold")
    try:
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
            raise SpecError(f"{where}: YAML aliases (*name) are not allowed in a spec; write the values out")
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise SpecError(f"{where}: not valid YAML{at}: {problem}") from None


def is_missing(value: Any) -> bool:
    """A table cell that holds nothing: None, NaN or pandas' NA."""
    try:
        return value is None or bool(value != value)
    except TypeError:  # pd.NA: its comparisons are NA, whose truth is ambiguous
        return True


def unknown_field(where: str, key: str, known) -> SpecError:
    """The error for an unknown field ``key``: the closest known name first ("did you mean"), then all."""
    return SpecError(f"{where}: unknown field {key!r}{did_you_mean(key, known)} "
                     f"(known: {', '.join(sorted(map(str, known)))})")


def _select_datasets(available: dict[str, str], names) -> dict[str, str]:
    if isinstance(names, str):
        names = _split_names(names)
    out = {}
    for n in names:
        if n not in available:
            raise SpecError(f"datasets: unknown dataset {n!r}{did_you_mean(n, available)}; this spec knows "
                            f"{sorted(available)}")
        out[n] = available[n]
    return out


def _to_float(v, field_name: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise SpecError(f"{field_name}: {v!r} is not a number") from None


def _to_int(v, field_name: str) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise SpecError(f"{field_name}: {v!r} is not an integer")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise SpecError(f"{field_name}: {v!r} is not an integer") from None



