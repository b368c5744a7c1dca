"""raystudy.analysis: tables, statistical tests, figures and the HTML report of a study directory.

Reads only the Parquet tables of a study directory (never Ray)::

    from raystudy.analysis import analyze, report
    tables = analyze("runs/demo")          # dict of DataFrames; CSV/Markdown/figures in runs/demo/analysis/
    path = report("runs/demo")             # runs/demo/analysis/report.html (self-contained)

The names below are imported on first use, so ``raystudy.analysis.options`` (the CLI's choices) loads
without pandas, scipy or matplotlib.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"TABLES": "pipeline", "analyze": "pipeline", "run_analysis": "pipeline", "report": "html_report"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
