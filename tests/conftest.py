"""Shared fixtures: tiny random-init models, miniature stores, one local Ray instance per test session."""

from __future__ import annotations

import contextlib
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
# `make test` runs two pytest processes on two cores: at PyTorch's default (a thread per core) each in-process
# model and each subprocess it starts runs two OpenMP threads, four or more on two cores, whose spin-waits burn
# the other process's CPU (4 files of PyTorch tests: 126 -> 81 CPU seconds, 68 -> 54 s). Ray's workers set their
# own (cpus_per_worker), as on a cluster.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


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


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_s3(log_dir: Path, bucket: str):
    """``(env, filesystem)``: moto's S3 server on a free port of 127.0.0.1 with ``bucket`` made, the
    environment a client needs to reach it (also set in this process, which reads the study's tables, until
    the block ends), and a pyarrow file system on it. The server is stopped when the block ends."""
    import shutil

    import pyarrow.fs as pafs

    port = free_port()
    server = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    log = open(Path(log_dir) / "moto.log", "w")
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_REGION": "us-east-1"}
    try:
        wait_for_port(port, proc, timeout=60)
        fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", access_key="test", secret_key="test",
                               region="us-east-1", allow_bucket_creation=True)
        fs.create_dir(bucket)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield env, fs
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    """Until something listens on 127.0.0.1:``port`` (``proc``, e.g. a ``ray start --block``, must live)."""
    import socket
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:2]} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def s3_checkpoints(fs, folder: str) -> list[str]:
    """The complete checkpoints (``checkpoint_*/.complete``) under ``folder`` (``bucket/study/train/<trial>``)
    of the pyarrow file system ``fs``; none while the folder does not exist."""
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(folder, recursive=True))
    except (FileNotFoundError, OSError):
        return []
    return sorted(i.path for i in infos if i.base_name == ".complete")


def assert_trials_equal_single_process_runs(out: str, trial_ids, scratch: Path) -> None:
    """Every trial of the study ``out`` (local or a URI) ends as an uninterrupted single-process run of its own
    ``config.json`` (into ``scratch``) does: the same steps once each, train losses within 1e-6, and the same
    test and best val accuracies."""
    import dataclasses

    import pandas as pd
    import torch

    from raystudy.core.finetune import train_local
    from raystudy.distributed.train import split_legacy
    from raystudy.io import read_result
    from raystudy.storage import join, read_text

    trials = read_result(out, "trials").set_index("trial_id")
    curves = read_result(out, "curves")
    for tid in trial_ids:
        cfg, _ = split_legacy(json.loads(read_text(join(out, "trials", tid, "config.json"))))
        cfg = dataclasses.replace(cfg, out_dir=str(Path(scratch) / tid))
        ref, _ = train_local(cfg, tensorboard=False)
        ref_curves = pd.read_parquet(Path(scratch) / tid / "curves.parquet")
        got = curves[curves.trial_id == tid].sort_values("step")
        assert got.step.tolist() == ref_curves.step.tolist()  # every step once: none lost or repeated
        torch.testing.assert_close(torch.tensor(got.train_loss.values), torch.tensor(ref_curves.train_loss.values),
                                   rtol=1e-6, atol=0)
        assert trials.loc[tid, "test_acc"] == ref["test_acc"], tid
        assert trials.loc[tid, "best_val_acc"] == ref["best_val_acc"], tid


def assert_tensorboard_equals_curves(out: str, trial_ids) -> None:
    """Each trial's TensorBoard events in the study ``out`` (local or a URI), in its folder and under ``tb/``,
    as TensorBoard shows them: every step of ``curves.parquet`` once, with its train loss."""
    import tempfile

    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raystudy.io import read_result
    from raystudy.storage import download_dir, join

    curves = read_result(out, "curves")
    for tid in trial_ids:
        want = curves[curves.trial_id == tid].sort_values("step")
        for folder in (join(out, "trials", tid, "tb"), join(out, "tb", tid)):
            with tempfile.TemporaryDirectory() as tmp:
                download_dir(folder, tmp)
                events = EventAccumulator(tmp).Reload().Scalars("train/train_loss")
            assert [e.step for e in events] == want.step.tolist(), folder
            torch.testing.assert_close(torch.tensor([e.value for e in events]),
                                       torch.tensor(want.train_loss.values, dtype=torch.float32), msg=folder)


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


#: what each slow test file costs a `make test` run, in seconds: pytest's durations summed over the file's
#: tests (setup + call + teardown) in a `make test` run's two processes on a 2-core AMD EPYC (2026-12-07,
#: 1,246 s in all; test_multinode as merged since, test_fast_step with inductor's kernel cache empty, as on a
#: fresh machine). The files are collected in the order of :func:`collection_rank`, slowest first within a
#: group, and `make test` keeps that order (`--no-loadscope-reorder`: pytest-xdist would otherwise send the files
#: with the most tests first), so that its two processes end together on short ones. test_docs's 371 s are
#: mostly the demo study's build (~300 s beside the other process, 149 s alone), which test_demo_study,
#: test_figures_trust and others then read. A file not listed (under 20 s) keeps its alphabetical place in its
#: group, after the listed ones.
FILE_SECONDS = {
    "test_docs.py": 371, "test_topology.py": 167, "test_newcomer.py": 152, "test_multinode.py": 150,
    "test_finetune_ray.py": 130, "test_vtab_demo_study.py": 129, "test_study.py": 120, "test_hardening_study.py": 82,
    "test_analysis.py": 81, "test_distributed_plasticity.py": 80, "test_s3.py": 66, "test_expressions_wired.py": 61,
    "test_analysis_paper.py": 50, "test_fast_step.py": 43, "test_analysis_browser.py": 38, "test_vtab_protocol.py": 35,
    "test_text_plasticity.py": 32, "test_actor_memory.py": 29, "test_text_finetune.py": 28,
    "test_analysis_compare.py": 25, "test_probe.py": 24, "test_cli_plasticity.py": 23, "test_analysis_criteria.py": 20,
}


#: the files whose time is mostly Ray's (studies, Ray Train and Ray Data runs, clusters of their own): collected
#: after the files that start none, so that the demo study's build (test_docs, first: a Ray instance of its own
#: running two trials at a time) runs beside plain PyTorch and analysis work rather than beside more Ray
#: instances. Beside the demo's build, test_study and test_finetune_ray took 2x their time beside each other
#: (514 s against 256 s of the two processes), and the build 3.5x its time alone.
RAY_FILES = frozenset({
    "test_multinode.py", "test_study.py", "test_finetune_ray.py", "test_newcomer.py", "test_vtab_demo_study.py",
    "test_hardening_study.py", "test_expressions_wired.py", "test_distributed_plasticity.py",
    "test_text_finetune.py", "test_text_plasticity.py", "test_probe.py", "test_cli_plasticity.py",
    "test_vtab_protocol.py", "test_actor_memory.py", "test_study_probes.py", "test_data_stream.py",
    "test_topology.py", "test_s3.py",
    "test_demo_study.py", "test_terminal.py",  # (these two read the demo study: beside its build they would wait)
})


def collection_rank(name: str) -> tuple[int, int]:
    """Where a test file goes in a `make test` run: test_docs (the demo study's build) first, then the files that
    start no Ray, then the Ray files, each group slowest first."""
    group = 0 if name == "test_docs.py" else 2 if name in RAY_FILES else 1
    return group, -FILE_SECONDS.get(name, 0)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: collection_rank(item.path.name))  # stable: a file keeps its own order
