"""Miniature prepared stores of random images, in the real on-disk format."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np


def png_bytes(rng: np.random.Generator, h: int = 20, w: int = 24) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def make_store(path, *, n_per_split=(40, 10, 20), num_classes=10, seed=0, name="tiny"):
    """Write a miniature prepared store of random PNGs; returns its path."""
    from raystudy.data.splits import SPLITS
    from raystudy.data.store import write_store

    rng = np.random.default_rng(seed)
    rows, index = [], 0
    for split, n in zip(SPLITS, n_per_split):
        for _ in range(n):
            rows.append({"image": png_bytes(rng), "label": index % num_classes, "split": split, "index": index})
            index += 1
    write_store(rows, path, name=name, source="test", classes=[f"c{i}" for i in range(num_classes)])
    return str(path)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, kind, data, CRC."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def huge_png(width: int = 20000, height: int = 20000) -> bytes:
    """A valid 1-bit greyscale PNG of ``width x height`` zero pixels, compressed row by row (~50 KB)."""
    z = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then the packed bits
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")
