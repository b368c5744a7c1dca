"""raystudy: Ray-distributed studies of how transformer components adapt during finetuning.

The science lives in :mod:`raystudy.core` (pure PyTorch, no Ray); data stores in :mod:`raystudy.data`;
Ray orchestration in :mod:`raystudy.distributed` and :mod:`raystudy.study`; tables and figures in
:mod:`raystudy.analysis`. See ``docs/architecture.md``.

``import raystudy`` stays light (no torch, no Ray); :func:`load_study` is resolved on first use.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("raystudy")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.1.0"

__all__ = ["__version__", "load_study"]


def __getattr__(name: str):
    if name == "load_study":
        from raystudy.study.results import load_study  # pandas: `import raystudy` stays light

        return load_study
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
