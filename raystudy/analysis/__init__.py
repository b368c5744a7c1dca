"""raystudy.analysis: tables, statistical tests, figures and the HTML report of a study directory.

Reads only the Parquet tables of a study directory (never Ray)::

    from raystudy.analysis import analyze, report
    tables = analyze("runs/demo")          # dict of DataFrames; CSV/Markdown/figures in runs/demo/analysis/
    path = report("runs/demo")             # runs/demo/analysis/report.html (self-contained)
"""

from __future__ import annotations

from raystudy.analysis.html_report import report
from raystudy.analysis.pipeline import TABLES, analyze, run_analysis

__all__ = ["TABLES", "analyze", "report", "run_analysis"]
