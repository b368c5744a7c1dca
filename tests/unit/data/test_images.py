"""Images decoded safely: oversized PNGs refused from their header, RGB pixels, bad files named, symlink loops,
FIFOs and folder links refused, files listed in a stable order."""

from __future__ import annotations

import io
import os
import re
import time

import numpy as np
import pytest
from PIL import Image

from raystudy.data.images import ImageError, check_image, decode_image, image_files, read_image_file
from tests.support.stores import huge_png, png_bytes


def test_huge_png_refused_from_its_header(tmp_path):
    data = huge_png()
    assert len(data) < 64_000  # the 48 KB file of the issue
    with Image.open(io.BytesIO(huge_png(64, 48))) as im:  # the builder makes real PNGs
        assert im.size == (64, 48) and not np.asarray(im.convert("L")).any()
    t0 = time.perf_counter()
    with pytest.raises(ImageError, match=r"^bomb\.png: .*refused without decoding"):
        decode_image(data, source="bomb.png")
    assert time.perf_counter() - t0 < 1.0  # decoding 400 M pixels would take seconds
    with pytest.raises(ImageError, match=r"^bomb\.png: .*refused without decoding"):
        check_image(data, source="bomb.png")
    assert check_image(huge_png(64, 48), source="ok.png") == (64, 48)


def test_decoder_gives_rgb_pixels():
    rng = np.random.default_rng(0)
    rgb = (rng.random((5, 7, 3)) * 255).astype(np.uint8)
    grey = (rng.random((5, 7)) * 255).astype(np.uint8)
    rgba = np.dstack([rgb, np.full((5, 7), 9, np.uint8)])
    for array, want in ((rgb, rgb), (grey, np.stack([grey] * 3, axis=-1)), (rgba, rgb)):
        buf = io.BytesIO()
        Image.fromarray(array).save(buf, format="PNG")
        got = decode_image(buf.getvalue(), source="x.png")
        assert got.dtype == np.uint8 and got.flags.writeable
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ImageError, match=r"^small\.png: 7 x 5 = 35 pixels is outside 1\.\.34 "):
        decode_image(buf.getvalue(), source="small.png", max_pixels=34)


def test_bad_image_files_name_the_file(tmp_path):
    good = png_bytes(np.random.default_rng(1))
    cases = {"empty.png": (b"", "empty file (0 bytes)"),
             "truncated.png": (good[: len(good) // 2], "cannot decode image"),
             "text.png": (b"not an image at all", "not a readable image")}
    for name, (data, why) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ImageError) as e:
            decode_image(read_image_file(tmp_path / name), source=str(tmp_path / name))
        assert str(e.value).startswith(f"{tmp_path / name}: {why}"), str(e.value)


def test_symlink_loop_fifo_folder_and_oversized_image_refused(tmp_path):
    os.symlink("b.png", tmp_path / "a.png")
    os.symlink("a.png", tmp_path / "b.png")
    loop = re.escape(f"{tmp_path / 'a.png'}: cannot open image file (symbolic link loop)")
    with pytest.raises(ImageError, match=loop):
        read_image_file(tmp_path / "a.png")
    os.mkfifo(tmp_path / "pipe.png")  # reading a FIFO without a writer would block forever
    with pytest.raises(ImageError, match=re.escape(f"{tmp_path / 'pipe.png'}: not a regular file")):
        read_image_file(tmp_path / "pipe.png")
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(ImageError, match=re.escape(f"{tmp_path / 'dir.png'}: not a regular file")):
        read_image_file(tmp_path / "dir.png")
    (tmp_path / "big.png").write_bytes(b"\0" * 100)
    with pytest.raises(ImageError, match="100 bytes exceeds the image file limit of 99 bytes"):
        read_image_file(tmp_path / "big.png", max_bytes=99)


def test_image_files_lists_sorted_without_following_folder_links(tmp_path):
    for rel in ("b/2.PNG", "b/10.jpg", "a.png", "c/d/e.webp", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    os.symlink(tmp_path, tmp_path / "c" / "loop")  # a folder loop: listed once, not forever
    got = [p.relative_to(tmp_path).as_posix() for p in image_files(tmp_path)]
    assert got == ["a.png", "b/10.jpg", "b/2.PNG", "c/d/e.webp"]

