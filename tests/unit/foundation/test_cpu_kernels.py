"""The CPU kernels a command run from the shell pins (raystudy/cpu_kernels.py) so that the demos give the same
numbers on every x86-64 CPU: each library's variable set before torch loads, a user's own value kept, other
machines left alone; ``raystudy`` from the shell and the experiment scripts pin, ``main([...])`` called from
Python does not. That the pinned kernels make the numbers independent of the CPU's own:
tests/e2e/test_cpu_numbers.py."""

from __future__ import annotations

import os

import pytest

from raystudy.cpu_kernels import PINNED_KERNELS, pin_cpu_kernels

NAMES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "DNNL_MAX_CPU_ISA")


@pytest.fixture
def clean(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    return monkeypatch


def test_every_x86_64_cpu_gets_the_baseline_kernels(clean):
    assert pin_cpu_kernels() == {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
                                 "DNNL_MAX_CPU_ISA": "SSE41"}
    assert {k: os.environ[k] for k in NAMES} == PINNED_KERNELS


def test_a_users_own_value_wins_and_other_machines_are_left_alone(clean):
    clean.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert pin_cpu_kernels()["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["MKL_CBWR"] == "COMPATIBLE"
    for name in NAMES:
        clean.delenv(name)
    clean.setattr("platform.machine", lambda: "aarch64")
    assert pin_cpu_kernels() == {} and not any(name in os.environ for name in NAMES)


def test_the_command_line_pins_and_a_call_from_python_does_not(clean, capsys):
    from raystudy.cli import main

    assert main([]) == 2  # no command: the help
    assert not any(name in os.environ for name in NAMES)
    clean.setattr("sys.argv", ["raystudy"])
    assert main() == 2
    assert {k: os.environ[k] for k in NAMES} == PINNED_KERNELS
    capsys.readouterr()
