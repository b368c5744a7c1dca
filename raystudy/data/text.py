"""Text sources -> a prepared text store (``kind: text`` in :mod:`raystudy.data.store`).

A text store is the same directory of Parquet shards plus ``dataset.json`` as an image store, with rows
``text`` (str), ``label`` (int64, null when the source has none), ``split`` and ``index``; checksum,
shard list and :func:`~raystudy.data.store.verify_store` are the image store's.

On-disk layouts read (``ROOT`` is ``--root``; the dataset's usual top folder inside it is also accepted):

===============  ===================================================================================
``agnews``       ``ag_news_csv/{train.csv, test.csv[, classes.txt]}``: no header, rows
                 ``"<class index 1..4>","<title>","<description>"`` (RFC 4180 quoting)
``wikitext103``  ``wikitext-103-raw/wiki.{train,valid,test}.raw``: articles open with a `` = Title = ``
                 line, sections with `` = = Section = = ``, paragraphs are lines, blank lines between
``textfolder``   any tree of ``.txt`` (one text per file), ``.jsonl`` (one ``{"text": ..., "label": ...}``
                 per line) and ``.csv`` (header with a ``text`` and optionally a ``label`` column) files
===============  ===================================================================================

Rows: AGNews: ``title + " " + description`` as in the CSV (as Hugging Face's ``ag_news``), label = class
index - 1; index = the row in ``train.csv``, then ``test.csv`` offset by the train rows. WikiText-103
(``unit="document"``, default): one row per article, from its `` = Title = `` line to the next one, each
line stripped (so paragraphs are separated by an empty line); ``unit="paragraph"``: one row per
paragraph line (headings and blank lines left out); ``unit="line"``: one row per non-empty line as
Hugging Face's ``wikitext-103-raw-v1`` rows hold it (headings included, unstripped, with the newline: the
authors' GPT-2 measurement); no label; index = the running row number over the
train, valid and test files. Text folders: a ``.txt`` file's label is its class folder
(``[split/]<class>/<file>.txt``, as in IMDB's ``aclImdb``), a ``.jsonl``/``.csv`` row's its ``label``
field; names sort into classes (all-integer labels are used as they are); index = the row's position
in the sorted walk. Splits: a folder or file named ``train``, ``val``/``valid``/``validation``/``dev``
or ``test`` is an official split; the rest follows :mod:`raystudy.data.splits` (20% test, 20% of train
to val), keyed by the dataset name. Every error names the file and, where there is one, the line.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from raystudy.vocab import TEXT_SOURCES, WIKITEXT_UNITS

from .splits import RULE, assign_splits
from .store import StoreError, write_store

TEXT_EXTENSIONS = (".txt", ".jsonl", ".csv")
AGNEWS_CLASSES = ["World", "Sports", "Business", "Sci/Tech"]
WIKITEXT_FILES = {"train": "wiki.train.raw", "val": "wiki.valid.raw", "test": "wiki.test.raw"}
SPLIT_NAMES = {"train": "train", "val": "val", "valid": "val", "validation": "val", "dev": "val", "test": "test"}
_TITLE = re.compile(r"= (?!=).*(?<!=) =")  # an article heading; sections are "= = ... = ="


@dataclass
class TextRow:
    """One source text: ``label`` is an int, a class name (text folders, resolved later) or ``None``."""

    index: int
    text: str
    label: int | str | None
    split: str | None
    ref: str


@dataclass
class TextListing:
    name: str
    classes: list[str]
    rows: list[TextRow]
    extra: dict = field(default_factory=dict)


def _read_text(path: Path) -> str:
    """A UTF-8 text file; a missing, undecodable or empty file raises naming it (and the line)."""
    if not path.is_file():
        raise StoreError(f"{path}: file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise StoreError(f"{path}:{line}: not UTF-8 text ({e.reason})") from e
    if not text.strip():
        raise StoreError(f"{path}: empty file")
    return text


def _read_lines(path: Path) -> list[str]:
    return _read_text(path).splitlines()


def _find_base(root, marker: str, subdirs: tuple[str, ...]) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise StoreError(f"{root}: source folder not found")
    for cand in (root, *(root / s for s in subdirs)):
        if (cand / marker).exists():
            return cand
    raise StoreError(f"{root}: {marker} not found (looked in {root} and {', '.join(subdirs)})")


def _csv_rows(path: Path):
    """``(line number where the record starts, fields)`` of every non-empty CSV record."""
    reader = csv.reader(io.StringIO(_read_text(path), newline=""), strict=True)
    while True:
        start = reader.line_num + 1
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise StoreError(f"{path}:{start}: malformed CSV ({e})") from e
        if fields:
            yield start, fields


# ----------------------------------------------------------------------------- AGNews


def _agnews_classes(base: Path) -> list[str]:
    path = base / "classes.txt"
    if not path.exists():
        return list(AGNEWS_CLASSES)
    return [line.strip() for line in _read_lines(path) if line.strip()]


def read_agnews(root) -> TextListing:
    """AGNews' CSV release (``train.csv``/``test.csv``, class index 1..4, title, description)."""
    base = _find_base(root, "train.csv", ("ag_news_csv", "ag_news"))
    classes = _agnews_classes(base)
    rows: list[TextRow] = []
    for split in ("train", "test"):
        path = base / f"{split}.csv"
        for line, fields in _csv_rows(path):
            where = f"{path}:{line}"
            if len(fields) != 3:
                raise StoreError(f"{where}: expected 3 fields (class index, title, description), "
                                 f"found {len(fields)}")
            if not re.fullmatch(r"\d+", fields[0].strip()) or not 1 <= int(fields[0]) <= len(classes):
                raise StoreError(f"{where}: class index {fields[0]!r} is not an integer in 1..{len(classes)}")
            rows.append(TextRow(len(rows), f"{fields[1]} {fields[2]}", int(fields[0]) - 1, split, where))
    return TextListing("agnews", classes, rows, extra={"source_root": str(base)})


# ----------------------------------------------------------------------------- WikiText-103


def is_title(line: str) -> bool:
    """True for an article heading `` = Title = `` (not a section `` = = Section = = ``)."""
    return bool(_TITLE.fullmatch(line.strip()))


def _wiki_documents(path: Path, lines: list[str]):
    """``(first line number, text)`` of every article: its heading to the line before the next one."""
    start, doc = None, []
    for lineno, line in enumerate(lines, 1):
        if is_title(line):
            if start is not None:
                yield start, "\n".join(doc).strip()
            start, doc = lineno, []
        elif start is None and line.strip():
            raise StoreError(f"{path}:{lineno}: text before the first article heading ' = Title = '")
        doc.append(line.strip())
    if start is not None:
        yield start, "\n".join(doc).strip()


def _wiki_paragraphs(lines: list[str]):
    for lineno, line in enumerate(lines, 1):
        s = line.strip()
        if s and not (s.startswith("= ") and s.endswith(" =")):
            yield lineno, s


def _wiki_lines(text: str):
    """Every non-empty line as Hugging Face's ``wikitext-103-raw-v1`` rows hold it: unstripped, with its
    newline (the authors' GPT-2 script keeps ``row["text"]`` of the rows whose ``strip()`` is not empty)."""
    segments = text.split("\n")
    for lineno, segment in enumerate(segments, 1):
        if segment.strip():
            yield lineno, segment + ("\n" if lineno < len(segments) else "")


def read_wikitext103(root, *, unit: str = "document") -> TextListing:
    """WikiText-103 raw (``wiki.{train,valid,test}.raw``) as articles or paragraphs (``unit``)."""
    if unit not in WIKITEXT_UNITS:
        raise ValueError(f"unit must be one of {WIKITEXT_UNITS}, got {unit!r}")
    base = _find_base(root, WIKITEXT_FILES["train"], ("wikitext-103-raw", "wikitext-103"))
    rows: list[TextRow] = []
    for split, fname in WIKITEXT_FILES.items():
        path = base / fname
        if unit == "line":
            units = _wiki_lines(_read_text(path))
        else:
            lines = _read_lines(path)
            units = _wiki_documents(path, lines) if unit == "document" else _wiki_paragraphs(lines)
        first = len(rows)
        rows.extend([TextRow(first + i, text, None, split, f"{path}:{line}")
                     for i, (line, text) in enumerate(units)])
        if len(rows) == first:
            raise StoreError(f"{path}: no {unit}s found")
    return TextListing("wikitext103", [], rows, extra={"source_root": str(base), "unit": unit})


# ----------------------------------------------------------------------------- text folders


def _official_split(rel: Path) -> str | None:
    """The split a folder or file name gives (``train/...``, ``.../valid.jsonl``), or None."""
    for part in (*rel.parts[:-1], rel.stem):
        if part.lower() in SPLIT_NAMES:
            return SPLIT_NAMES[part.lower()]
    return None


def _folder_class(rel: Path) -> str | None:
    """A ``.txt`` file's class folder (the folder above it, unless that is a split folder or the root)."""
    if len(rel.parts) < 2 or rel.parts[-2].lower() in SPLIT_NAMES:
        return None
    return rel.parts[-2]


def _check_label(value, where: str):
    if value is None or (isinstance(value, (int, str)) and not isinstance(value, bool)):
        return value
    raise StoreError(f"{where}: label {value!r} is neither an integer nor a class name")


def _jsonl_rows(path: Path):
    for lineno, line in enumerate(_read_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise StoreError(f"{where}: not JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise StoreError(f"{where}: expected a JSON object with a 'text' string, found {line.strip()[:60]!r}")
        yield where, obj["text"], _check_label(obj.get("label"), where)


def _csv_file_rows(path: Path):
    records = _csv_rows(path)
    _, header = next(records)
    if "text" not in header:
        raise StoreError(f"{path}:1: no 'text' column in the header {header}")
    for line, fields in records:
        where = f"{path}:{line}"
        if len(fields) != len(header):
            raise StoreError(f"{where}: expected {len(header)} fields ({', '.join(header)}), found {len(fields)}")
        row = dict(zip(header, fields))
        label = row.get("label") or None
        yield where, row["text"], int(label) if label and re.fullmatch(r"-?\d+", label) else label


def _file_rows(path: Path, rel: Path):
    """``(where, text, label)`` of every text in one file of a text folder."""
    if path.suffix == ".jsonl":
        yield from _jsonl_rows(path)
    elif path.suffix == ".csv":
        yield from _csv_file_rows(path)
    else:
        text = "\n".join(_read_lines(path)).strip()
        yield str(path), text, _folder_class(rel)


def _resolve_labels(rows: list[TextRow]) -> list[str]:
    """Turn the rows' labels into class numbers; returns the class names (``[]`` when unlabelled)."""
    labelled = [r for r in rows if r.label is not None]
    if not labelled:
        return []
    if len(labelled) != len(rows):
        a, b = labelled[0], next(r for r in rows if r.label is None)
        raise StoreError(f"{b.ref}: no label, but {a.ref} has one (label every text or none)")
    if all(isinstance(r.label, int) for r in rows):
        low = min(rows, key=lambda r: r.label)
        if low.label < 0:
            raise StoreError(f"{low.ref}: label {low.label} is negative")
        return [str(k) for k in range(max(r.label for r in rows) + 1)]
    classes = sorted({str(r.label) for r in rows})
    for r in rows:
        r.label = classes.index(str(r.label))
    return classes


def read_textfolder(root) -> TextListing:
    """Every ``.txt`` / ``.jsonl`` / ``.csv`` file under ``root`` (sorted by relative path)."""
    root = Path(root)
    if not root.is_dir():
        raise StoreError(f"{root}: source folder not found")
    files = sorted((p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_EXTENSIONS
                    and not any(s.startswith(".") for s in p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise StoreError(f"{root}: no {', '.join(TEXT_EXTENSIONS)} files")
    rows: list[TextRow] = []
    for path in files:
        rel = path.relative_to(root)
        split, first = _official_split(rel), len(rows)
        rows.extend([TextRow(first + i, text, label, split, where)
                     for i, (where, text, label) in enumerate(_file_rows(path, rel))])
    classes = _resolve_labels(rows)
    return TextListing(root.name, classes, rows, extra={"source_root": str(root)})


# ----------------------------------------------------------------------------- entry point


def list_text_source(source: str, root, *, unit: str = "document") -> TextListing:
    """The :class:`TextListing` of one text source."""
    if source not in TEXT_SOURCES:
        raise ValueError(f"unknown text source {source!r}; expected one of {TEXT_SOURCES}")
    if root is None:
        raise ValueError(f"source {source!r} needs --root (the folder holding the downloaded files)")
    if source == "agnews":
        return read_agnews(root)
    if source == "wikitext103":
        return read_wikitext103(root, unit=unit)
    return read_textfolder(root)


def prepare_text(source: str, root, out: str | os.PathLike, *, name: str | None = None, unit: str = "document",
                 rows_per_shard: int = 2048) -> dict:
    """Read a text ``source`` under ``root`` and write the text store at ``out``; returns its metadata.

    Splits: official ones are kept, the rest drawn by :func:`raystudy.data.splits.assign_splits` (stratified
    by label when there is one), keyed by the source's name (a text folder's: ``name`` or its folder name).
    """
    listing = list_text_source(source, root, unit=unit)
    split_name = name if source == "textfolder" and name else listing.name
    rows = listing.rows
    for r in rows:
        if not r.text.strip():
            raise StoreError(f"{r.ref}: empty text")
    by_index = assign_splits([r.index for r in rows], [0 if r.label is None else r.label for r in rows],
                             [r.split for r in rows], name=split_name)
    stored = ({"text": r.text, "label": r.label, "split": by_index[r.index], "index": r.index} for r in rows)
    extra = {**listing.extra, "splits": {"rule": RULE, "key_name": split_name, "pooled": []}}
    return write_store(stored, out, name=name or listing.name, source=source, classes=listing.classes,
                       rows_per_shard=rows_per_shard, extra=extra, allow_empty=False, kind="text")
