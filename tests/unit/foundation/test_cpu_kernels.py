"""The experiment scripts pin the CPU kernels (experiments/_environment.py ``pin_cpu_kernels``) so that the demos
give the same numbers on every x86-64 CPU: each library's variable set before torch loads, a user's own value kept,
and PyTorch's AVX2 kernels asked for only where the CPU has AVX2 and FMA (ATen trusts the variable)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.processes import REPO


def _environment():
    spec = importlib.util.spec_from_file_location("experiments_environment", REPO / "experiments" / "_environment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def clean(monkeypatch):
    for name in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    return monkeypatch


def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 {flags}\n\n")
    return str(path)


def test_every_kernel_is_pinned_on_a_cpu_with_avx2(clean, tmp_path):
    import os

    _environment().pin_cpu_kernels(_cpuinfo(tmp_path, "avx avx2 fma"))
    assert {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "DNNL_MAX_CPU_ISA")} == {
        "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "DNNL_MAX_CPU_ISA": "AVX2"}


def test_a_cpu_without_avx2_keeps_pytorchs_own_choice(clean, tmp_path):
    import os

    _environment().pin_cpu_kernels(_cpuinfo(tmp_path, "avx sse4_2"))
    assert "ATEN_CPU_CAPABILITY" not in os.environ and os.environ["MKL_CBWR"] == "COMPATIBLE"


def test_a_users_own_value_wins_and_other_machines_are_left_alone(clean, tmp_path):
    import os

    clean.setenv("MKL_CBWR", "AUTO")
    env = _environment()
    env.pin_cpu_kernels(_cpuinfo(tmp_path, "avx2 fma"))
    assert os.environ["MKL_CBWR"] == "AUTO" and os.environ["DNNL_MAX_CPU_ISA"] == "AVX2"
    clean.delenv("DNNL_MAX_CPU_ISA")
    clean.setattr("platform.machine", lambda: "aarch64")
    env.pin_cpu_kernels(_cpuinfo(tmp_path, "avx2 fma"))
    assert "DNNL_MAX_CPU_ISA" not in os.environ
