"""Inputs a study cannot use, each named in one line: a cluster that wants Ray's token, a summary that is not
UTF-8, a checkpoint whose pickle ``torch.load(weights_only=True)`` refuses; and ``raystudy status`` counting
failed rows and checkpointed unfinished trials."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.processes import REPO, free_port, user_env, wait_for_port

# ---------------------------------------------------------------------------------------------------------
# A token-auth cluster joined without RAY_AUTH_MODE=token


# ~35 s on 2 busy cores: one `ray start --head` (its own temp dir and HOME) and one short command
def test_a_token_cluster_joined_without_the_token_mode_is_one_line_and_writes_nothing(tmp_path):
    home = tmp_path / "home"  # the head's and the driver's ~/.ray/auth_token: never the user's
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    ray_tmp = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    port = free_port()
    env = {**user_env(), "HOME": str(home)}
    ray = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen([ray, "start", "--head", "--port", str(port), "--num-cpus", "1", "--temp-dir", ray_tmp,
                             "--disable-usage-stats", "--block"], env={**env, "RAY_AUTH_MODE": "token"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = tmp_path / "study"
    try:
        wait_for_port(port, head)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "raystudy", "study", "--preset", "demo", "--address",
                               f"127.0.0.1:{port}", "--out", str(out)], env=env, capture_output=True, text=True,
                              timeout=120)
        elapsed = time.monotonic() - t0  # from the process's start: Python's and raystudy's imports included
    finally:
        head.terminate()  # `ray start --block` stops its own node on SIGTERM; never a machine-wide `ray stop`
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        current = Path("/tmp/ray/ray_current_cluster")  # read by address="auto": never left naming this head
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and proc.stdout == "", (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "RAY_AUTH_MODE=token" in lines[0] and str(home / ".ray" / "auth_token") in lines[0], lines[0]
    assert "InvalidAuthToken" not in proc.stderr and "Traceback" not in proc.stderr
    # seconds, not Ray's ~20-40 s of retries (measured 1-3 s on a quiet machine, 6.7-8.5 s on 2 busy cores)
    assert elapsed < 15, elapsed
    assert not out.exists()  # no spec.yaml, no lock, no built-in data, no pretrained model


def test_the_token_check_asks_only_a_named_cluster_and_reads_its_refusal(monkeypatch, tmp_path):
    """A gRPC server that refuses every call as Ray's GCS refuses a driver without its token (no Ray)."""
    from concurrent import futures

    import grpc

    from raystudy.distributed.cluster import ClusterAuthError, auth_problem, check_cluster_auth

    class Refuse(grpc.GenericRpcHandler):
        def service(self, details):
            self.methods = [*getattr(self, "methods", []), details.method]
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: ctx.abort(
                grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing or incorrect"))

    handler, server = Refuse(), grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    try:
        for address in (None, "local", "auto", f"ray://127.0.0.1:{port}"):  # not a GCS address: never asked
            assert auth_problem(address) is None
        assert getattr(handler, "methods", []) == []
        problem = auth_problem(f"127.0.0.1:{port}")
        assert handler.methods == ["/ray.rpc.NodeInfoGcsService/GetClusterId"]
        assert problem and "RAY_AUTH_MODE=token" in problem and str(tmp_path / "token") in problem, problem
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        with pytest.raises(ClusterAuthError, match="RAY_AUTH_MODE=token"):
            check_cluster_auth(None)
        monkeypatch.setenv("RAY_AUTH_MODE", "token")  # the driver sends its token: Ray's own answer stands
        assert auth_problem(f"127.0.0.1:{port}") is None and len(handler.methods) == 2
    finally:
        server.stop(None)
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert auth_problem(f"127.0.0.1:{port}") is None  # nothing listens: left to Ray


# ---------------------------------------------------------------------------------------------------------
# A summary that is not UTF-8


def test_a_summary_that_is_not_utf8_counts_its_trial_as_failed_naming_the_file(tmp_path, caplog):
    from raystudy.study.points import grid_point
    from raystudy.study.results import ResultTables, trial_dir

    study = str(tmp_path / "s")
    points = [grid_point("color", "MHA", "sgd", lr, 0) for lr in (0.1, 0.2)]
    bad = points[0]["trial_id"]
    path = Path(trial_dir(study, bad)) / "summary.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"status": "ok", "note": "\xff\xfe"}')  # 0xff never starts a UTF-8 character
    tables = ResultTables(study)
    with caplog.at_level("WARNING"):
        assert tables.reconcile(points, STUDY_MODEL, STUDY_TINY) == []  # planning goes on; nothing final
    assert tables.status(bad) == "failed" and bad not in tables.done_ids()  # failed: launched again
    assert tables.rows[bad]["error"].startswith(f"{path}: not UTF-8 text")
    assert tables.status(points[1]["trial_id"]) is None
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and said[0].startswith(f"{path}: not UTF-8 text") and "runs again" in said[0], said


# ---------------------------------------------------------------------------------------------------------
# A checkpoint whose pickle torch.load(weights_only=True) refuses


class _Payload:
    """Pickles as a call of ``os.mkdir(marker)``: loading it with ``weights_only=False`` would create the
    marker; ``weights_only=True`` refuses the global and runs nothing."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("refused", ["state.pt", "rng_rank0.pt"])
def test_a_checkpoint_file_holding_a_refused_pickle_is_moved_aside_and_the_run_goes_on(tmp_path, refused):
    """The newest checkpoint's file is a zip archive (whole CRCs) whose pickle calls ``os.mkdir``: the resume
    moves it aside (named), restarts from the checkpoint before it, never runs the payload, and no message
    carries PyTorch's advice to load with ``weights_only=False``."""
    import dataclasses

    import torch

    from raystudy.core.finetune import FinetuneConfig, train_local
    from tests.support.stores import make_store

    store = make_store(tmp_path / "store", n_per_split=(16, 8, 8))
    ck, marker = tmp_path / "ck", tmp_path / "payload-ran"
    cfg = FinetuneConfig(model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32, store=store, configuration="MHA",
                         steps=6, batch_size=8, eval_period=2, checkpoint_period=2, lr=0.1,
                         out_dir=str(tmp_path / "a"))
    first, _ = train_local(cfg, checkpoint_dir=ck, tensorboard=False)  # leaves checkpoint_00000002 and _00000004
    torch.save({"step": 4, "rng": _Payload(marker)}, ck / "checkpoint_00000004" / refused)
    again, _ = train_local(dataclasses.replace(cfg, out_dir=str(tmp_path / "b")), checkpoint_dir=ck, resume=True,
                           tensorboard=False)
    assert not marker.exists()  # nothing in the file ran
    assert again["status"] == "ok" and again["restored_from_step"] == 2 and again["checkpoints_skipped"] == 1
    assert again["test_acc"] == first["test_acc"]  # resumed exactly: the same run as the uninterrupted one
    (warning,) = again["checkpoint_warnings"]
    assert str(ck / "checkpoint_00000004" / refused) in warning and ".corrupt-1" in warning, warning
    assert "refused: it holds Python objects other than tensors" in warning and "nothing in it was run" in warning
    assert "weights_only" not in warning
    assert (ck / "checkpoint_00000004.corrupt-1" / refused).is_file()  # kept, never read again


def test_no_message_of_the_package_passes_on_torchs_weights_only_advice():
    """Every ``torch.load`` of the package is ``weights_only=True`` and sits where its errors are rewritten
    (:func:`raystudy.core.tensors.torch_load_reason`): the call sites are the known ones."""
    import re

    root = REPO / "raystudy"
    calls = {str(p.relative_to(root)) for p in root.rglob("*.py")
             for line in p.read_text().splitlines() if re.search(r"\btorch\.load\(", line)}
    assert calls == {"core/tensors.py", "core/models.py", "core/finetune/state.py"}, calls
    for p in root.rglob("*.py"):
        for line in p.read_text().splitlines():
            if re.search(r"\btorch\.load\(", line):
                assert "weights_only=True" in line, (p, line)
