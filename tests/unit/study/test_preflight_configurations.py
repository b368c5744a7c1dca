"""``raystudy study --dry-run`` resolves every configuration on the spec's model built on the meta device
(raystudy.study.preflight.configuration_problems): one naming a layer or a block the model lacks is listed
with its expression and reason before any launch, and a spec whose configurations all resolve has no
problem (on a toy 3-block ViT whose store and weights are real)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raystudy.data.store import write_store
from raystudy.study.spec import StudySpec
from tests.support.models import tiny_vit
from tests.support.stores import png_bytes

MODEL = "vit_tiny_patch16_224"
TINY = dict(patch_size=8, embed_dim=48, depth=3, num_heads=4)  # 3 blocks: 0-2
GOOD = ["MHA", "FC1@0,2+LN1", "bias@2", "lora:r=4:qkv", "ia3:fc1", "random:5%", "All", "Head"]
BAD = {"ia3:nonexistent": "adapter targets ['nonexistent'] name no linear layer",
       "lora:r=8:fc9": "adapter targets ['fc9'] name no linear layer",
       "MHA@40": "block(s) [40] out of range; the model has 3 blocks (0-2)"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 2-class store (12 train / 4 val / 4 test rows) and the weights of the tiny ViT."""
    root = tmp_path_factory.mktemp("preflight_configs")
    rng = np.random.default_rng(0)
    splits = ["train"] * 12 + ["val"] * 4 + ["test"] * 4
    rows = [{"image": png_bytes(rng, 32, 32), "label": i % 2, "split": s, "index": i} for i, s in enumerate(splits)]
    write_store(rows, root / "store", name="two", source="test", classes=["a", "b"], rows_per_shard=8)
    torch.manual_seed(0)
    torch.save(tiny_vit(num_classes=2).state_dict(), root / "tiny.pt")
    return {"root": root, "store": str(root / "store"), "weights": str(root / "tiny.pt")}


def _spec(files, out, configurations) -> StudySpec:
    return StudySpec.from_dict(dict(
        name="c", out=str(out), model=MODEL, model_kwargs=TINY, img_size=32, weights=files["weights"],
        datasets={"two": files["store"]}, configurations=configurations, optimizers={"sgd": [0.01]}, seeds=[0],
        plasticity={"enabled": False}, probe={"enabled": False}, analysis=False))


def test_every_configuration_that_names_what_the_model_lacks_is_reported(files, tmp_path):
    from raystudy.study.preflight import configuration_problems

    bad = ["ia3:nonexistent", "lora:r=8:fc9", "MHA@40"]
    spec = _spec(files, tmp_path / "s", [*GOOD[:3], bad[0], GOOD[3], bad[1], *GOOD[4:], bad[2]])
    spec.validate(check_files=False)  # each parses: only the model says they cannot run
    problems = configuration_problems(spec)
    assert len(problems) == 3
    for problem, expr in zip(problems, bad):
        assert problem.startswith(f"configurations: {expr!r} does not resolve on {MODEL}: "), problem
        assert BAD[expr] in problem, problem
    assert configuration_problems(_spec(files, tmp_path / "g", GOOD)) == []


def test_auto_resolves_as_random_with_its_budget(files, tmp_path):
    """``auto:B`` has no plasticity table before launch (``resolve`` alone refuses it for that): it is
    checked as ``random:B``, so ``auto:2k`` passes and ``auto:10``, below the smallest unit (96 parameters:
    an LN of d=48), fails exactly as ``random:10`` does."""
    from raystudy.core.expressions import resolve
    from raystudy.study.cost import spec_meta_model
    from raystudy.study.preflight import configuration_problems

    spec = _spec(files, tmp_path / "a", ["auto:2k", "auto:10", "random:10"])
    with pytest.raises(ValueError, match="needs the dataset's plasticity table"):
        resolve(spec_meta_model(spec), "auto:2k")
    problems = configuration_problems(spec)
    assert [p.split(" does not resolve")[0] for p in problems] == ["configurations: 'auto:10'",
                                                                   "configurations: 'random:10'"]
    assert all("below the smallest unit (96 parameters)" in p for p in problems)


def test_a_budget_below_the_smallest_unit_is_named_as_given(files, tmp_path):
    """A criterion's or auto's budget is packed in random:B's order before its scores or plasticity exist,
    but the error names the configuration the spec gives, not that stand-in (the launch's check and the dry
    run's cost alike)."""
    from raystudy.commands.study import dry_run
    from raystudy.study.preflight import configuration_problems

    given = ["fisher:20", "auto:10", "magnitude:20", "random:20"]
    spec = _spec(files, tmp_path / "b", given)
    units = {"fisher:20": 20, "auto:10": 10, "magnitude:20": 20, "random:20": 20}
    assert configuration_problems(spec) == [
        f"configurations: {c!r} does not resolve on {MODEL}: configuration {c!r}: the budget of {units[c]} "
        "parameters is below the smallest unit (96 parameters)" for c in given]
    for c in ("fisher:20", "magnitude:20"):
        with pytest.raises(ValueError) as e:
            dry_run(_spec(files, tmp_path / "d", ["MHA", c]))
        assert str(e.value) == (f"configuration {c!r}: the budget of 20 parameters is below the smallest unit "
                                "(96 parameters)")


def test_dry_run_lists_them_and_exits_1_before_any_launch(files, tmp_path, capsys):
    """The dry run (every store and the weights usable) names the bad configuration on stderr, exits 1 and
    writes nothing; the same study with a resolvable adapter exits 0."""
    from raystudy.commands.study import dry_run

    out = tmp_path / "study"
    assert dry_run(_spec(files, out, ["MHA", "lora:r=8:fc9"])) == 1
    err = capsys.readouterr().err
    assert "1 problem(s) a launch would meet" in err
    assert f"configurations: 'lora:r=8:fc9' does not resolve on {MODEL}" in err
    assert not out.exists()
    assert dry_run(_spec(files, tmp_path / "ok", ["MHA", "lora:r=8:fc1"])) == 0
    assert "checked: every store" in capsys.readouterr().out


def test_a_launch_refuses_them_before_writing_the_study(files, tmp_path):
    """Without --dry-run the launch's own checks (raystudy.study.tune.prepare_study) raise the same lines
    before spec.yaml is written or any trial starts."""
    from raystudy.study.checks import SpecError
    from raystudy.study.tune import prepare_study

    out = tmp_path / "launch"
    with pytest.raises(SpecError, match=r"'MHA@40' does not resolve on vit_tiny_patch16_224: .*out of range"):
        prepare_study(_spec(files, out, ["MHA", "MHA@40"]), echo=lambda _: None)
    assert not (out / "spec.yaml").exists() and not (out / "trials").exists()


def test_weights_budgets_are_checked_by_their_entry_count(files, tmp_path, capsys):
    """``:weights`` budgets resolve to their entry count on the meta device (at least one entry: 0.0001% of
    the tiny ViT's 95,040 is 0); ``auto:B:weights`` does not parse, and the dry run says why."""
    from raystudy.commands.study import dry_run
    from raystudy.study.checks import SpecError
    from raystudy.study.preflight import configuration_problems

    spec = _spec(files, tmp_path / "w", ["fisher:1%:weights", "random:2k:weights", "magnitude:0.0001%:weights",
                                         "grad:1M:weights"])
    spec.validate(check_files=False)
    assert configuration_problems(spec) == [
        f"configurations: 'magnitude:0.0001%:weights' does not resolve on {MODEL}: configuration "
        "'magnitude:0.0001%:weights': the budget is below one parameter"]
    with pytest.raises(SpecError, match=r"auto:<budget>:weights has no meaning: plasticity is measured per"):
        _spec(files, tmp_path / "a", ["auto:1%:weights"]).validate(check_files=False)
    assert dry_run(_spec(files, tmp_path / "ok", ["fisher:0.5%:weights", "random:1%:weights"])) == 0
    assert "checked: every store" in capsys.readouterr().out
