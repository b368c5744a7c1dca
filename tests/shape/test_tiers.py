"""The suite's tiers (tests/conftest.py): every test lives in a tier folder, and a test that starts more than its
tier allows fails, naming the rule. Checked by running pytest on a miniature suite that has this suite's own
conftest.py, with tests that break each rule beside tests that keep it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.processes import REPO, user_env

UNIT_RULE = "a test of tests/unit/ starts no Ray, no subprocess and no study"

BREAKS_THE_RULES = '''
import subprocess
import sys
import types

import ray


def test_calls_ray_init():
    ray.init(num_cpus=1)


def test_starts_a_subprocess():
    subprocess.run(["true"], check=True)


def test_uses_ray_session(ray_session):
    pass


def test_starts_ray_out_of_sight(monkeypatch):  # as a test that imports Ray itself and starts it would
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True, shutdown=lambda: None))


def test_keeps_the_rule():
    assert sum(range(4)) == 6


def test_imports_a_library_that_probes_for_a_shared_library():  # torch's first import runs ldconfig -p this way
    import ctypes.util

    ctypes.util.find_library("c")
'''

MAY_START_PROCESSES = '''
import subprocess


def test_starts_a_subprocess():
    assert subprocess.run(["true"]).returncode == 0
'''


def _suite(root: Path, files: dict[str, str]) -> None:
    for rel in ("tests", *{str(Path(r).parent) for r in files}):
        for part in [Path(rel), *Path(rel).parents]:
            if str(part) != ".":
                (root / part).mkdir(parents=True, exist_ok=True)
                (root / part / "__init__.py").touch()
    shutil.copy(REPO / "tests" / "conftest.py", root / "tests" / "conftest.py")
    for rel, text in files.items():
        (root / rel).write_text(text)


def _pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                           "--rootdir", str(root), *args], cwd=root, env={**user_env(), "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300)


def test_a_unit_test_that_starts_ray_or_a_process_fails_naming_the_rule(tmp_path):
    _suite(tmp_path, {"tests/unit/core/test_breaks.py": BREAKS_THE_RULES,
                      "tests/ray/test_processes.py": MAY_START_PROCESSES})
    run = _pytest(tmp_path, "-rfE", "tests")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "3 failed, 3 passed, 1 error" in out, out  # the fixture is refused at setup: an error
    said = {line.split("TierError: ", 1)[1] for line in out.splitlines() if "TierError: " in line}
    for test, started in [("test_calls_ray_init", "called ray.init"),
                          ("test_starts_a_subprocess", "started a subprocess (['true'])"),
                          ("test_uses_ray_session", "uses the fixture ray_session, which needs the ray tier"),
                          ("test_starts_ray_out_of_sight", "started Ray")]:
        message = f"tests/unit/core/test_breaks.py::{test} {started}: {UNIT_RULE}"
        assert any(m.startswith(message) and "TIERS['unit']" in m for m in said), (message, said)
    passed = _pytest(tmp_path, "-rA", "tests").stdout
    assert "PASSED tests/unit/core/test_breaks.py::test_keeps_the_rule" in passed, passed
    assert "PASSED tests/unit/core/test_breaks.py::test_imports_a_library_that_probes_for_a_shared_library" in passed
    assert "PASSED tests/ray/test_processes.py::test_starts_a_subprocess" in passed, passed  # the ray tier may


def test_a_test_outside_every_tier_folder_is_refused(tmp_path):
    _suite(tmp_path, {"tests/test_loose.py": "def test_anything():\n    pass\n"})
    run = _pytest(tmp_path, "tests")
    assert run.returncode != 0
    assert "every test lives in a tier folder, tests/{shape,unit,ray,e2e}/" in run.stdout + run.stderr


def test_the_architecture_page_and_the_makefile_name_the_tiers_as_conftest_defines_them():
    from tests.conftest import FIXTURE_TIERS, TIERS

    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = page[page.index("## Tests"):page.index("## How to add")]
    rows = [line.split(" | ") for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| tier", "| ---"))]
    assert [row[0].removeprefix("| ") for row in rows] == list(TIERS)
    for row in rows:
        folder = re.search(r"`tests/(\w+)/", row[1]).group(1)
        assert folder == row[0].removeprefix("| ") and (REPO / "tests" / folder).is_dir(), row
    assert all(f"`{name}`" in section for name in FIXTURE_TIERS)
    # `make check` runs exactly the tiers that start no Ray; `make e2e` the e2e folder
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    check = re.search(r"^check:.*\n\t\$\(PYTEST\) (.*)$", makefile, re.M).group(1).split()
    assert check == [f"tests/{t}" for t, tier in TIERS.items() if not tier.ray]
    assert re.search(r"^e2e:.*\n\t\$\(PYTEST\) tests/e2e$", makefile, re.M)
    assert re.search(r"^test: lint\n\t\$\(PYTEST\)$", makefile, re.M)  # every tier: no folder named


SHARES_A_MODULE_FIXTURE = '''
import os

import pytest


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    with open(os.environ["BUILT_LOG"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    return os.getpid()


@pytest.mark.parametrize("i", range(6))
def test_reads_the_module_fixture(built, i):
    assert built == os.getpid()


@pytest.mark.parametrize("i", range(6))
def test_shares_nothing(i):
    pass
'''


def test_tests_that_share_a_module_fixture_run_in_one_process_that_builds_it_once(tmp_path):
    _suite(tmp_path, {"tests/unit/core/test_shares.py": SHARES_A_MODULE_FIXTURE})
    log = tmp_path / "built.log"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2", "--dist",
                          "loadgroup", "--no-loadscope-reorder", "--rootdir", str(tmp_path), "tests"], cwd=tmp_path,
                         env={**user_env(), "PYTHONPATH": str(tmp_path), "BUILT_LOG": str(log)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "12 passed" in run.stdout, run.stdout + run.stderr
    assert len(log.read_text().split()) == 1  # built once, in the one process that ran its six readers
