"""Folders that cannot be made are one line naming the file in the way."""

from __future__ import annotations

import pytest


def test_a_cache_folder_replaced_by_a_file_is_one_line(tmp_path):
    import pyarrow.fs as pafs

    from raystudy.storage import FolderError, create_dir, write_text_atomic

    (tmp_path / "cache").write_text("not a folder")
    with pytest.raises(FolderError, match=rf"cannot create the folder {tmp_path}/cache/train-crop37: "
                                          rf"{tmp_path}/cache is a file, not a folder"):
        create_dir(pafs.LocalFileSystem(), str(tmp_path / "cache" / "train-crop37"))
    with pytest.raises(FolderError, match="is a file, not a folder"):
        write_text_atomic(str(tmp_path / "cache" / "x" / "meta.json"), "{}")

