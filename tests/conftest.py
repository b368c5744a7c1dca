"""The suite's tiers and what each may start, its shared fixtures, and the environment every test runs in.

A test's tier is its folder: ``tests/shape`` (the source, read), ``tests/unit/<layer>`` (one process, no Ray),
``tests/ray`` (the session's Ray instance), ``tests/e2e`` (what a user runs: the demo study, docs, clusters, S3,
signals). :data:`TIERS` says what each may start; a test that starts more fails, naming the rule
(:func:`pytest_runtest_setup`, :func:`pytest_runtest_call`). Helpers live in ``tests/support/``; fixtures of one
tier in that tier's ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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

TESTS = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------------ the tiers

@dataclasses.dataclass(frozen=True)
class Tier:
    """What the tests of one folder may start; ``rule`` is the sentence a test that starts more fails with."""

    rule: str
    ray: bool
    subprocess: bool


#: The tiers, cheapest first (`make check` runs the first two; `make test` all four).
TIERS = {
    "shape": Tier("reads raystudy's source and starts no Ray and no study", ray=False, subprocess=True),
    "unit": Tier("starts no Ray, no subprocess and no study: one process, the library's own functions",
                 ray=False, subprocess=False),
    "ray": Tier("uses the session's Ray instance (the ray_session fixture) and starts no cluster", ray=True,
                subprocess=True),
    "e2e": Tier("runs what a user runs: the demo study, documented commands, clusters, S3, signals", ray=True,
                subprocess=True),
}
#: The fixtures that need a tier (what they start): a test that uses one lives in that tier or a later one. (A
#: cluster or an S3 server is a subprocess, which the unit tier refuses as it starts.)
FIXTURE_TIERS = {"ray_session": "ray", "demo_study": "e2e"}


class TierError(Exception):
    """A test started what its tier does not allow."""


def tier_of(item: pytest.Item) -> str:
    """A test's tier: the first folder of its path under ``tests/``."""
    parts = item.path.relative_to(TESTS).parts
    if len(parts) < 2 or parts[0] not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: every test lives in a tier folder, tests/{{{','.join(TIERS)}}}/")
    return parts[0]


def tier_problem(item: pytest.Item, started: str) -> str:
    """The message of a test of ``item``'s tier that started ``started``, naming the tier's rule."""
    tier = tier_of(item)
    return (f"{item.nodeid} {started}: a test of tests/{tier}/ {TIERS[tier].rule} (the rule of tests/conftest.py "
            f"TIERS[{tier!r}]); a test that needs more belongs in tests/ray/ or tests/e2e/")


def _fixture_problem(item: pytest.Item) -> str | None:
    order = list(TIERS)
    tier = tier_of(item)
    for name in item.fixturenames:
        need = FIXTURE_TIERS.get(name)
        if need and order.index(need) > order.index(tier):
            return tier_problem(item, f"uses the fixture {name}, which needs the {need} tier")
    return None


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())


def _library_probe() -> bool:
    """Whether the process being started is ``ctypes.util.find_library`` probing for a shared library
    (``ldconfig -p``: torch's first import does it), which a unit test may cause by importing a library."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("ctypes", "util.py")):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _refused(item: pytest.Item):
    """While a test of a tier that allows neither runs: ``ray.init`` (once Ray is imported) and every new
    process raise :class:`TierError`; Ray started anyway (imported and started inside the test) fails it after."""
    tier = TIERS[tier_of(item)]
    patches = []
    if not tier.ray and "ray" in sys.modules:
        ray = sys.modules["ray"]

        def refuse_ray(*args, **kwargs):
            raise TierError(tier_problem(item, "called ray.init"))
        patches.append((ray, "init", refuse_ray))
    if not tier.subprocess:
        execute_child = subprocess.Popen._execute_child

        def refuse_process(self, args, *rest, **kwargs):
            if self is not None and _library_probe():
                return execute_child(self, args, *rest, **kwargs)
            raise TierError(tier_problem(item, f"started a subprocess ({str(args)[:80]})"))
        patches.append((subprocess.Popen, "_execute_child", refuse_process))
        patches.append((os, "system", lambda command: refuse_process(None, command)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    running_before = tier.ray or _ray_running()
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
    if not running_before and _ray_running():
        sys.modules["ray"].shutdown()
        raise TierError(tier_problem(item, "started Ray"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    problem = _fixture_problem(item)
    if problem:
        raise TierError(problem)
    with _refused(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _refused(item):
        return (yield)


# -------------------------------------------------------------------------------------- order and processes

def shared_group(item: pytest.Item) -> str | None:
    """What a test shares with others and so runs beside them in one process under ``make test``
    (pytest-xdist's ``--dist loadgroup``): the demo study (its readers wait for nothing once it is built), or a
    fixture wider than one test (its file's tests, so that it is built once). ``None``: nothing; the test goes to
    whichever process is free."""
    if "demo_study" in item.fixturenames:
        return "demo_study"
    for defs in item._fixtureinfo.name2fixturedefs.values():
        if defs and defs[-1].scope in ("module", "class", "package"):
            return item.nodeid.split("::")[0]
    return None


def run_order(item: pytest.Item) -> tuple[int, int]:
    """Where a test goes in a run: the demo study's group first (the longest chain: its build, then its readers),
    then the tiers from the most costly to the cheapest, so that the many short unit tests end the run and the
    two processes finish together; a file keeps its own order (the sort is stable)."""
    if shared_group(item) == "demo_study":
        return 0, 0
    return 1, -list(TIERS).index(tier_of(item))


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): run beside the tests of the same group (pytest-xdist)")
    for name, tier in TIERS.items():
        config.addinivalue_line("markers", f"{name}: a test of tests/{name}/, which {tier.rule}")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
        group = shared_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=run_order)


# ------------------------------------------------------------------------------------------------ fixtures

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


@pytest.fixture(scope="session")
def builtin(tmp_path_factory):
    """The built-in default stores (small) and a weights file of the tiny ViT standing for a pretrained one,
    shared by the study tests (read only)."""
    import timm
    from safetensors.torch import save_file

    from raystudy.data.synthetic import prepare_default
    from tests.support.models import STUDY_MODEL, STUDY_TINY

    root = tmp_path_factory.mktemp("builtin")
    stores = prepare_default(root / "data", n_train=80, n_test=40, n_train_downstream=60, n_test_downstream=30)
    model = timm.create_model(STUDY_MODEL, img_size=32, num_classes=10, **STUDY_TINY)
    weights = root / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    return {"data_root": str(root / "data"), "stores": stores, "weights": str(weights)}


def _build_demo_study(cwd: Path) -> dict:
    from tests.support.processes import REPO, user_env

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
    Under pytest-xdist its readers run in one process (:func:`shared_group`); a file lock keeps it one run all
    the same when a selection sends them to two."""
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
