"""One image decoder with one set of limits, for every path that reads images.

``data prepare``, the local ``raystudy plasticity`` / ``bounds`` inputs and anything else that turns bytes
into pixels go through :func:`decode_image`, so a file refused in one place is refused everywhere, with
an error that names the file:

* the pixel count is read from the header (PIL opens lazily) and checked against :data:`MAX_IMAGE_PIXELS`
  *before* anything is decoded: a 48 KB PNG that claims 20000 x 20000 pixels is refused without
  allocating its 1.2 GB of pixels;
* an empty, truncated or unrecognised file raises :class:`ImageError` naming the source;
* :func:`read_image_file` reads only regular files of at most :data:`MAX_IMAGE_BYTES` (a FIFO, a device,
  a folder or a symbolic-link loop is an :class:`ImageError`, not a hang or a raw ``OSError``).
"""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np

#: File name endings of images, for every folder listing (``data prepare`` image folders, local plasticity).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
#: Most pixels (width x height) an image may have: PIL's own default ``Image.MAX_IMAGE_PIXELS`` (about
#: 9459 x 9459, 268 MB as RGB), refused here instead of only warned about.
MAX_IMAGE_PIXELS = 89_478_485
#: Largest image file read from disk.
MAX_IMAGE_BYTES = 256 * 2**20


class ImageError(ValueError):
    """An image that cannot or may not be decoded; the message starts with the file (or row) it came from."""


def open_image(data: bytes, *, source: str, max_pixels: int = MAX_IMAGE_PIXELS):
    """A lazily opened ``PIL.Image`` of ``data`` whose size has been checked, not yet decoded.

    Raises :class:`ImageError` naming ``source`` for empty data, data PIL does not recognise, a zero-sized
    image, or one of more than ``max_pixels`` pixels (read from the header only).
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError(f"{source}: empty file (0 bytes), not an image")
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ImageError(f"{source}: more than {max_pixels} pixels (raystudy.data.images.MAX_IMAGE_PIXELS); "
                         f"refused without decoding ({e})") from e
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"{source}: not a readable image ({type(e).__name__}: {e})") from e
    width, height = im.size
    if width * height > max_pixels or width * height == 0:
        im.close()
        raise ImageError(f"{source}: {width} x {height} = {width * height} pixels is outside 1..{max_pixels} "
                         "(raystudy.data.images.MAX_IMAGE_PIXELS); refused without decoding")
    return im


def check_image(data: bytes, *, source: str, max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """``(width, height)`` of encoded image bytes, read from the header only, with :func:`open_image`'s checks.

    For decoders other than PIL (torchvision's, in the training transforms): the same limits before they run.
    """
    with open_image(data, source=source, max_pixels=max_pixels) as im:
        return im.size


def decode_image(data: bytes, *, source: str, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Encoded image bytes -> ``uint8`` array ``(H, W, 3)`` (grey, palette, RGBA, CMYK converted to RGB).

    The size is checked before decoding (:func:`open_image`); truncated or corrupt data raises
    :class:`ImageError` naming ``source`` (the file, or store and row, the bytes came from).
    """
    with open_image(data, source=source, max_pixels=max_pixels) as im:
        try:
            im.load()
            return np.array(im.convert("RGB"))
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise ImageError(f"{source}: cannot decode image ({type(e).__name__}: {e})") from e


def read_image_file(path: str | os.PathLike, *, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (at most ``max_bytes``); :class:`ImageError` naming it otherwise.

    The file is opened once (non-blocking, so a FIFO cannot hang the reader) and checked on the open
    descriptor: a symbolic-link loop, a missing file, a folder, a FIFO or device, or an oversized file
    each get a one-line error.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        why = "symbolic link loop" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise ImageError(f"{path}: cannot open image file ({why})") from e
    st, problem = os.fstat(fd), None
    if not stat.S_ISREG(st.st_mode):
        problem = "not a regular file (folder, FIFO, socket or device)"
    elif st.st_size > max_bytes:
        problem = f"{st.st_size} bytes exceeds the image file limit of {max_bytes} bytes"
    if problem:
        os.close(fd)
        raise ImageError(f"{path}: {problem}")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(max_bytes + 1)
        except OSError as e:
            raise ImageError(f"{path}: cannot read image file ({e.strerror or e})") from e


def load_image_file(path: str | os.PathLike, *, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """:func:`read_image_file` then :func:`decode_image`: the ``uint8 (H, W, 3)`` pixels of one file."""
    return decode_image(read_image_file(path), source=str(path), max_pixels=max_pixels)


def image_files(folder: str | os.PathLike) -> Iterator[Path]:
    """The image files under ``folder`` (any depth, :data:`IMAGE_EXTENSIONS`) in sorted path order.

    Symbolic links to folders are not followed (no loops); links to files are listed and checked when read.
    """
    root = Path(folder)
    found = [Path(d) / f for d, _, files in os.walk(root) for f in files
             if Path(f).suffix.lower() in IMAGE_EXTENSIONS]
    yield from sorted(found, key=lambda p: p.relative_to(root).parts)
