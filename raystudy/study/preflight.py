"""What a launch would read, checked before anything runs: ``raystudy study --dry-run`` lists every problem.

:func:`launch_problems` opens each store a launch reads (the datasets', the pretraining store), the weights
file (its format, then built into the model as every trial builds it), the text model's tokenizer and the
folders it writes (the study directory, the cache root), and returns one line per problem, each naming the
spec field and the path. Every configuration is also resolved on the spec's model built on the meta device
(:func:`configuration_problems`), so that one naming a layer or a block the model lacks (``ia3:nonexistent``,
``lora:r=8:fc9``, ``MHA@40`` on a 12-block model) is reported here rather than inside its trials. Stores
that the launch builds itself (``builtin_data``) and weights that its pretraining step writes are not
problems while they are absent.
"""

from __future__ import annotations

import copy

from raystudy.core.expressions import Adapter, Budgeted, element_budget, normalise, resolve
from raystudy.data.modality import modality_of_model, resolve_modality
from raystudy.data.store import StoreError, check_store
from raystudy.distributed.job_inputs import weights_problem
from raystudy.storage import exists, folder_problem, is_uri, join
from raystudy.study.checks import SpecError, dataset_store_problem, pretraining_writes_weights, weights_not_found
from raystudy.study.cost import spec_meta_model
from raystudy.study.persist import check_stored, resolve_paths, row_conflicts_message
from raystudy.study.results import ResultTables
from raystudy.study.spec import StudySpec


def preflight(spec: StudySpec) -> tuple[StudySpec, list[str]]:
    """``(resolved spec, problems)``: ``spec`` validated (without its files), its paths made absolute, checked
    against the study already in its ``out`` (a changed protocol raises, naming the fields), then every file
    and folder a launch would use checked (:func:`launch_problems`)."""
    spec.validate(check_files=False)
    spec = resolve_paths(spec)
    check_stored(spec)
    check_rows(spec)
    return spec, launch_problems(spec)


def check_rows(spec: StudySpec) -> None:
    """Refuse a spec that disagrees with how the study's finished trials ran (their rows in
    ``trials.parquet``: :meth:`StudySpec.row_conflicts`), as the launch itself does."""
    if exists(join(spec.out, "trials.parquet")):
        changed = spec.row_conflicts(ResultTables(spec.out).rows)
        if changed:
            raise SpecError(row_conflicts_message(spec, changed))


def launch_problems(spec: StudySpec) -> list[str]:
    """Every problem a launch of the resolved ``spec`` (:func:`raystudy.study.persist.resolve_paths`) would
    meet in the files it reads or the folders it writes; empty when there is none."""
    problems: list[str] = []
    metas = _store_problems(spec, problems)
    _weights_problems(spec, metas, problems)
    _tokenizer_problems(spec, problems)
    problems.extend(configuration_problems(spec))
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
    """Check every store (footers, row counts, labels, the splits a run reads, the model's modality);
    returns the metadata of the readable ones by spec field."""
    metas = {}
    for field, path in _stores(spec).items():
        if spec.builtin_data and not exists(path):
            continue  # the launch prepares the built-in stores first
        try:
            if field.startswith("datasets."):
                meta, problem = dataset_store_problem(spec, path)
            else:
                meta, problem = check_store(path), None
            if meta is not None:
                metas[field] = meta
                resolve_modality(spec.model, meta, path)
        except (StoreError, ValueError) as e:
            problem = str(e)
        if problem:
            problems.append(f"{field}: store not usable: {problem}")
    return metas


def _weights_problems(spec: StudySpec, metas: dict[str, dict], problems: list[str]) -> None:
    """The weights file exists (unless the launch's pretraining writes it: only its own file, whatever the
    preset, :func:`~raystudy.study.checks.pretraining_writes_weights`) and loads into the model as every trial
    loads it (:func:`raystudy.distributed.job_inputs.weights_problem`; a file that is no weights file is
    refused from its first bytes)."""
    if spec.weights is None or is_uri(spec.weights):
        return
    if not exists(spec.weights):
        if not pretraining_writes_weights(spec):
            problems.append(weights_not_found(spec))
        return
    num_classes = next((int(m["num_classes"]) for f, m in metas.items() if f.startswith("datasets.")), 2)
    error = weights_problem(spec, num_classes, flag="weights")
    if error:
        problems.append(error)


def _tokenizer_problems(spec: StudySpec, problems: list[str]) -> None:
    """A text model's tokenizer loads (the plasticity pairs and the trials cut windows with it)."""
    try:
        modality_of_model(spec.model).load_tokenizer(spec.model, spec.plasticity.tokenizer)
    except Exception as e:  # a missing file, or tokenizers' own error for a file that is no tokenizer.json
        problems.append(f"plasticity.tokenizer: cannot load the tokenizer: {e}")


def configuration_problems(spec: StudySpec) -> list[str]:
    """One line per configuration of ``spec`` that does not resolve (:func:`raystudy.core.expressions.resolve`)
    on the spec's model on the meta device (:func:`raystudy.study.cost.spec_meta_model`: shapes only, no
    weights): the expression and the reason (an adapter target no block has, a block out of range). A budget
    resolves at the first seed; ``auto:B``, whose plasticity table is measured at launch, as ``random:B``
    (the same budget and units, another order); a ``:weights`` budget by its entry count
    (:func:`~raystudy.core.expressions.element_budget`: at least one entry; its mask is drawn at launch). A
    model the meta device cannot build is left to the weights check (no line here)."""
    try:
        net = spec_meta_model(spec)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError, OSError):
        return []
    problems = []
    for configuration in spec.configurations:
        tree = normalise(configuration)
        weights = isinstance(tree, Budgeted) and tree.weights
        model = copy.deepcopy(net) if isinstance(tree, Adapter) else net  # an adapter wraps layers in place
        try:
            if weights:
                element_budget(model, tree, spec.include_layerscale)
            else:  # auto, a criterion: scored at launch, packed here in random:B's order
                resolve(model, tree, seed=spec.seeds[0], include_layerscale=spec.include_layerscale,
                        random_stand_in=isinstance(tree, Budgeted))
        except (ValueError, TypeError, KeyError) as e:  # ExpressionError, TargetError are ValueErrors
            problems.append(f"configurations: {configuration!r} does not resolve on {spec.model}: {e}")
    return problems
