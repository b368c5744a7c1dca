"""What a user sees: the study's own lines (one per finished trial, a periodic summary with an ETA), never
Ray's logs. Progress runs on an injected clock (no sleeping, no wall-clock window); the slow tests run the
demo's CLI and a bare ``init_ray`` in subprocesses and read every line they print."""

from __future__ import annotations

import math
import re
import subprocess
import sys

from raystudy.study.progress import Progress, fmt_seconds
from tests.support.processes import user_env

#: the line formats of Ray's own output (Python loggers, C++ logs, forwarded worker / raylet output)
RAY_LINE_FORMATS = [
    r"^\(.*pid=",                                      # forwarded worker output: (RateActor pid=123) ...
    r"^\d{4}-\d\d-\d\d .*(INFO|WARNING|ERROR)",        # Ray's Python log format: 2026-01-01 10:00:00,000 INFO
    r"^\[\d{4}-.*\.cc:\d+",                            # C++ logs: [2026-01-01 10:00:00,000 E 1 1] core_worker.cc:1
    r"\b(DEBUG|INFO|WARNING|ERROR) \w+\.py:\d+ --",    # Ray's logger format without the date
    r"^(WARNING|ERROR) ",                              # any warning through the root logger's handler
    r"core_worker", r"raylet", r"gcs_server",
    r"Token authentication", r"Progress bars (for operators )?disabled", r"RAY_AUTH_MODE",
    r"site-packages/ray/",                             # a warning or traceback raised inside Ray
    r"Started a local Ray instance", r"View the dashboard",
]
RAY_LINE = re.compile("|".join(f"(?:{p})" for p in RAY_LINE_FORMATS))


def ray_lines(text: str) -> list[str]:
    """The lines of ``text`` (split on newlines and progress-bar carriage returns) in one of Ray's formats."""
    return [ln for ln in re.split(r"[\r\n]+", text) if RAY_LINE.search(ln)]


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# --------------------------------------------------------------------------------------------------
# Progress: counts, ETA, one line per trial, periodic summary (no Ray, no sleeping)
# --------------------------------------------------------------------------------------------------


def test_summary_line_from_the_injected_clock():
    """The summary's counts and elapsed time (the ETA's arithmetic: tests/unit/study/test_study_terminal.py)."""
    clock, lines = FakeClock(), []
    p = Progress(total=10, done_before=4, echo=lines.append, prefix="x", clock=clock)
    assert math.isnan(p.eta()) and "ETA ?" in p.line()  # nothing ended yet: no estimate
    p.running.update({"a", "b"})
    clock.t += 100.0  # 100 s into this launch, 3 trials ended
    p.counts.update(ok=1, diverged=1, failed=1)
    p.show("e")
    assert lines == ["[x] 6/10 done, 2 running, 1 failed, 1 pending (this launch: 1 ok, 1 diverged)"
                     " | elapsed 1m40s, ETA ? | e"]
    p.counts.update(ok=4)  # all remaining trials done
    assert p.eta() == 0.0


def test_one_line_per_finished_trial():
    clock, lines = FakeClock(), []
    p = Progress(total=3, done_before=0, echo=lines.append, prefix="demo", clock=clock)
    p.running.update({"t1", "t2"})
    clock.t += 30.0
    p.trial_finished("t1", {"status": "ok", "test_acc": 0.4123, "wall_seconds": 29.6})
    clock.t += 30.0
    p.trial_finished("t2", {"status": "failed", "test_acc": float("nan"), "wall_seconds": None, "error": "boom"})
    assert lines == [
        "[demo] ok t1: test acc 0.412 (30s) | 1/3 done, ETA ?",  # the first finish: the start-up's time
        "[demo] failed t2: no test acc: boom | 1/3 done, ETA 30s",
    ]
    assert p.running == set() and p.counts == {"ok": 1, "diverged": 0, "failed": 1}


def test_a_trial_that_asked_for_gpus_and_ran_on_the_cpu_is_said_once():
    from raystudy.distributed.devices import no_cuda_message

    clock, lines = FakeClock(), []
    p = Progress(total=3, done_before=0, echo=lines.append, prefix="gpu", clock=clock)
    warning = no_cuda_message(0.5, 1)
    for tid in ("t1", "t2"):
        p.trial_finished(tid, {"status": "ok", "test_acc": 0.5, "wall_seconds": 1.0, "device_warning": warning})
    p.trial_finished("t3", {"status": "ok", "test_acc": 0.5, "wall_seconds": 1.0, "device_warning": None})
    notes = [line for line in lines if "note:" in line]
    assert notes == [f"[gpu] note: t1: {warning} (every trial it happened to: device_warning in trials.parquet; "
                     "this note is not repeated)"] and len(lines) == 4
    assert "gpus_per_worker=0.5 but CUDA sees no device" in warning and "1 thread(s)" in warning


def test_worker_device_falls_back_to_the_cpu_only_with_a_reason(monkeypatch):
    import torch

    from raystudy.distributed.devices import worker_device

    threads = torch.get_num_threads()
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
        device, warning = worker_device(1.0, 2)
        assert device.type == "cpu" and torch.get_num_threads() == 2
        assert "gpus_per_worker=1 but CUDA sees no device" in warning and "CUDA_VISIBLE_DEVICES='0'" in warning
        assert worker_device(0.0, 1) == (torch.device("cpu"), None)  # asked for none: nothing to say
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert worker_device(0.5, 1) == (torch.device("cuda"), None)
    finally:
        torch.set_num_threads(threads)


def test_periodic_summary_every_interval():
    clock, lines = FakeClock(), []
    p = Progress(total=5, done_before=0, echo=lines.append, prefix="s", clock=clock, every=60.0)
    assert not p.tick() and lines == []
    clock.t += 59.0
    assert not p.tick()
    clock.t += 1.0
    assert p.tick() and len(lines) == 1 and lines[0].startswith("[s] 0/5 done")
    clock.t += 30.0
    assert not p.tick()  # the interval restarts at each summary
    p.show()  # an explicit summary restarts it too
    clock.t += 59.0
    assert not p.tick() and len(lines) == 2


def test_fmt_seconds():
    assert [fmt_seconds(s) for s in (0.4, 59.6, 125, 7260, math.nan)] == ["0s", "1m00s", "2m05s", "2h01m", "?"]


def test_ray_line_formats_match_what_ray_prints():
    """The regexes catch the lines seen in `make demo` before the terminal was made quiet (and not ours)."""
    seen = [
        "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.",
        "2026-12-01 07:20:02,503\tINFO streaming_executor.py:215 -- Starting execution of Dataset dataset_0.",
        "[2026-12-01 07:20:02,570 E 9330 9330] core_worker.cc:2465: Actor with class name: 'MapWorker'",
        "2026-12-01 07:20:02,574\tWARNING __init__.py:28 -- Progress bars disabled. To enable, set ...",
        "(MapWorker(MapBatches(RateActor)) pid=123) hello",
        "\x1b[33m(raylet)\x1b[0m WARNING: 4 PYTHON worker processes have been started on node",
    ]
    assert [ray_lines(s) for s in seen] == [[s] for s in seen]
    ours = "[demo] ok t1: test acc 0.412 (30s) | 1/3 done, ETA 1m00s\rplasticity vit: 50%|#####| 8/16\n"
    assert ray_lines(ours) == []


# --------------------------------------------------------------------------------------------------
# Subprocesses: the real terminal
# --------------------------------------------------------------------------------------------------


def test_init_ray_starts_a_local_instance_silently():
    code = ("from raystudy.distributed.cluster import init_ray\nimport ray\n"
            "assert init_ray(num_cpus=1)\nassert ray.cluster_resources()['CPU'] == 1\nray.shutdown()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=user_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "" and proc.stderr == "", (proc.stdout, proc.stderr)


def test_demo_cli_prints_only_raystudy_lines(demo_study):
    """``make demo`` (``conftest.demo_study``): every line it prints is the study's own or a progress bar."""
    out = demo_study["stdout"] + demo_study["stderr"]
    assert demo_study["returncode"] == 0, out[-4000:]
    assert ray_lines(out) == [], out[-4000:]
    assert "\r" not in out  # captured, not a terminal: progress as plain lines (raystudy.terminal)
    lines = demo_study["stdout"].splitlines()
    for tid in ("shift-color-MHA-sgd-lr0.03-s0", "shift-color-Head-sgd-lr0.03-s0"):
        assert [ln for ln in lines if ln.startswith(f"[demo] ok {tid}: test acc ")], demo_study["stdout"]
    assert any(ln.startswith("[demo] 48/48 done, 0 running, 0 failed, 0 pending") for ln in lines), demo_study["stdout"]
    assert any("plasticity done" in ln for ln in lines)
    # the final map: every table the study wrote, a restore command with the study's trainable, the resume
    results = next(ln for ln in lines if ln.strip().startswith("results:"))
    for table in ("trials", "curves", "changes", "plasticity", "rates", "bounds"):
        assert f"{table}.parquet" in results, results
    assert any("restore_tuner(tune_experiments(" in ln for ln in lines) and "Tuner.restore" not in out
    assert any(ln.strip().startswith("resume:      raystudy study --resume ") for ln in lines)
