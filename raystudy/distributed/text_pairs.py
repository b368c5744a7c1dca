"""Moved: text rows to :mod:`raystudy.data.text_rows`, model names and tokenizers to
:mod:`raystudy.data.modality` (neither imports Ray); these names stay importable from here."""

from raystudy.data.modality import tokenizer_path  # noqa: F401
from raystudy.data.text_rows import STAGE_SCHEMA, TextRows, locate_windows, stage_windows, staged_ids  # noqa: F401
