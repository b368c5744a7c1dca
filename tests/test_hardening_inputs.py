"""Issue 15, items 2, 5 and 6 (Markdown): poisoned names and images, reproduced first, then refused.

* item 2: a store whose ``dataset.json`` names it ``../../../STORE_ESCAPE`` and ``--dataset ../../../OUTSIDE``
  wrote figures above ``--out``; now the name is refused before anything is written, naming its origin.
* item 5: the local plasticity path decoded a 48 KB 20000 x 20000 PNG (+1 GB), said nothing of the file for a
  zero-byte PNG and gave a raw ``OSError`` for a symbolic-link loop; now one decoder with one pixel limit
  refuses each with a one-line error naming the file.
* item 6: names carried raw HTML and table breakers into ``analysis/*.md``; now every text is escaped.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import make_store, png_bytes
from PIL import Image

from raystudy.cli import main
from raystudy.data.images import ImageError, check_image, decode_image, image_files, read_image_file
from raystudy.storage import check_path_name

MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs",
         json.dumps({"img_size": 32, "patch_size": 8, "depth": 2})]


def _everything(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


# --------------------------------------------------------------------------------------------------- names

@pytest.mark.parametrize("bad", ["", ".", "..", "../x", "a/b", "a\\b", ".hidden", "nul\x00byte", "new\nline",
                                 "tab\tname", "x" * 129, None, 3])
def test_check_path_name_refuses_what_is_not_one_component(bad):
    with pytest.raises(ValueError) as e:
        check_path_name(bad, "dataset.json 'name'")
    assert str(e.value).startswith(f"dataset.json 'name': {bad!r} is not a valid name")


@pytest.mark.parametrize("good", ["cifar10", "CIFAR-10-C_snow.v2", "my dataset", "x" * 128, "é"])
def test_check_path_name_keeps_ordinary_names(good):
    assert check_path_name(good, "--dataset") == good


def _escaping_store(tmp_path: Path) -> Path:
    """A copy of a good store whose dataset.json names it ``../../../STORE_ESCAPE`` (checksum untouched)."""
    store = Path(make_store(tmp_path / "stores" / "copied", n_per_split=(4, 2, 6), name="tiny"))
    meta = json.loads((store / "dataset.json").read_text())
    meta["name"] = "../../../STORE_ESCAPE"
    (store / "dataset.json").write_text(json.dumps(meta))
    return store


def test_store_name_cannot_write_outside_out(tmp_path, capsys):
    bad = _escaping_store(tmp_path)
    good = make_store(tmp_path / "stores" / "good", n_per_split=(4, 2, 6), name="good", seed=1)
    out = tmp_path / "a" / "b" / "c" / "out"
    before = _everything(tmp_path)
    assert main(["plasticity", *MODEL, "--x", good, "--y", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{bad / 'dataset.json'} 'name': '../../../STORE_ESCAPE' is not a valid name" in err
    assert _everything(tmp_path) == before  # nothing written, least of all STORE_ESCAPE.png three levels up


def test_dataset_flag_cannot_write_outside_out(tmp_path, capsys):
    x = make_store(tmp_path / "stores" / "x", n_per_split=(4, 2, 6), name="x")
    y = make_store(tmp_path / "stores" / "y", n_per_split=(4, 2, 6), name="y", seed=1)
    out = tmp_path / "a" / "b" / "c" / "out"
    before = _everything(tmp_path)
    assert main(["plasticity", *MODEL, "--x", x, "--y", y, "--dataset", "../../../OUTSIDE",
                 "--out", str(out)]) == 2
    assert "--dataset: '../../../OUTSIDE' is not a valid name" in capsys.readouterr().err
    assert _everything(tmp_path) == before
    # the same stores with a valid --dataset write inside --out only, the figures under the given name
    assert main(["plasticity", *MODEL, "--x", x, "--y", y, "--dataset", "renamed", "--out", str(out)]) == 0
    assert {p for p in _everything(tmp_path) - before if not p.startswith("a/b/c/out")} == {"a", "a/b", "a/b/c"}
    assert {"plasticity_renamed.png", "rates_renamed.svg"} <= set(os.listdir(out))


def test_ray_pipeline_refuses_the_store_name_before_any_work(tmp_path):
    from raystudy.distributed.plasticity import PlasticityJob, plan_pairs

    bad = _escaping_store(tmp_path)
    good = make_store(tmp_path / "stores" / "good", n_per_split=(4, 2, 6), name="good", seed=1)
    job = PlasticityJob(model="vit_tiny_patch16_224", pretrain=good, downstream=[str(bad)], pairs=4,
                        out_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match=re.escape(f"{bad}/dataset.json 'name': '../../../STORE_ESCAPE'")):
        plan_pairs(job)


# --------------------------------------------------------------------------------------------------- images

def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def huge_png(width: int = 20000, height: int = 20000) -> bytes:
    """A valid 1-bit greyscale PNG of ``width x height`` zero pixels, compressed row by row (~50 KB)."""
    z = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then the packed bits
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


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


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak RSS read from /proc/self/status (Linux)")
def test_huge_png_peak_memory_stays_small(tmp_path):
    """In a fresh process: refusing the PNG keeps the peak RSS far below the 400 MB of its pixels.

    The peak is the process's ``VmHWM`` (reset by ``exec``; ``ru_maxrss`` would keep pytest's own peak).
    """
    (tmp_path / "bomb.png").write_bytes(huge_png())
    code = ("import re, sys\nfrom raystudy.data.images import ImageError, load_image_file\n"
            "try:\n    load_image_file(sys.argv[1])\nexcept ImageError as e:\n    print(e)\n"
            "status = open('/proc/self/status').read()\n"
            "print(int(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1)) // 1024)\n")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bomb.png")], capture_output=True, text=True,
                         timeout=120, check=True)
    message, peak_mb = res.stdout.strip().splitlines()
    assert message.startswith(f"{tmp_path / 'bomb.png'}: ") and "refused without decoding" in message
    assert int(peak_mb) < 150, res.stdout


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


@pytest.mark.parametrize("case", ["bomb", "empty", "loop"])
def test_local_plasticity_names_the_bad_image(tmp_path, capsys, case):
    """``raystudy plasticity --x FOLDER``: exit 2 with one line naming the file, no traceback, nothing written."""
    rng = np.random.default_rng(0)
    for side in ("x", "y"):
        (tmp_path / side).mkdir()
        for i in range(3):
            (tmp_path / side / f"{i}.png").write_bytes(png_bytes(rng, 32, 32))
    bad = tmp_path / "x" / "1.png"
    bad.unlink()
    if case == "bomb":
        bad.write_bytes(huge_png())
    elif case == "empty":
        bad.write_bytes(b"")
    else:
        os.symlink("1a.png", bad)  # 1.png -> 1a.png -> 1.png; 1.png is read first
        os.symlink("1.png", tmp_path / "x" / "1a.png")
    why = {"bomb": "refused without decoding", "empty": "empty file (0 bytes)", "loop": "symbolic link loop"}[case]
    assert main(["plasticity", *MODEL, "--x", str(tmp_path / "x"), "--y", str(tmp_path / "y"),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"raystudy plasticity: error: {bad}: ") and why in err and "\n" not in err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------- Markdown escaping

EVIL = "<script>alert(1)</script>|x"


def test_markdown_escapes_names_from_data(tmp_path):
    from test_analysis import make_study

    from raystudy.analysis.pipeline import run_analysis

    datasets = ("cifar10", EVIL, "two\nlines & [a link](http://example.com) `code` *em*")
    d = make_study(tmp_path / "s", datasets=datasets, models=("vit_tiny", "vit<b>tiny</b>"), curves=False)
    res = run_analysis(d, figures=False)
    mds = sorted((d / "analysis").glob("*.md"))
    assert {"best_lr.md", "lr_grid.md", "overall.md", "notes.md", "excluded.md"} <= {p.name for p in mds}
    for md in mds:
        text = md.read_text()
        assert not re.search(r"<\s*/?\s*(script|b)\b", text), md.name
        assert not re.search(r"(?<!\\)\]\(http", text) and "two\nlines" not in text, md.name  # no live link
        for block in text.split("\n\n"):  # every table row has its header's number of unescaped cell breaks
            rows = [line for line in block.splitlines() if line.startswith("|")]
            assert len({len(re.findall(r"(?<!\\)\|", r)) for r in rows}) <= 1, (md.name, block)
    best = (d / "analysis" / "best_lr.md").read_text()
    assert "| &lt;script>alert(1)&lt;/script>\\|x |" in best
    assert "two lines &amp; \\[a link\\](http://example.com) \\`code\\` \\*em\\*" in best
    assert "## model: vit&lt;b>tiny&lt;/b> · optimizer: sgd" in best
    # the CSV keeps the names as they are; the rendered cells (the HTML report's source) too
    assert EVIL in set(res.tables["best_lr"]["dataset"])
