"""Errors on arguments come before torch, Ray and pandas load (issue #45, item 6): ``raystudy status`` of a
folder that holds no study, ``analyze`` / ``report`` of one without tables or with a misspelt ``--reference``,
a misspelt ``--configurations`` name (a flag's, or ``--set``'s) answer in a fresh interpreter without
importing any of them, and as a user runs them (``python -m raystudy``) within 2 s. Measured on 2 cores
without a bytecode cache: 0.44-0.68 s at a load average of 2 (as a ``--set`` error), 1.2-2.2 s at 15, where
the imports came first: 4.6-5.4 s at 2, 24-31 s at 15."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.support.processes import REPO, user_env
from tests.support.study_tables import make_study

#: what each argument error must not have imported
HEAVY = ("torch", "ray", "pandas", "matplotlib", "scipy")
#: the slowest of these answers may take, as a user runs them (the fastest of a few runs: load spikes left out)
BOUND_S = 2.0

IN_FRESH_PROCESS = """
import io, json, sys
from contextlib import redirect_stderr
from raystudy.cli import main
err = io.StringIO()
with redirect_stderr(err):
    rc = main(json.loads(sys.argv[1]))
print(json.dumps({"rc": rc, "err": err.getvalue(), "loaded": [m for m in json.loads(sys.argv[2]) if m in sys.modules]}))
"""


def _cases(tmp_path) -> list[tuple[list[str], str]]:
    nowhere = tmp_path / "nowhere"
    study = make_study(tmp_path / "study", plasticity=False, bounds=False, curves=False)
    out = ["--out", str(tmp_path / "demo"), "--dry-run"]
    return [
        (["status", str(nowhere)], f"raystudy status: error: {nowhere} holds no study (spec.yaml not found)"),
        (["analyze", str(nowhere)], f"raystudy analyze: error: {nowhere}: neither trials.parquet nor "
                                    "plasticity.parquet found; is this a study directory?"),
        (["report", str(nowhere), "--no-figures"], f"raystudy report: error: {nowhere}: neither trials.parquet "
                                                   "nor plasticity.parquet found; is this a study directory?"),
        (["analyze", str(study), "--reference", "mha"], "raystudy analyze: error: reference: unknown value 'mha'; "
                                                        "did you mean 'MHA'? expected one of ['LN1', "),
        (["study", "--configurations", "MHA,fc1", *out], "raystudy study: error: configurations: invalid "
                                                         "configuration 'fc1': unknown name 'fc1'; did you mean "
                                                         "'FC1'?"),
        (["study", "--set", "configurations=[MHA, Mha]", *out], "raystudy study: error: configurations: invalid "
                                                                "configuration 'Mha': unknown name 'Mha'; did you "
                                                                "mean 'MHA'?"),
    ]


def test_argument_errors_import_neither_torch_nor_ray_nor_pandas(tmp_path):
    for argv, said in _cases(tmp_path):
        proc = subprocess.run([sys.executable, "-c", IN_FRESH_PROCESS, json.dumps(argv), json.dumps(HEAVY)],
                              capture_output=True, text=True, env=user_env(), cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got = json.loads(proc.stdout.splitlines()[-1])
        assert got["rc"] == 2 and got["err"].startswith(said) and got["err"].count("\n") == 1, (argv, got)
        assert got["loaded"] == [], (argv, got)


def test_an_argument_error_answers_within_two_seconds(tmp_path):
    """``raystudy status`` of a folder without a study, as a user runs it: the fastest of three runs (the CLI's
    own start: Python, pyarrow, the commands' parsers; no bytecode cache where PYTHONDONTWRITEBYTECODE is set)."""
    argv, said = _cases(tmp_path)[0]
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "raystudy", *argv], capture_output=True, text=True,
                              env=user_env(), cwd=REPO, timeout=120)
        times.append(time.monotonic() - t0)
        assert proc.returncode == 2 and proc.stderr.startswith(said), proc.stderr[-2000:]
    assert min(times) < BOUND_S, (argv, times)
