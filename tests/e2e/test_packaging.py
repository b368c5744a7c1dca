"""A wheel built from the repository works when installed (not editable) into a fresh virtual environment.

The wheel is built from a copy of the sources (the repository stays clean), installed with ``--no-deps``
into a new venv; the dependencies come from the running interpreter's site-packages through a ``.pth``
line, so nothing is downloaded. Everything then runs from a temporary folder, away from the repository, so
the presets can only come from the installed package data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support.processes import REPO


def _run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_NO_INDEX"] = "1"  # never reach a package index
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """A fresh venv with the wheel installed: ``{"python", "raystudy", "cwd"}``."""
    root = tmp_path_factory.mktemp("packaging")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "raystudy", src / "raystudy", ignore=shutil.ignore_patterns("__pycache__"))
    built = _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-v", "-w",
                  str(root / "dist")], cwd=src)
    # the licence as an SPDX expression: setuptools warns about the older table form at every install
    assert "project.license" not in built.stdout + built.stderr, built.stderr[-2000:]
    wheels = list((root / "dist").glob("raystudy-*.whl"))
    assert len(wheels) == 1, wheels

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=root)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheels[0])], cwd=root)
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=root).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "zz_raystudy_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    cwd = root / "work"
    cwd.mkdir()
    return {"python": python, "raystudy": venv / "bin" / "raystudy", "cwd": cwd, "purelib": purelib}


def test_wheel_ships_the_package_and_its_presets(installed):
    out = _run([str(installed["python"]), "-c",
                "import raystudy, raystudy.study.spec as s; print(raystudy.__file__); "
                "print(' '.join(s.preset_names()))"], cwd=installed["cwd"]).stdout.split("\n")
    where = Path(out[0]).resolve()
    assert where.is_relative_to(installed["purelib"].resolve()), where  # the installed copy ...
    assert not where.is_relative_to(REPO), where  # ... not the repository's sources
    assert set(out[1].split()) >= {"demo", "paper", "paper-vtab1k", "plasticity-demo", "plasticity-paper"}


def test_installed_cli_runs_the_demo_dry_run(installed):
    proc = _run([str(installed["raystudy"]), "study", "--preset", "demo", "--dry-run"], cwd=installed["cwd"])
    out = proc.stdout
    assert f"study 'demo' -> {installed['cwd'] / 'results' / 'demo'}" in out
    # The demo preset: 2 datasets x 6 configurations (the five components, Head) x 2 lrs x 2 seeds.
    assert "6 configuration(s)" in out and "grid: 48 trials, 0 done, 48 to run" in out
    assert "256 pairs per dataset (embedding), beside its random_init control (seed 0)" in out
    assert "shift-color-FC2-sgd-lr0.3-s1" in out and "... and 28 more" in out  # the first 20 trial ids
    assert not (installed["cwd"] / "results").exists()  # a dry run writes nothing


def test_installed_version_two_ways(installed):
    from raystudy import __version__

    for cmd in ([str(installed["raystudy"]), "--version"], [str(installed["python"]), "-m", "raystudy", "--version"]):
        assert _run(cmd, cwd=installed["cwd"]).stdout.strip() == f"raystudy {__version__}"
    assert __version__ == _pyproject_version()


def _pyproject_version() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
