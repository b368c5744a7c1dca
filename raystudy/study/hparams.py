"""The study's TensorBoard HParams experiment: every grid axis with its domain, in ``<study>/tb/`` itself.

Each trial's run (``<study>/tb/<trial_id>``, :class:`raystudy.core.finetune.TensorBoardLogger`) records its
session: configuration, optimizer, lr, seed, steps, batch_size, model, model_kwargs, and from the study
``dataset`` and ``phase``. TensorBoard shows the sessions of an experiment whose record it takes from the
first event file that has one, so the study writes the one record, for all its trials: each hyperparameter
with its domain (the spec's values: lr as an interval under ``search: optuna``) and ``differs`` where the
domain has more than one value, and the metrics :data:`~raystudy.core.finetune.HPARAM_METRICS`.
"""

from __future__ import annotations

import json
import os

from raystudy.core.finetune.outputs import HPARAM_METRICS
from raystudy.storage import is_uri
from raystudy.study.spec import StudySpec
from raystudy.vocab import PHASES

#: the HParams of a study trial that are strings (every other one is a number)
STRING_HPARAMS = ("dataset", "configuration", "optimizer", "phase", "model", "model_kwargs")
#: the prefix of TensorBoard event files (the study's own are those directly in ``<study>/tb/``)
EVENT_PREFIX = "events.out.tfevents."


def study_domains(spec: StudySpec) -> dict[str, list]:
    """Each HParam of the study's trials -> its sorted values (``lr`` under ``search: optuna``: ``[lo, hi]``,
    the interval the searches explore). Axes: dataset, configuration, optimizer, lr, seed, phase; fixed
    by the protocol: steps (per dataset), batch_size, model, model_kwargs."""
    cells = spec.groups()  # (dataset, configuration, optimizer, seed) of both searches
    protocols = {d: spec.protocol(d) for d in spec.datasets}
    if spec.search == "grid":
        lrs = sorted({float(p["lr"]) for p in spec.grid()})
    else:
        ranges = [spec.lr_range(c["optimizer"], c["dataset"]) for c in cells]
        lrs = [min(lo for lo, _ in ranges), max(hi for _, hi in ranges)] if ranges else []
    return {
        "dataset": sorted(spec.datasets), "configuration": sorted({c["configuration"] for c in cells}),
        "optimizer": sorted({c["optimizer"] for c in cells}), "lr": lrs,
        "seed": sorted({int(c["seed"]) for c in cells}),
        "phase": list(PHASES) if spec.final_fit else [PHASES[0]],
        "steps": sorted({int(p.steps) for p in protocols.values()}), "batch_size": [int(spec.batch_size)],
        "model": [spec.model], "model_kwargs": [json.dumps(dict(spec.model_kwargs), sort_keys=True)],
    }


def hparam_info(name: str, values: list, *, interval: bool = False):
    """One ``HParamInfo``: a string or float64 hyperparameter with its discrete domain (``interval``:
    ``[values[0], values[-1]]``), ``differs`` when it takes more than one value."""
    from google.protobuf import struct_pb2
    from tensorboard.plugins.hparams import api_pb2

    string = name in STRING_HPARAMS
    info = api_pb2.HParamInfo(name=name, type=api_pb2.DATA_TYPE_STRING if string else api_pb2.DATA_TYPE_FLOAT64,
                              differs=len(values) > 1)
    if interval and values:
        info.domain_interval.CopyFrom(api_pb2.Interval(min_value=values[0], max_value=values[-1]))
    else:
        info.domain_discrete.CopyFrom(struct_pb2.ListValue(values=[
            struct_pb2.Value(string_value=str(v)) if string else struct_pb2.Value(number_value=float(v))
            for v in values]))
    return info


def experiment_summary(spec: StudySpec):
    """The study's HParams experiment as a TensorBoard ``Summary`` (:func:`study_domains`, the metrics)."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    interval = spec.search != "grid"
    infos = [hparam_info(k, v, interval=interval and k == "lr") for k, v in study_domains(spec).items()]
    metrics = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=t)) for t in HPARAM_METRICS]
    experiment = api_pb2.Experiment(description=f"raystudy study {spec.name}", hparam_infos=infos,
                                    metric_infos=metrics)
    content = plugin_data_pb2.HParamsPluginData(experiment=experiment, version=metadata.PLUGIN_DATA_VERSION)
    return Summary(value=[Summary.Value(tag=metadata.EXPERIMENT_TAG,
                                        metadata=metadata.create_summary_metadata(content))])


def write_study_hparams(spec: StudySpec) -> str | None:
    """The study's HParams experiment as the one event file directly in ``<study>/tb/`` (an earlier
    launch's is replaced: one experiment record per study); its path, ``None`` for a URI study (its
    ``tb/`` holds copies of the trials' folders only)."""
    from torch.utils.tensorboard.writer import FileWriter

    if is_uri(spec.out):
        return None
    tb = os.path.join(spec.out, "tb")
    os.makedirs(tb, exist_ok=True)
    for name in os.listdir(tb):
        path = os.path.join(tb, name)
        if name.startswith(EVENT_PREFIX) and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)
    writer = FileWriter(tb)
    writer.add_summary(experiment_summary(spec))
    writer.close()
    return next(os.path.join(tb, n) for n in os.listdir(tb) if n.startswith(EVENT_PREFIX))
