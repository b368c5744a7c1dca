"""What the experiment scripts share before raystudy is imported: this checkout on ``sys.path``, Ray's
environment defaults, CPU kernels that give the same numbers on every x86-64 CPU (:func:`pin_cpu_kernels`),
and one line saying how to activate ``.venv`` when the Python running them lacks raystudy's dependencies
(``python3 experiments/full_study.py`` outside the virtual environment), instead of a traceback ending in
``No module named 'pyarrow'``.

Only the standard library is imported here, and nothing newer than Python 3.6 is used, so that the hint
reaches whoever runs a script with whatever ``python3`` their shell finds.
"""

import importlib
import importlib.util
import os
import platform
import sys

#: the checkout holding ``raystudy/`` (a fresh clone runs without installing it)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the oldest Python raystudy runs on (pyproject.toml's ``requires-python``)
PYTHON = (3, 11)
#: dependencies raystudy's commands import only once they run (``--help`` stays light), looked up here so
#: that a Python without them stops at once rather than minutes into a study
LATER_DEPENDENCIES = ("torch", "ray", "timm")
#: one code path per library that every x86-64 CPU with AVX2 runs alike, whatever its vendor and vector width:
#: PyTorch's own kernels (its AVX-512 ones sum in another order), MKL's GEMM (the CNR branch COMPATIBLE, the only
#: one MKL honours on non-Intel CPUs: it ignores AVX2 there) and oneDNN's (convolution, GELU)
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "DNNL_MAX_CPU_ISA": "AVX2"}
#: the line of a Ctrl-C while raystudy's modules load (exit status 130, as the command's own Ctrl-C)
STARTING = "interrupted (Ctrl-C) during the start-up: nothing had started; run the same command again to start"
HINT = ("{prog}: raystudy's dependencies are not installed in this Python ({python}: {problem}): run "
        "`make venv` then `source .venv/bin/activate`, or use `make demo`")


def missing_dependency():
    """Why this Python cannot run raystudy (too old, or a dependency missing: ``No module named 'pyarrow'``),
    or None. A missing module of raystudy itself is a bug and raises as it is."""
    if sys.version_info < PYTHON:
        return "Python {}.{} or newer is needed, this is {}".format(*PYTHON, sys.version.split()[0])
    try:
        importlib.import_module("raystudy.commands.study")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "raystudy":
            raise
        return str(e)
    for name in LATER_DEPENDENCIES:
        if importlib.util.find_spec(name) is None:
            return f"No module named {name!r}"
    return None


def pin_cpu_kernels(cpuinfo="/proc/cpuinfo"):
    """Put :data:`PINNED_KERNELS` in the environment of an x86-64 machine (a value already there wins).

    The demo pretrains from a random init (300 AdamW steps at lr 1e-2), which amplifies rounding: an AVX2 AMD
    and an AVX-512 Intel CPU ended at other weights (plasticity up to 2x apart, trials' test_acc 0.62 vs
    0.48), and a trial's 50 SGD steps at lr 0.3 move its test_acc by up to 0.02 on their own. The libraries
    read these variables when torch loads them, and Ray's local workers inherit them from this process.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return
    pins = dict(PINNED_KERNELS)
    if not _has_avx2(cpuinfo):  # ATen trusts the variable: AVX2 code would stop a CPU without it
        del pins["ATEN_CPU_CAPABILITY"]
    for name, value in pins.items():
        os.environ.setdefault(name, value)


def _has_avx2(cpuinfo):
    """Whether the CPU has AVX2 and FMA (what ATen's avx2 kernels use), per ``cpuinfo``; False if unreadable."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def study_main(prog):
    """``raystudy.commands.study.main``, after putting this checkout on ``sys.path``, Ray's defaults and the
    pinned CPU kernels (:func:`pin_cpu_kernels`) in the environment; exits with status 2 and :data:`HINT` (one
    line on stderr) when this Python lacks the dependencies."""
    sys.path.insert(0, ROOT)  # run from a fresh clone
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    pin_cpu_kernels()
    try:
        problem = missing_dependency()
    except KeyboardInterrupt:  # raystudy's own line, not a traceback, also while its modules load
        print(f"{prog}: {STARTING}", file=sys.stderr)
        sys.exit(130)
    if problem is not None:
        print(HINT.format(prog=prog, python=sys.executable, problem=problem), file=sys.stderr)
        sys.exit(2)
    from raystudy.commands.study import main

    return main
