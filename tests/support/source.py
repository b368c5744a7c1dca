"""The source as the shape tests read it: each file read and parsed once per test process, however many tests
ask (a file is known by its path, size and modification time, so a test's own probe files parse afresh)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.support.processes import REPO

PACKAGE = REPO / "raystudy"


@functools.cache
def _read(path: Path, size: int, mtime_ns: int) -> tuple[str, ast.Module]:
    text = path.read_text(encoding="utf-8")
    return text, ast.parse(text)


def _entry(path: Path) -> tuple[str, ast.Module]:
    stat = Path(path).stat()
    return _read(Path(path).resolve(), stat.st_size, stat.st_mtime_ns)


def source_of(path: Path) -> str:
    """The text of ``path``."""
    return _entry(path)[0]


def tree_of(path: Path) -> ast.Module:
    """The syntax tree of ``path`` (shared: do not change it)."""
    return _entry(path)[1]


@functools.cache
def package_files() -> list[Path]:
    """Every ``.py`` file of the ``raystudy`` package, sorted."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30, f"expected the raystudy package at {PACKAGE}"
    return files
