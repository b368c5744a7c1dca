"""What a launch would read, checked before anything runs: ``raystudy study --dry-run`` lists every problem.

:func:`launch_problems` opens each store a launch reads (the datasets', the pretraining store), the weights
file (its format, then built into the model as every trial builds it), the text model's tokenizer and the
folders it writes (the study directory, the cache root), and returns one line per problem, each naming the
spec field and the path. Stores that the launch builds itself (``builtin_data``) and weights that its
pretraining step writes are not problems while they are absent.
"""

from __future__ import annotations

import os

from raystudy.core.models import WeightsError, build_model, check_weights_format
from raystudy.data.modality import modality_of_model, resolve_modality
from raystudy.data.store import StoreError, check_store, read_meta
from raystudy.storage import exists, is_uri
from raystudy.study.persist import check_stored, resolve_paths
from raystudy.study.spec import StudySpec


def preflight(spec: StudySpec) -> tuple[StudySpec, list[str]]:
    """``(resolved spec, problems)``: ``spec`` validated (without its files), its paths made absolute, checked
    against the study already in its ``out`` (a changed protocol raises, naming the fields), then every file
    and folder a launch would use checked (:func:`launch_problems`)."""
    spec.validate(check_files=False)
    spec = resolve_paths(spec)
    check_stored(spec)
    return spec, launch_problems(spec)


def launch_problems(spec: StudySpec) -> list[str]:
    """Every problem a launch of the resolved ``spec`` (:func:`raystudy.study.persist.resolve_paths`) would
    meet in the files it reads or the folders it writes; empty when there is none."""
    problems: list[str] = []
    metas = _store_problems(spec, problems)
    _weights_problems(spec, metas, problems)
    _tokenizer_problems(spec, problems)
    for field, path in (("out", spec.out), ("cache_dir", spec.cache_dir)):
        problem = folder_problem(path)
        if problem:
            problems.append(f"{field}: {problem}")
    return problems


def _stores(spec: StudySpec) -> dict[str, str]:
    """``{spec field: store path}`` of every store the launch reads."""
    stores = {f"datasets.{name}": path for name, path in spec.dataset_stores().items()}
    if spec.pretrain_store is not None and (spec.plasticity.enabled or spec.pretrain.enabled):
        stores["pretrain_store"] = spec.pretrain_store_path()
    return stores


def _store_problems(spec: StudySpec, problems: list[str]) -> dict[str, dict]:
    """Check every store (footers, row counts, the model's modality); returns the metadata of the readable
    ones by spec field."""
    metas = {}
    for field, path in _stores(spec).items():
        if spec.builtin_data and not exists(path):
            continue  # the launch prepares the built-in stores first
        try:
            check_store(path)
            metas[field] = read_meta(path)
            resolve_modality(spec.model, metas[field], path)
        except (StoreError, ValueError) as e:
            problems.append(f"{field}: store not usable: {e}")
    return metas


def _weights_problems(spec: StudySpec, metas: dict[str, dict], problems: list[str]) -> None:
    """The weights file exists (unless pretraining writes it), is a weights file and fits the model."""
    if spec.weights is None or is_uri(spec.weights):
        return
    if not exists(spec.weights):
        if not spec.pretrain.enabled:
            problems.append(f"weights: file not found: {spec.weights}")
        return
    try:
        check_weights_format(spec.weights)
        num_classes = next((int(m["num_classes"]) for f, m in metas.items() if f.startswith("datasets.")), 2)
        kwargs = {k: v for k, v in spec.model_kwargs.items() if k != "img_size"}
        build_model(spec.model, num_classes=num_classes, weights=spec.weights, img_size=spec.img_size, **kwargs)
    except (WeightsError, ValueError, TypeError, RuntimeError, OSError) as e:
        problems.append(f"weights: {spec.weights} cannot be loaded into {spec.model}: {e}")


def _tokenizer_problems(spec: StudySpec, problems: list[str]) -> None:
    """A text model's tokenizer loads (the plasticity pairs and the trials cut windows with it)."""
    try:
        modality_of_model(spec.model).load_tokenizer(spec.model, spec.plasticity.tokenizer)
    except Exception as e:  # a missing file, or tokenizers' own error for a file that is no tokenizer.json
        problems.append(f"plasticity.tokenizer: cannot load the tokenizer: {e}")


def folder_problem(path: str | None) -> str | None:
    """Why a folder a launch writes cannot be created or written (an existing file on the way, no write
    permission), or None; remote URIs are not checked."""
    if path is None or is_uri(path):
        return None
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    if not os.path.isdir(probe):
        return f"{path}: {probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{path}: {probe} is not writable"
    return None
