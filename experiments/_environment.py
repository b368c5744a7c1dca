"""What the experiment scripts share before raystudy is imported: this checkout on ``sys.path``, Ray's
environment defaults, CPU kernels that give the same numbers on every x86-64 CPU
(:func:`raystudy.cpu_kernels.pin_cpu_kernels`),
and one line saying how to activate ``.venv`` when the Python running them lacks raystudy's dependencies
(``python3 experiments/full_study.py`` outside the virtual environment), instead of a traceback ending in
``No module named 'pyarrow'``.

Only the standard library is imported here, and nothing newer than Python 3.6 is used, so that the hint
reaches whoever runs a script with whatever ``python3`` their shell finds.
"""

import importlib
import importlib.util
import os
import sys

#: the checkout holding ``raystudy/`` (a fresh clone runs without installing it)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the oldest Python raystudy runs on (pyproject.toml's ``requires-python``)
PYTHON = (3, 11)
#: dependencies raystudy's commands import only once they run (``--help`` stays light), looked up here so
#: that a Python without them stops at once rather than minutes into a study
LATER_DEPENDENCIES = ("torch", "ray", "timm")
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


def study_main(prog):
    """``raystudy.commands.study.main``, after putting this checkout on ``sys.path``, Ray's defaults and the
    pinned CPU kernels (:func:`raystudy.cpu_kernels.pin_cpu_kernels`) in the environment; exits with status 2
    and :data:`HINT` (one line on stderr) when this Python lacks the dependencies."""
    sys.path.insert(0, ROOT)  # run from a fresh clone
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from raystudy.cpu_kernels import pin_cpu_kernels  # the standard library only, like this module

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
