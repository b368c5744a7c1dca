"""The cost a ``--dry-run`` prints (#22 item 4): FLOPs per image against a ViT's count by hand, the rule for
frozen configurations, the evaluations' rows from a miniature store, GPU-hours at a stated MFU, and the
``paper`` preset's ``--dry-run --json``."""

from __future__ import annotations

import json
import math
import time

import pytest

from raystudy.cli import main as cli
from raystudy.study import cost
from raystudy.study.spec import StudySpec
from tests.support.stores import make_store

PAPER_MODEL = "vit_base_patch16_224.orig_in21k"


def vit_parts(*, tokens: int, d: int, mlp: int, patches: int, patch: int, classes: int, chans: int = 3) -> dict:
    """FLOPs (2 per multiply-add) of one image through each matrix product of a ViT block, by hand."""
    return {
        "qkv": 2 * tokens * d * 3 * d, "proj": 2 * tokens * d * d,
        "fc1": 2 * tokens * d * mlp, "fc2": 2 * tokens * mlp * d,
        "attn": 2 * (2 * tokens * tokens * d),  # q k^T and a v, summed over the heads
        "patch": 2 * patches * d * chans * patch * patch, "head": 2 * d * classes,
    }


def vit_forward(p: dict, depth: int) -> int:
    return depth * (p["qkv"] + p["proj"] + p["fc1"] + p["fc2"] + p["attn"]) + p["patch"] + p["head"]


# ViT-B/16 at 224: 196 patches + the class token, d 768, MLP 3072, 12 blocks; a 10-class head
B16 = vit_parts(tokens=197, d=768, mlp=3072, patches=196, patch=16, classes=10)
DEPTH = 12


def _hand_backward(p: dict, depth: int) -> dict[str, int]:
    """The backward each configuration costs by the rule (train_final_norm: the gradient reaches the head's
    input): a trained weight 2x its forward, a frozen layer above the lowest trained one 1x, one below 0x."""
    block = p["qkv"] + p["proj"] + p["fc1"] + p["fc2"]
    rest = depth - 1
    return {
        "All": 2 * (depth * (block + p["attn"]) + p["head"]) + p["patch"],  # the patch embedding: its weight only
        "Head": 2 * p["head"],
        # block 0's norm1 trains: every product's input gradient, down to block 0's qkv
        "LN1": depth * (block + 2 * p["attn"]) + 2 * p["head"],
        # qkv and proj train in every block; block 0's qkv needs no input gradient
        "MHA": depth * (block + p["qkv"] + p["proj"] + 2 * p["attn"]) - p["qkv"] + 2 * p["head"],
        # block 0: from its norm2 up (fc1, fc2 input gradients), then every block above
        "LN2": p["fc1"] + p["fc2"] + rest * (block + 2 * p["attn"]) + 2 * p["head"],
        # block 0: fc1's weight gradient and fc2's input gradient
        "FC1": p["fc1"] + p["fc2"] + rest * (block + p["fc1"] + 2 * p["attn"]) + 2 * p["head"],
        # block 0: fc2's weight gradient only; nothing below it
        "FC2": p["fc2"] + rest * (block + p["fc2"] + 2 * p["attn"]) + 2 * p["head"],
    }


def test_vit_b16_forward_is_the_hand_count_and_35_1_gflops():
    f = cost.image_flops(PAPER_MODEL, "All", img_size=224, num_classes=10, train_final_norm=True)
    assert f.device == "meta" and f.counted  # shapes only: no weights allocated, nothing downloaded
    assert f.forward == vit_forward(B16, DEPTH)
    assert f.forward / 1e9 == pytest.approx(35.1, rel=0.002)


def test_all_trains_at_3x_the_forward_and_frozen_configurations_less():
    forward = vit_forward(B16, DEPTH)
    hand = _hand_backward(B16, DEPTH)
    got = {c: cost.image_flops(PAPER_MODEL, c, img_size=224, num_classes=10, train_final_norm=True)
           for c in hand}
    for c, f in got.items():
        assert f.forward == forward, c
        assert f.backward == hand[c], c
    assert got["All"].train == pytest.approx(3 * 35.1e9, rel=0.02)
    assert got["All"].train == 3 * forward - B16["patch"]  # nothing needs the image's gradient
    order = ["Head", "LN2", "LN1", "FC2", "FC1", "MHA", "All"]  # cheapest to dearest
    assert [got[c].train for c in order] == sorted(got[c].train for c in order)
    assert got["Head"].train == pytest.approx(forward, rel=1e-5)  # the head and the final norm only
    # without train_final_norm the head's input needs no gradient: its weight gradient alone
    alone = cost.image_flops(PAPER_MODEL, "Head", img_size=224, num_classes=10)
    assert alone.backward == B16["head"]


def test_budgets_count_the_units_they_resolve_to():
    spec = StudySpec.from_dict({"model": PAPER_MODEL, "img_size": 224, "datasets": {"a": "a"},
                                "configurations": ["random:5%", "auto:5%"], "seeds": [0]})
    chosen, note = cost.counted_selection(spec, "a", "random:5%", 0)
    assert note == "" and "@" in chosen  # the units, e.g. MHA@3+FC1@10
    auto, note = cost.counted_selection(spec, "a", "auto:5%", 0)  # no plasticity table: random:5%'s, noted
    assert auto == chosen and "estimated as random:5%" in note
    assert cost.counted_selection(spec, "a", "MHA+FC1", 0) == ("MHA+FC1", "")


def test_auto_is_counted_with_the_models_plasticity_not_its_controls():
    """A study's plasticity table holds the random-init control's rows beside the model's (weights column):
    auto:B packs by the model's own rows, as a trial does (raystudy.study.jobs.plasticity_of)."""
    import pandas as pd

    from raystudy.vocab import COMPONENTS, PRETRAINED, RANDOM_INIT

    spec = StudySpec.from_dict({"model": PAPER_MODEL, "img_size": 224, "datasets": {"a": "a"},
                                "configurations": ["auto:5%"], "seeds": [0]})
    units = [(c, b) for c in COMPONENTS for b in range(DEPTH)]
    rows = [{"dataset": "a", "mode": "embedding", "component": c, "layer": b, "weights": w,
             "plasticity": (9.0 if (c, b) == ("FC1", 4) else 1.0) if w == PRETRAINED else
             (9.0 if (c, b) == ("MHA", 7) else 1.0)} for w in (PRETRAINED, RANDOM_INIT) for c, b in units]
    chosen, note = cost.counted_selection(spec, "a", "auto:5%", 0, pd.DataFrame(rows))
    assert note == "" and "FC1@4" in chosen and "MHA" not in chosen  # one big unit: the model's most plastic


# ---------------------------------------------------------------------------------------------------------
# a miniature study: evaluations from the store's rows
# ---------------------------------------------------------------------------------------------------------

TINY = {"patch_size": 8, "embed_dim": 64, "depth": 4, "num_heads": 4}


def _tiny_spec(tmp_path, **fields) -> StudySpec:
    store = make_store(tmp_path / "tiny-store", n_per_split=(30, 5, 7), num_classes=3)
    data = {"name": "tiny", "out": str(tmp_path / "study"), "model": "vit_tiny_patch16_224", "model_kwargs": TINY,
            "weights": None, "img_size": 32, "datasets": {"tiny": store}, "configurations": ["Head"],
            "optimizers": {"sgd": [0.1, 0.01]}, "seeds": [0], "steps": 10, "eval_period": 4, "batch_size": 8,
            "precision": "fp32", "val_split": "fixed", "probe": {"enabled": True},
            "plasticity": {"enabled": False}, "max_concurrent_trials": 2, "gpus_per_worker": 1}
    data.update(fields)
    return StudySpec.from_dict(data)


def test_tiny_forward_is_the_hand_count():
    f = cost.image_flops("vit_tiny_patch16_224", "Head", model_kwargs=TINY, img_size=32, num_classes=3)
    tiny = vit_parts(tokens=17, d=64, mlp=256, patches=16, patch=8, classes=3)
    assert f.forward == vit_forward(tiny, 4) and f.backward == tiny["head"]


@pytest.mark.parametrize("val_split, val_rows", [("fixed", 5), ("per_seed", 35 - int(0.8 * 35))])
def test_eval_and_probe_flops_from_the_stores_rows(tmp_path, val_split, val_rows):
    spec = _tiny_spec(tmp_path, val_split=val_split)
    f = cost.image_flops("vit_tiny_patch16_224", "Head", model_kwargs=TINY, img_size=32, num_classes=3)
    c = cost.study_cost(spec)
    d = c["datasets"]["tiny"]
    evaluations = 3  # steps 4, 8 and the last, 10
    assert cost.evaluations(10, 4) == evaluations and cost.evaluations(8, 4) == 2
    assert d["rows"] == {"val": val_rows, "test": 7, "probe": 30 + 7} and d["eval_counted"]
    assert d["trials"] == 2 and d["num_classes"] == 3
    assert d["flops_train"] == 2 * 10 * 8 * f.train
    assert d["flops_eval"] == 2 * f.forward * (evaluations * val_rows + 7)
    assert d["flops_probe"] == f.forward * 37  # the linear probe: the train and test rows once
    assert d["flops"] == d["flops_train"] + d["flops_eval"] + d["flops_probe"] == c["total"]["flops"]
    # fp32 with TF32 off: 67 TFLOP/s; MFU 0.35 assumed; K = 2 concurrent trials x 1 worker x 1 GPU
    assert (c["precision"], c["peak_tflops"], c["mfu"], c["gpus"]) == ("fp32", 67.0, 0.35, 2.0)
    assert d["gpu_hours"] == pytest.approx(d["flops"] / (67e12 * 0.35) / 3600)
    assert d["wall_hours"] == pytest.approx(d["gpu_hours"] / 2)


def test_a_missing_store_leaves_the_evaluations_out_with_a_note(tmp_path):
    spec = _tiny_spec(tmp_path, datasets={"gone": str(tmp_path / "no-store")})
    c = cost.study_cost(spec)
    d = c["datasets"]["gone"]
    f = cost.image_flops("vit_tiny_patch16_224", "Head", model_kwargs=TINY, img_size=32)
    assert not d["eval_counted"] and d["rows"] is None and d["num_classes"] == cost.FALLBACK_CLASSES
    assert d["flops"] == d["flops_train"] == 2 * 10 * 8 * f.train and d["flops_eval"] == d["flops_probe"] == 0
    assert any("store not found for gone" in n for n in c["notes"])


def _spec_file(tmp_path, **fields) -> str:
    """The tiny spec as a preset file, with a weights file of its model (the dry run loads it)."""
    import timm
    from safetensors.torch import save_file

    weights = tmp_path / "tiny.safetensors"
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=3, **TINY)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    spec = _tiny_spec(tmp_path, weights=str(weights), **fields)
    path = tmp_path / "tiny.yaml"
    path.write_text(spec.to_yaml())
    return str(path)


def test_gpu_result_file_sets_the_mfu_and_peak_and_gpus_sets_k(tmp_path, capsys):
    result = tmp_path / "gpu.json"
    result.write_text(json.dumps({"mfu": {"bf16": 0.45, "fp32": 0.5}, "device": "NVIDIA H200",
                                  "peak_tflops": {"fp32": 60.0}}))
    spec = _spec_file(tmp_path)
    assert cli(["study", "--preset", spec, "--dry-run", "--json", "--gpu-result", str(result), "--gpus", "4"]) == 0
    obj = json.loads(capsys.readouterr().out)
    c = obj["cost"]
    assert (c["mfu"], c["peak_tflops"], c["device"], c["gpus"]) == (0.5, 60.0, "H200", 4.0)
    assert str(result) in c["mfu_source"] and c["gpus_source"] == "given (--gpus)"
    assert c["gpu_hours"] == pytest.approx(c["flops"] / (60e12 * 0.5) / 3600)
    assert c["wall_hours"] == pytest.approx(c["gpu_hours"] / 4)
    assert obj["datasets"]["tiny"]["flops"] == c["flops"]
    # the text form states what it assumes
    assert cli(["study", "--preset", spec, "--dry-run", "--mfu", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "assumes MFU 0.25 (given (--mfu)) of 67 TFLOP/s (H100, fp32)" in out
    assert "2 GPU(s) (the spec's concurrency" in out and "    total " in out


@pytest.mark.parametrize("content, field", [({"mfu": {"bf16": 0.4}}, "mfu.fp32"), ({"device": "x"}, "mfu.fp32"),
                                            ({"mfu": {"fp32": 1.5}}, "mfu.fp32"),
                                            ({"mfu": {"fp32": 0.4}, "peak_tflops": {"fp32": "a"}},
                                             "peak_tflops.fp32")])
def test_a_gpu_result_without_the_field_names_the_file_and_field(tmp_path, capsys, content, field):
    result = tmp_path / "gpu.json"
    result.write_text(json.dumps(content))
    assert cli(["study", "--preset", _spec_file(tmp_path), "--dry-run", "--gpu-result", str(result)]) == 2
    err = capsys.readouterr().err
    assert str(result) in err and f"'{field}'" in err


def test_cost_flags_only_with_dry_run(tmp_path, capsys):
    assert cli(["study", "--preset", _spec_file(tmp_path), "--gpus", "4"]) == 2
    assert "only with --dry-run" in capsys.readouterr().err
    missing = tmp_path / "none.json"
    assert cli(["study", "--preset", _spec_file(tmp_path), "--dry-run", "--gpu-result", str(missing)]) == 2
    assert f"file not found: {missing}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# the paper preset
# ---------------------------------------------------------------------------------------------------------


def test_paper_dry_run_json_carries_flops_gpu_hours_and_wall_hours(tmp_path, capsys):
    cost._counted.cache_clear()
    start = time.perf_counter()
    assert cli(["study", "--preset", "paper", "--out", str(tmp_path / "p"), "--dry-run", "--json"]) == 1  # no data
    seconds = time.perf_counter() - start
    obj = json.loads(capsys.readouterr().out)
    c = obj["cost"]
    # what they assume: fp32 (the paper's) at 67 TFLOP/s, MFU 0.35, 8 GPUs (max_concurrent_trials 0)
    assert (c["precision"], c["peak_tflops"], c["mfu"], c["gpus"]) == ("fp32", 67.0, 0.35, 8.0)
    assert "assumed" in c["mfu_source"] and "assumed" in c["gpus_source"]
    # per training image, by the rule, at the head of the fallback class count (no store here)
    parts = vit_parts(tokens=197, d=768, mlp=3072, patches=196, patch=16, classes=cost.FALLBACK_CLASSES)
    forward, hand = vit_forward(parts, DEPTH), _hand_backward(parts, DEPTH)
    configurations = ["LN1", "MHA", "LN2", "FC1", "FC2", "All"]
    total = 0
    for name, d in obj["datasets"].items():
        for key in ("flops", "gpu_hours", "wall_hours"):
            assert isinstance(d[key], float | int) and d[key] > 0, (name, key)
        runs = d["trials"] // len(configurations)  # each configuration runs the same lrs x seeds
        assert d["cost"]["flops_train"] == sum(runs * d["steps"] * 512 * (forward + hand[c]) for c in configurations)
        assert d["flops"] == d["cost"]["flops_train"] and not d["cost"]["eval_counted"]
        assert d["cost"]["per_image"]["All"]["train"] == 3 * forward - parts["patch"]
        assert d["gpu_hours"] == pytest.approx(d["flops"] / (67e12 * 0.35) / 3600)
        assert d["wall_hours"] == pytest.approx(d["gpu_hours"] / 8)
        total += d["flops"]
    assert c["trials"] == 888 and c["flops"] == total
    assert c["gpu_hours"] == pytest.approx(total / (67e12 * 0.35) / 3600)
    assert c["wall_hours"] == pytest.approx(c["gpu_hours"] / 8)
    # cached per (model, size, classes, configuration): 6 counts for 888 trials (no store: one class count)
    assert cost._counted.cache_info().misses == len(configurations)
    assert seconds < 60, seconds  # a few seconds alone; generous for a loaded test machine
    assert math.isfinite(c["wall_hours"])


def test_paper_text_dry_run_prints_the_cost(tmp_path, capsys):
    assert cli(["study", "--preset", "paper", "--out", str(tmp_path / "p"), "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "per training image, GFLOPs: LN1 " in out and "All 105.2" in out and "(forward 35.1)" in out
    lines = [line for line in out.splitlines() if line.startswith("    total ")]
    assert len(lines) == 1 and "888 trials" in lines[0] and "GPU" in lines[0] and "wall" in lines[0]
    # docs/studies.md quotes it: sum over the 6 configurations of steps x 512 x their FLOPs per image, at
    # 67 TFLOP/s x 0.35 and 8 GPUs
    assert lines[0].endswith("888 trials  4.18e+20 FLOPs  4,946 GPU-h  618 h wall"), lines[0]
    assert "per training image, GFLOPs: LN1 71.5, MHA 81.9, LN2 70.3, FC1 80.5, FC2 79.6, All 105.2 " in out
    assert "assumes MFU 0.35 (assumed default" in out


# ---------------------------------------------------------------------------------------------------------
# the selection cost: each budget strategy's scoring pass before any training (#35 item 2)
# ---------------------------------------------------------------------------------------------------------

TINY_PARTS = vit_parts(tokens=17, d=64, mlp=256, patches=16, patch=8, classes=3)
SELECTION = ["auto:20%", "random:20%", "rgn:20%", "fisher:20%", "magnitude:20%"]


def _selection_spec(tmp_path) -> StudySpec:
    """The tiny study with every kind of budget, 2 seeds and a final fit (a second scoring key per seed),
    criteria on 3 batches of 8, plasticity on 40 pairs; bf16 trials (a criterion is scored in float32)."""
    return _tiny_spec(tmp_path, configurations=SELECTION, seeds=[0, 1], final_fit=True, criteria_batches=3,
                      precision="bf16", plasticity={"enabled": True, "pairs": 40, "control": "none"})


def _with_selection(spec) -> dict:
    from raystudy.study.selection_cost import add_selection

    return add_selection(spec, cost.study_cost(spec))


def test_selection_cost_is_the_hand_count(tmp_path):
    c = _with_selection(_selection_spec(tmp_path))
    s = c["selection"]["strategies"]
    forward = vit_forward(TINY_PARTS, 4)  # one image through the tiny ViT, 3-class head
    gradient_pass = (forward + 2 * forward) * 3 * 8  # forward + backward (2x) of 3 batches of 8 images
    assert list(s) == ["auto", "random", "rgn", "fisher", "magnitude"]
    for name in ("rgn", "fisher"):  # 2 seeds x (search on train, final fit on train + val): 4 keys
        assert (s[name]["passes"], s[name]["flops"]) == (4, 4 * gradient_pass)
        assert s[name]["labels"] and s[name]["backward"] and s[name]["measured_passes"] == 0
        # estimated in float32 (TF32 off): 67 TFLOP/s at the assumed MFU 0.35, one GPU
        assert s[name]["seconds"] == pytest.approx(4 * gradient_pass / (67e12 * 0.35))
    assert s["fisher"]["per_sample"] and not s["rgn"]["per_sample"]
    # plasticity: both images of each of its 40 pairs, once per dataset, in the trials' bf16 (989 TFLOP/s)
    assert (s["auto"]["passes"], s["auto"]["flops"]) == (1, 2 * forward * 40)
    assert s["auto"]["seconds"] == pytest.approx(2 * forward * 40 / (989e12 * 0.35))
    assert not s["auto"]["labels"] and not s["auto"]["backward"]
    assert (s["magnitude"]["passes"], s["magnitude"]["flops"], s["magnitude"]["seconds"]) == (4, 0, 0)
    assert (s["random"]["passes"], s["random"]["flops"], s["random"]["data"]) == (0, 0, "none (the seed)")
    assert not any(s[n]["labels"] or s[n]["backward"] for n in ("magnitude", "random"))
    assert (c["selection"]["scoring_precision"], c["selection"]["scoring_peak_tflops"]) == ("fp32", 67.0)
    assert s["rgn"]["per_dataset"]["tiny"]["flops"] == s["rgn"]["flops"]
    # beside the trials' cost, not in it
    assert c["total"]["flops"] == c["datasets"]["tiny"]["flops"]


def test_selection_cost_reads_the_measured_seconds_of_cached_scores(tmp_path):
    from raystudy.study.jobs import criterion_table, finetune_config
    from raystudy.study.points import grid_point

    spec = _selection_spec(tmp_path)
    measured = {}
    for criterion in ("rgn", "magnitude"):  # seed 0's search key scored (and cached) as a trial scores it
        cfg = finetune_config(spec, grid_point("tiny", f"{criterion}:20%", "sgd", 0.1, 0), str(tmp_path / "run"))
        rows = criterion_table(spec, cfg, "tiny", criterion)
        assert rows["seconds"].nunique() == 1 and rows["seconds"].iloc[0] > 0
        measured[criterion] = float(rows["seconds"].iloc[0])
    c = _with_selection(spec)
    s = c["selection"]["strategies"]
    forward = vit_forward(TINY_PARTS, 4)
    estimated = 3 * forward * 3 * 8 / (67e12 * 0.35)  # one pass not cached
    assert s["rgn"]["measured_passes"] == 1 and s["rgn"]["seconds"] == pytest.approx(measured["rgn"] + 3 * estimated)
    assert s["magnitude"]["measured_passes"] == 1 and s["magnitude"]["seconds"] == pytest.approx(measured["magnitude"])
    assert s["fisher"]["measured_passes"] == 0  # another criterion's cache is not its own
    from raystudy.study.selection_cost import selection_lines

    lines = "\n".join(selection_lines(c["selection"]))
    assert "selection cost (each strategy's scoring before any training; not in the total above):" in lines
    assert "rgn        labels yes  backward yes     4 passes" in lines
    assert "(measured 1/4 passes, rest estimated)" in lines
    assert "auto       labels no   backward no      1 passes" in lines and "fisher: per-sample gradients" in lines


def test_selection_preset_scores_each_criterion_once_per_task_seed_and_split():
    """The selection preset's header: 114 scoring passes per gradient criterion (19 tasks x 3 seeds x the
    search's and the final fit's train split) of 8 batches of 64 images at ViT-B/16's 3 x 35.1 GFLOPs."""
    from raystudy.study import selection_cost as sc
    from raystudy.study.spec import load_preset

    spec = load_preset("selection")
    keys = sc.scoring_keys(spec)
    assert sc.strategies(spec) == ["auto", "random", "rgn", "grad", "taylor", "fisher", "magnitude"]
    for criterion in ("rgn", "grad", "taylor", "fisher", "magnitude"):
        assert sum(len(keys[(d, criterion)]) for d in spec.datasets) == 19 * 3 * 2
    assert all(keys[(d, "auto")] == [(None, "search")] for d in spec.datasets)
    assert not any(s == "random" for _, s in keys)
    forward = vit_forward(vit_parts(tokens=197, d=768, mlp=3072, patches=196, patch=16,
                                    classes=cost.FALLBACK_CLASSES), DEPTH)
    passes = 114 * sc.pass_flops(spec, "fisher", forward)
    assert passes == 114 * 3 * forward * 8 * 64 and f"{passes:.2e}" == "6.15e+15"  # the header's
    assert f"{19 * sc.pass_flops(spec, 'auto', forward):.2e}" == "3.42e+15"
    assert 114 * 3 * forward * 8 * 64 / (67e12 * 0.35) == pytest.approx(262, abs=0.5)
