"""Where study files live: local paths and URIs, one file system look-up, one atomic writer.

Every path a study writes may be a local path or any URI pyarrow's file systems understand
(``s3://bucket/study``, ``gs://...``, ``file:///abs/path``). Everything that writes a file goes through
:func:`write_bytes_atomic` (or its text / JSON / Parquet forms): the bytes go to a temporary file beside the
destination, which is then renamed over it, so a reader never sees a half-written file, also when the
writer dies half-way. On object stores the rename is a copy, still all-or-nothing for the reader.

Matplotlib and Ray Train write local files only: :func:`staged` gives a local folder for a URI target and
:func:`publish` uploads it afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs


def is_uri(path: str | os.PathLike) -> bool:
    """True for ``scheme://...`` paths (object stores, ``file://``), False for plain local paths."""
    return "://" in str(path)


def absolute_path(path: str | os.PathLike | None) -> str | None:
    """``path`` made absolute where it enters (``~`` expanded; URIs, ``None`` and ``""`` kept): Ray workers and
    Tune trials do not run in the caller's working directory, so a relative path must not travel."""
    if path is None or str(path) == "" or is_uri(path):
        return None if path is None else str(path)
    return os.path.abspath(os.path.expanduser(str(path)))


def join(base: str | os.PathLike, *parts: str) -> str:
    """Join path parts of a local path or URI with '/'."""
    return "/".join([str(base).rstrip("/"), *[str(p).strip("/") for p in parts]])


def filesystem(path: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """The pyarrow file system of ``path`` and the path inside it (local paths made absolute)."""
    if is_uri(path):
        return pafs.FileSystem.from_uri(str(path))
    return pafs.LocalFileSystem(), os.path.abspath(str(path))


def exists(path: str | os.PathLike) -> bool:
    fs, p = filesystem(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def read_bytes(path: str | os.PathLike) -> bytes | None:
    """The file's bytes, or ``None`` when it does not exist."""
    fs, p = filesystem(path)
    try:
        with fs.open_input_stream(p) as f:
            return f.read()
    except (FileNotFoundError, OSError):
        return None


def read_text(path: str | os.PathLike) -> str | None:
    """The file's text (UTF-8), or ``None`` when it does not exist; ``ValueError`` naming the file, the line
    and the byte when it is not UTF-8 text."""
    data = read_bytes(path)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} on line {line}); save it as UTF-8"
                         ) from None


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Any]:
    """A writable binary stream whose contents replace ``path`` only when the ``with`` block succeeds.

    The stream writes a temporary file beside ``path``, renamed over it on success; on any failure (a full
    disk, an interrupt) the temporary file is removed, so no partial file is left where a later run looks.
    This is the one atomic writer of the project: every other ``write_*_atomic`` goes through it.
    """
    fs, p = filesystem(path)
    parent, name = p.rsplit("/", 1)
    create_dir(fs, parent)
    tmp = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp"
    try:
        with fs.open_output_stream(tmp) as f:
            yield f
        fs.move(tmp, p)
    except BaseException:
        try:
            fs.delete_file(tmp)
        except OSError:
            pass
        raise


def move(path: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename the file or folder ``path`` to ``target`` on the same file system (one rename when local)."""
    fs, p = filesystem(path)
    fs.move(p, filesystem(target)[1])


def move_aside(path: str | os.PathLike, tag: str) -> str:
    """Rename the file or folder ``path`` to ``<path>.<tag>-<n>`` (the first free ``n`` from 1), so that
    nothing reads it again and nothing is lost; returns the new path. One rename on a local file system."""
    n = 1
    while exists(f"{path}.{tag}-{n}"):
        n += 1
    target = f"{path}.{tag}-{n}"
    move(path, target)
    return target


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> str:
    """Write ``data`` to ``path`` through :func:`atomic_output`; returns ``path``."""
    with atomic_output(path) as f:
        f.write(data)
    return str(path)


def write_text_atomic(path: str | os.PathLike, text: str) -> str:
    """:func:`write_bytes_atomic` for UTF-8 text."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_json_atomic(path: str | os.PathLike, obj: Any) -> str:
    """:func:`write_bytes_atomic` for an indented JSON document (numpy scalars allowed, NaN kept)."""
    return write_text_atomic(path, json.dumps(obj, indent=2, default=_json_default, allow_nan=True))


def write_parquet_atomic(path: str | os.PathLike, table) -> str:
    """:func:`write_bytes_atomic` for a ``pyarrow.Table`` or pandas DataFrame written as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not isinstance(table, pa.Table):
        table = pa.Table.from_pandas(table, preserve_index=False)
    with atomic_output(path) as f:
        pq.write_table(table, f)
    return str(path)


def staged(target: str | os.PathLike, prefix: str = "raystudy-") -> tuple[Path, str | None]:
    """A local folder to write ``target``'s files into: ``(local folder, URI to publish to or None)``.

    A local ``target`` is used as it is; for a URI the folder is a new temporary one, to be uploaded with
    :func:`publish` once written.
    """
    if is_uri(target):
        return Path(tempfile.mkdtemp(prefix=prefix)), str(target)
    return Path(target), None


def publish(local: str | os.PathLike, uri: str | None) -> None:
    """Replace the contents of ``uri`` by those of the local folder ``local`` (no-op without a URI)."""
    if uri is None:
        return
    fs, path = pafs.FileSystem.from_uri(uri)
    create_dir(fs, path)
    fs.delete_dir_contents(path, missing_dir_ok=True)
    pafs.copy_files(str(Path(local).absolute()), path, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)


def upload_dir(local: str | os.PathLike, uri: str) -> None:
    """Copy the local folder ``local`` into ``uri`` (kept files there stay; same names are overwritten)."""
    copy_dir(local, uri)


#: the lock file of an :func:`uploaded_folder`, held (``flock``) by the process that uses the folder
OWNER_LOCK = ".owner"


@contextlib.contextmanager
def uploaded_folder(uri: str, name: str = "", prefix: str = "raystudy-") -> Iterator[str]:
    """A new local temporary folder (named ``name`` where given) whose files are uploaded into ``uri`` when
    the block ends, also when it raises (:func:`upload_dir`), then removed.

    A process killed in the block (SIGKILL, a Ray actor whose owner died) can neither upload nor remove its
    folder; the folder's :data:`OWNER_LOCK` then is free, and the next such block on the machine removes it
    (:func:`remove_abandoned_folders`): what it held never reached ``uri`` and nothing will upload it."""
    remove_abandoned_folders()
    tmp = tempfile.mkdtemp(prefix=prefix)
    lock = _hold_lock(tmp)
    local = os.path.join(tmp, name or "files")
    os.makedirs(local, exist_ok=True)
    try:
        yield local
    finally:
        try:
            upload_dir(local, uri)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            os.close(lock)


def _hold_lock(folder: str) -> int:
    """Lock :data:`OWNER_LOCK` in ``folder`` for this process (the kernel frees it when the process dies);
    returns its descriptor. The file appears already locked (locked first, then renamed into place)."""
    import fcntl

    pending = os.path.join(folder, OWNER_LOCK + ".new")
    fd = os.open(pending, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(pending, os.path.join(folder, OWNER_LOCK))
    return fd


def remove_abandoned_folders() -> list[str]:
    """Remove this machine's :func:`uploaded_folder` folders whose process died in its block (their
    :data:`OWNER_LOCK` is free); returns their paths."""
    import fcntl
    import glob

    removed = []
    for lock in glob.glob(os.path.join(tempfile.gettempdir(), "raystudy-*", OWNER_LOCK)):
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:  # removed meanwhile by its owner
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process lives
            continue
        else:
            shutil.rmtree(os.path.dirname(lock), ignore_errors=True)
            removed.append(os.path.dirname(lock))
        finally:
            os.close(fd)
    return removed


def copy_dir(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy the folder ``source`` into ``target`` (each local or a URI; kept files there stay; same names are
    overwritten)."""
    src_fs, src = filesystem(source)
    dst_fs, dst = filesystem(target)
    create_dir(dst_fs, dst)
    pafs.copy_files(src, dst, source_filesystem=src_fs, destination_filesystem=dst_fs)


def subdirs(path: str | os.PathLike) -> list[str]:
    """Names of the folders directly under ``path`` (local or URI), sorted; ``[]`` if it is none."""
    fs, p = filesystem(path)
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return []
    return sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(p)) if i.type == pafs.FileType.Directory)


def download_dir(source: str | os.PathLike, local: str | os.PathLike) -> None:
    """Copy the folder ``source`` (local or URI) into the local folder ``local``."""
    fs, path = filesystem(source)
    Path(local).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(path, str(Path(local).absolute()), source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())


def delete_file(path: str | os.PathLike) -> None:
    """Remove the file ``path`` (local or URI); nothing when it does not exist."""
    fs, p = filesystem(path)
    if fs.get_file_info(p).type == pafs.FileType.File:
        fs.delete_file(p)


def delete_dir(path: str | os.PathLike) -> None:
    """Remove the folder ``path`` (local or URI) and everything in it; nothing when it does not exist."""
    fs, p = filesystem(path)
    if fs.get_file_info(p).type == pafs.FileType.Directory:
        fs.delete_dir(p)


#: The longest name accepted as one path component (most file systems allow 255 bytes; room for suffixes).
MAX_NAME_LENGTH = 128


def check_path_name(name: object, what: str) -> str:
    """``name`` when it is safe as ONE path component (a file or folder name under an output folder).

    Refused, with a ``ValueError`` naming ``what`` (the flag or file the name came from) and the value: a
    non-string or empty name, ``.`` / ``..``, a leading ``.`` (hidden files, ``..foo``), ``/`` or ``\\``,
    NUL or other control characters, and names longer than :data:`MAX_NAME_LENGTH` characters. Used for
    every name that becomes a path: store and dataset names, study and model names.
    """
    problem = None
    if not isinstance(name, str) or not name:
        problem = "must be a non-empty string"
    elif name.startswith("."):
        problem = "must not start with '.' (no '.', '..' or hidden names)"
    elif "/" in name or "\\" in name:
        problem = "must not contain '/' or '\\'"
    elif any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in name):
        problem = "must not contain control characters"
    elif len(name) > MAX_NAME_LENGTH:
        problem = f"must be at most {MAX_NAME_LENGTH} characters"
    if problem:
        raise ValueError(f"{what}: {name!r} is not a valid name: it {problem}; it becomes a file name, "
                         "so it must be one path component")
    return name


class FolderError(ValueError):
    """A folder that cannot be created or written: a file where a folder must be, a read-only mount, no
    permission (a ``ValueError``: the command line prints it in one line)."""


def create_dir(fs: pafs.FileSystem, path: str) -> None:
    """``fs.create_dir(path, recursive=True)``; a file on the way or an unwritable place raises
    :class:`FolderError` naming the folder and why."""
    try:
        fs.create_dir(path, recursive=True)
    except OSError:
        why = folder_problem(path) if isinstance(fs, pafs.LocalFileSystem) else None
        if why is None:  # e.g. a full disk, which the study reports as such
            raise
        raise FolderError(f"cannot create the folder {why}") from None


def file_problem(path: str | None) -> str | None:
    """Why a file cannot be written at ``path`` (a folder there, or :func:`folder_problem` of the folder it
    goes into), or None; remote URIs are not checked."""
    if path is None or is_uri(path):
        return None
    if os.path.isdir(path):
        return f"{path} is a folder, not a file"
    return folder_problem(os.path.dirname(os.path.abspath(path)))


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
        return f"{path}: {probe} is not writable (a read-only mount, or no permission)"
    return None
