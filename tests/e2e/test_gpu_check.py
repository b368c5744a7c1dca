"""``benchmarks/gpu_check.py --smoke`` (issue #22 item 5): every section of the GPU check runs on the CPU on a
tiny model and writes its JSON, whose numbers are consistent with independent counts, and whose ``mfu`` /
``peak_tflops`` / ``device`` are what ``raystudy study --dry-run --gpu-result`` reads."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.processes import REPO

BENCH = REPO / "benchmarks"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH))
    out = tmp_path_factory.mktemp("gpu_check") / "check.json"
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 0
    return json.loads(out.read_text(encoding="utf-8")), gpu_check.SMOKE


def test_every_section_measured(result):
    data, params = result
    assert data["device"] == "cpu" and set(data["seconds"]) == {"step", "data_path", "plasticity", "actor"}
    steps = {r["configuration"]: r for r in data["step"]}
    assert set(steps) == set(params["configurations"]) and all(r["precision"] == "fp32" for r in data["step"])
    # a tiny ViT (d = 48, 16 tokens + cls, 3 blocks): All trains ~3x its forward, Head alone 1x
    assert 2.8 < steps["All"]["train_x_forward"] < 3.0
    assert steps["Head"]["train_x_forward"] == pytest.approx(1, abs=0.01)
    d, n, blocks = 48, 17, 3
    per_block = 2 * n * (4 * d * d + 8 * d * d) + 4 * n * n * d  # qkv + proj + fc1 + fc2, then q k^T and a v
    patch = 2 * 16 * (3 * 8 * 8) * d
    assert steps["All"]["gflops_forward"] * 1e9 == pytest.approx(blocks * per_block + patch + 2 * d * 10, rel=1e-3)
    assert all(r["images_per_s"] > 0 and r["mfu"] is None for r in data["step"])  # no peak on a CPU
    assert data["data_path"]["cache_images_per_s"] > 0 and data["data_path"]["decode_images_per_s"] > 0
    split = data["data_path"]["split"]
    assert set(split) == {"cache", "decode"}
    for s in split.values():  # ms per step of each phase, their sum the step, images over the summed time
        assert s["step"] == pytest.approx(sum(s[k] for k in ("fetch", "augment", "forward_backward", "optimizer",
                                                           "bookkeeping")))
        assert s["images_per_s"] == pytest.approx(params["batch"] / (s["step"] / 1e3))
    assert data["data_path"]["cache_vs_decode_end_to_end"] == pytest.approx(
        split["cache"]["images_per_s"] / split["decode"]["images_per_s"])
    assert data["plasticity"]["cpu_core_pairs_per_s"] > 0
    actor = data["actor"]
    assert actor["trials"] == params["trials"] == len(actor["overhead_s"]) == len(actor["memory_after_trial"])
    assert all(o > 0 for o in actor["overhead_s"]) and all(m["rss_mib"] > 0 for m in actor["memory_after_trial"])
    assert data["mfu"] == {} and data["peak_tflops"] == {}


def test_its_json_is_what_the_dry_run_reads(result, tmp_path):
    from raystudy.study.cost import read_gpu_result

    data, _ = result
    gpu = {**data, "device": "NVIDIA H200", "mfu": {"bf16": 0.41}, "peak_tflops": {"bf16": 989.0}}
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(gpu), encoding="utf-8")
    assert read_gpu_result(str(path), "bf16") == (0.41, 989.0, "NVIDIA H200")
    with pytest.raises(ValueError, match="mfu.fp32"):
        read_gpu_result(str(path), "fp32")


def test_the_step_split_times_the_training_step_a_plain_loop_takes():
    """``step_split`` trains as a plain loop does (one warm-up step, then one per batch: the same weights
    after), and its phases are the step's: each measured, their sum the step."""
    import torch

    sys.path.insert(0, str(BENCH))
    try:
        from data_path_bench import PHASES, step_split
    finally:
        sys.path.remove(str(BENCH))

    torch.manual_seed(0)
    xs = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    ys = [torch.tensor([0, 1, 2, 1]) for _ in range(3)]

    class Data:  # a decode-path-like source: (x, y) of the rows asked
        def batch(self, rows, **kw):
            return xs[int(rows[0])], ys[int(rows[0])]

    def model():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3))

    timed, plain = model(), model()
    split = step_split(timed, Data(), [[0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2]], size=8, device=torch.device("cpu"))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    for k in (0, 0, 1, 2):
        torch.nn.functional.cross_entropy(plain(xs[k]), ys[k]).backward()
        optimizer.step()
        optimizer.zero_grad()
    for a, b in zip(timed.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    assert all(split[k] > 0 for k in PHASES)
    assert split["step"] == pytest.approx(sum(split[k] for k in PHASES))
    assert split["images_per_s"] == pytest.approx(4 / (split["step"] / 1e3))
