"""Shared fixtures: tiny random-init models, miniature stores, one local Ray instance per test session."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
# Fault injection (raystudy.faults): set before Ray starts so that its workers inherit it; the `faults`
# fixture writes the file.
os.environ["RAYSTUDY_FAULTS"] = os.path.join(tempfile.mkdtemp(prefix="raystudy-faults-"), "faults.json")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TQDM_DISABLE", "1")
# Ray Train's controller polls its workers every 2 s by default and every report waits for a poll: 0.2 s
# keeps the Ray Train tests (and the studies run in subprocesses, which inherit it) from idling
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# Ray starts its workers at niceness 15: beside a second pytest process (`make test` runs two) they starve
# behind its driver, and a 12 s test took 141 s. At 0 both processes' Ray workers share the CPUs fairly.
os.environ.setdefault("RAY_worker_niceness", "0")


def tiny_vit(**overrides):
    """A small timm ViT (32 px, 8 px patches -> 17 tokens, d=48, 3 blocks, 4 heads)."""
    from timm.models.vision_transformer import VisionTransformer

    kw = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)
    kw.update(overrides)
    return VisionTransformer(**kw)


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


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (start-up costs several seconds)."""
    import ray

    from raystudy.distributed.cluster import init_ray

    init_ray("local", num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture
def faults():
    """Inject faults for one test: ``faults(fail_after_step={"run": 3})``; cleared when the test ends."""
    path = os.environ["RAYSTUDY_FAULTS"]

    def inject(**kinds):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(kinds, f)

    yield inject
    if os.path.exists(path):
        os.remove(path)


#: the tiny ViT of the end-to-end study tests (timm's vit_tiny_patch16_224 shrunk to 32 px)
STUDY_MODEL = "vit_tiny_patch16_224"
STUDY_TINY = {"patch_size": 8, "embed_dim": 48, "depth": 3, "num_heads": 4}


@pytest.fixture(scope="session")
def builtin(tmp_path_factory):
    """The built-in default stores (small) and a weights file of the tiny ViT standing for a pretrained one,
    shared by the study tests (read only)."""
    import timm
    from safetensors.torch import save_file

    from raystudy.data.synthetic import prepare_default

    root = tmp_path_factory.mktemp("builtin")
    stores = prepare_default(root / "data", n_train=80, n_test=40, n_train_downstream=60, n_test_downstream=30)
    model = timm.create_model(STUDY_MODEL, img_size=32, num_classes=10, **STUDY_TINY)
    weights = root / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    return {"data_root": str(root / "data"), "stores": stores, "weights": str(weights)}


REPO = Path(__file__).resolve().parents[1]

def user_env() -> dict:
    """The environment of a user's terminal: no Ray address, progress bars on, this checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TQDM_DISABLE", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = str(REPO)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _build_demo_study(cwd: Path) -> dict:
    (cwd / "experiments").symlink_to(REPO / "experiments", target_is_directory=True)
    (cwd / ".venv").symlink_to(sys.prefix, target_is_directory=True)  # the environment `make` creates
    run = dict(cwd=cwd, env=user_env(), capture_output=True, text=True)
    study = subprocess.run([sys.executable, "experiments/full_study.py"], timeout=1200, **run)  # = `make demo`
    return {"cwd": str(cwd), "returncode": study.returncode, "stdout": study.stdout, "stderr": study.stderr}


@pytest.fixture(scope="session")
def demo_study(tmp_path_factory) -> dict:
    """The demo study, run once per test session as a user runs it (``experiments/full_study.py``, what
    ``make demo`` runs, unchanged: the study the pages' example outputs come from) in a fresh working
    directory: ``{"cwd", "returncode", "stdout", "stderr"}``, the study at ``<cwd>/results/demo``.
    Under pytest-xdist the processes share one run (a file lock; the first builds)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _build_demo_study(tmp_path_factory.mktemp("demo"))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # one folder for all the processes of this session
    record = shared / "demo-study.json"
    with FileLock(str(record) + ".lock"):
        if not record.is_file():
            cwd = shared / "demo-study"
            cwd.mkdir()
            record.write_text(json.dumps(_build_demo_study(cwd)))
    return json.loads(record.read_text())


class Killed(Exception):
    """Raised by :func:`kill_at_first_checkpoint`'s callback: the run stops there like a killed process."""


def kill_at_first_checkpoint(ft, ckdir) -> None:
    """Run the ``Finetuner`` ``ft`` until its first checkpoint, save it as ``ckdir/checkpoint_XXXXXXXX`` (the one
    layout, which ``train_local(checkpoint_dir=ckdir, resume=True)`` resumes from) and stop there."""
    from raystudy.core.finetune.checkpoint import save_checkpoint

    def kill(ev):
        if ev.checkpoint:
            save_checkpoint(ft, str(ckdir), keep=None)
            raise Killed

    with pytest.raises(Killed):
        ft.run(kill, progress=False)


#: what each slow test file costs a `make test` run, in seconds: pytest's --durations summed over the file's
#: tests (setup + call + teardown), from two runs on 2026-12-06 on the 2-core machine while other jobs shared it
#: (load 20-45, so every time is ~2-10x a quiet run's and only the ranking is used; a quiet serial run of
#: 2026-12-02 took test_docs ~300 s with the demo study, test_multinode ~170 s, test_newcomer ~150 s). The
#: first run (the whole suite, stopped after 19 min) gave test_docs (with the demo study it builds),
#: test_newcomer, test_finetune_ray and test_multinode; the second (every other file, 32 min) the rest. The
#: files are collected slowest first and `make test` keeps that order (`--no-loadscope-reorder`: pytest-xdist
#: would otherwise send the files with the most tests first), so that its two processes start on the longest
#: files and end together on short ones: with only the 14 files listed before, test_vtab_demo_study and
#: test_vtab_protocol came last and one process idled the last 3 of 32 minutes. A file not listed (under
#: 20 s there; test_demo_study's 780 s were the demo study's build, which test_docs does first in a full run)
#: keeps its alphabetical place after these.
FILE_SECONDS = {
    "test_docs.py": 971, "test_study.py": 830, "test_hardening_study.py": 689, "test_expressions_wired.py": 512,
    "test_newcomer.py": 388, "test_fast_step.py": 364, "test_analysis_selection.py": 357, "test_analysis.py": 354,
    "test_finetune_ray.py": 352, "test_text_finetune.py": 313, "test_probe.py": 247, "test_vtab_demo_study.py": 245,
    "test_finetune.py": 227, "test_text_plasticity.py": 218, "test_analysis_paper.py": 217, "test_multinode.py": 207,
    "test_distributed_plasticity.py": 206, "test_vtab_protocol.py": 125, "test_actor_memory.py": 99,
    "test_analysis_compare.py": 97, "test_analysis_beyond.py": 89, "test_peft_methods.py": 77,
    "test_analysis_vtab.py": 67, "test_authors_measurements.py": 64, "test_cli_plasticity.py": 63,
    "test_packaging.py": 63, "test_results_scale.py": 56, "test_data_default.py": 52, "test_paper_protocol.py": 50,
    "test_study_probes.py": 50, "test_cli_core.py": 47, "test_data_stream.py": 47, "test_figures_trust.py": 45,
    "test_code_shape.py": 41, "test_eva.py": 39, "test_presets.py": 32, "test_accuracy_modes.py": 29,
    "test_tools.py": 27, "test_pairing.py": 26, "test_study_cost.py": 26, "test_gpu_check.py": 25,
    "test_authors_splits.py": 22, "test_terminal.py": 22, "test_core.py": 20,
}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file keeps its own order
