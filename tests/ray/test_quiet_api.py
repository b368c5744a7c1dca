"""The Python API is as quiet as the command line, beside another Ray instance."""

from __future__ import annotations

from tests.support.models import STUDY_TINY


def test_the_python_api_prints_no_ray_lines_beside_another_ray_instance(ray_session, tmp_path):
    import subprocess
    import sys

    from tests.e2e.test_terminal import ray_lines
    from tests.support.processes import user_env
    from tests.support.stores import make_store

    assert ray_session.is_initialized()  # this test session's instance: another one on the machine
    store = make_store(tmp_path / "store", n_per_split=(16, 8, 8))
    code = f"""
from raystudy.core.finetune import FinetuneConfig
from raystudy.distributed.train import run_finetune
cfg = FinetuneConfig(model="vit_tiny_patch16_224", model_kwargs={STUDY_TINY!r}, img_size=32, store={store!r},
                     out_dir="run", configuration="MHA", steps=2, batch_size=8, eval_period=2, log_period=1)
summary = run_finetune(cfg)
print("status", summary["status"], summary["steps_completed"])
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=user_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "status ok 2", proc.stdout
    assert ray_lines(proc.stdout + proc.stderr) == [], (proc.stdout + proc.stderr)[-3000:]

