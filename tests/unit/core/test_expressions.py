"""Configuration expressions: parsing, canonical spellings, exact parameter counts, budgets by plasticity."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from raystudy.core.expressions import (
    Adapter,
    Budget,
    Budgeted,
    Combination,
    ExpressionError,
    Term,
    canonical,
    is_configuration,
    parse,
    path_safe,
    resolve,
)
from raystudy.vocab import COMPONENTS, CONFIGURATIONS
from tests.support.models import tiny_vit

# ---------------------------------------------------------------------------------------------- vit_base counts
# vit_base_patch16_224: d = 768, 12 blocks, MLP hidden 3072, 10 classes.
D, H, DEPTH = 768, 3072, 12
MHA_BLOCK = (D * 3 * D + 3 * D) + (D * D + D)  # qkv 768*2304 + 2304 = 1,771,776; proj 768*768 + 768 = 590,592
FC1_BLOCK = D * H + H  # 768*3072 + 3072 = 2,362,368
HEAD = D * 10 + 10  # 7,690: trainable in every configuration, never part of a selection


@pytest.fixture(scope="module")
def vit_base():
    import timm

    with torch.device("meta"):  # shapes only: counts without 330 MB of weights
        return timm.create_model("vit_base_patch16_224", num_classes=10)


def test_vit_base_counts(vit_base):
    assert MHA_BLOCK == 2_362_368 and FC1_BLOCK == 2_362_368
    assert resolve(vit_base, "MHA+FC1").num_parameters == DEPTH * (MHA_BLOCK + FC1_BLOCK) == 56_696_832
    assert resolve(vit_base, "MHA@8-11").num_parameters == 4 * MHA_BLOCK == 9_449_472
    assert resolve(vit_base, "FC1@0,2,4").num_parameters == 3 * FC1_BLOCK
    # the paper's names resolve exactly as before; All = every parameter but the head
    assert resolve(vit_base, "All").num_parameters == 85_806_346 - HEAD
    assert resolve(vit_base, "Head").num_parameters == 0


def test_vit_base_lora_count():
    import timm

    with torch.device("meta"):
        model = timm.create_model("vit_base_patch16_224", num_classes=10)
    r = 8
    per_block = r * (D + 3 * D) + r * (D + D)  # qkv: A (8, 768) + B (2304, 8); proj: A (8, 768) + B (768, 8)
    assert per_block == 36_864
    resolved = resolve(model, "lora:r=8")
    assert resolved.num_parameters == DEPTH * per_block == 442_368
    assert len(resolved.parameters) == DEPTH * 2 * 2  # A and B of qkv and proj in every block


def test_budget_percent_of_all(vit_base):
    total = 85_806_346 - HEAD  # All
    table = _table(vit_base, np.random.default_rng(0))
    resolved = resolve(vit_base, "auto:5%", plasticity=table)
    assert resolved.budget == math.floor(total * 5 / 100) == 4_289_932
    assert resolved.num_parameters <= resolved.budget


# ---------------------------------------------------------------------------------------------------- parsing


def test_parse_trees():
    assert parse("MHA") == Combination((Term("MHA"),))
    assert parse("MHA@8-11+FC1") == Combination((Term("MHA", (8, 9, 10, 11)), Term("FC1")))
    assert parse("FC1@4,0,2") == Combination((Term("FC1", (0, 2, 4)),))
    assert parse("auto:5%") == Budgeted("auto", Budget(5.0, "%"))
    assert parse("random:2M") == Budgeted("random", Budget(2_000_000, ""))
    assert parse("auto:500k") == Budgeted("auto", Budget(500_000, ""))
    assert parse("auto:1.5M") == Budgeted("auto", Budget(1_500_000, ""))
    assert parse("random:1234") == Budgeted("random", Budget(1234, ""))
    assert parse("lora:r=8") == Adapter("lora", 8, ("proj", "qkv"))
    assert parse("lora:r=4:qkv,fc1") == Adapter("lora", 4, ("fc1", "qkv"))
    assert parse("dora:r=8") == Adapter("dora", 8, ("proj", "qkv"))
    assert parse("loha:r=2:fc2") == Adapter("loha", 2, ("fc2",))
    assert parse("lokr:r=16") == Adapter("lokr", 16, ("proj", "qkv"))
    assert parse("vera:r=256") == Adapter("vera", 256, ("proj", "qkv"))
    assert parse("ia3") == Adapter("ia3", None, ("fc2", "qkv")) == Adapter("ia3")  # keys/values (qkv), FFN
    assert Adapter("dora", 8) == Adapter("dora", 8, ("proj", "qkv"))
    assert parse("ia3:qkv,fc1") == Adapter("ia3", None, ("fc1", "qkv"))
    assert parse("bias") == Combination((Term("bias"),))
    assert parse("bias@8-11+LN1") == Combination((Term("bias", (8, 9, 10, 11)), Term("LN1")))


@pytest.mark.parametrize("expr, position, words", [
    ("", 0, "expected a configuration name"),
    ("MHA+FC3", 4, "unknown name 'FC3'"),
    ("mha", 0, "unknown name 'mha'"),
    ("MHA@8-x", 6, "last block of the range"),
    ("MHA@x", 4, "expected a block number"),
    ("MHA@11-8", 7, "descending"),
    ("MHA@8,", 6, "found the end"),
    ("Emb@1", 3, "not per block"),
    ("All@0-3", 3, "not per block"),
    ("MHA+", 4, "expected a configuration name"),
    ("MHA FC1", 3, "unexpected ' '"),
    ("auto:5%+MHA", 7, "unexpected '+'"),
    ("auto:", 5, "expected a budget"),
    ("auto:150%", 5, "(0, 100]"),
    ("random:1.2345k", 7, "whole number"),
    ("random:2G", 8, "unexpected 'G'"),
    ("lora:8", 5, "expected 'r=<rank>'"),
    ("lora", 4, "expected ':r=<rank>'"),
    ("dora:r=0", 7, "at least 1"),
    ("vera:", 5, "expected 'r=<rank>'"),
    ("loha:r=", 7, "expected the rank"),
    ("lokr:r=4:", 9, "expected a layer name"),
    ("ia3:", 4, "expected a layer name"),
    ("ia3:r=8", 4, "ia3 takes no rank"),
    ("ia3+MHA", 3, "unexpected '+'"),
    ("bias@", 5, "expected a block number"),
    ("Bias", 0, "unknown name 'Bias'"),
    ("adalora:r=8", 0, "unknown name 'adalora'"),
    ("lora:r=0", 7, "at least 1"),
    ("lora:r=8:", 9, "expected a layer name"),
    ("lora:r=8:qkv+MHA", 12, "unexpected '+'"),
])
def test_parse_errors_point_at_the_character(expr, position, words):
    with pytest.raises(ExpressionError) as info:
        parse(expr)
    err = info.value
    assert err.position == position and words in str(err)
    lines = str(err).splitlines()
    assert lines[-2] == "  " + expr
    assert lines[-1] == " " * (2 + position) + "^"
    assert not is_configuration(expr)


@pytest.mark.parametrize("expr, expected", [
    *[(name, name) for name in CONFIGURATIONS],  # the paper's names are their own canonical spelling
    ("FC1+MHA@11,8-10+MHA@9", "MHA@8-11+FC1"),
    ("FC1@4,0,2", "FC1@0,2,4"),
    ("FC2@3,1,2,2,0,5", "FC2@0-3,5"),
    ("MHA@08-09", "MHA@8-9"),
    ("MHA@3+MHA", "MHA"),
    ("MHA+FC1+All", "All"),
    ("Head+FC2", "FC2"),
    ("Head+Head", "Head"),
    ("Emb+LN1", "LN1+Emb"),
    ("auto:5.0%", "auto:5%"),
    ("auto:0.50%", "auto:0.5%"),
    ("random:2000k", "random:2M"),
    ("random:0.5M", "random:500k"),
    ("auto:1500k", "auto:1500k"),
    ("auto:1234", "auto:1234"),
    ("lora:r=8:qkv,proj", "lora:r=8"),
    ("lora:r=8:qkv,fc1,qkv", "lora:r=8:fc1,qkv"),
    ("dora:r=8:qkv,proj", "dora:r=8"),
    ("vera:r=0256", "vera:r=256"),
    ("lokr:r=4:fc1", "lokr:r=4:fc1"),
    ("ia3:qkv,fc2", "ia3"),
    ("ia3:qkv,proj", "ia3:proj,qkv"),  # the LoRA default is not IA3's: spelled out
    ("bias+LN2+LN1", "LN1+LN2+bias"),
    ("bias@11,8-10+bias@9", "bias@8-11"),
    ("bias@3+bias", "bias"),
    ("Head+bias", "bias"),
    ("bias+All", "All"),
    ("Emb+bias@0", "Emb+bias@0"),
])
def test_canonical(expr, expected):
    assert canonical(expr) == expected
    assert canonical(expected) == expected  # a fixed point
    assert canonical(parse(expr)) == expected


def test_path_safe():
    assert path_safe("auto:5.0%") == "auto_5pct"
    assert path_safe("lora:r=8:fc1,qkv") == "lora_r=8_fc1,qkv"
    assert path_safe("FC1+MHA@9-11") == "MHA@9-11+FC1"
    assert path_safe("dora:r=8:qkv,fc1") == "dora_r=8_fc1,qkv"
    assert path_safe("ia3:fc1") == "ia3_fc1" and path_safe("ia3") == "ia3"
    assert path_safe("bias+LN1") == "LN1+bias"


def test_split_configurations_the_comma_rule():
    from raystudy.core.expression_lists import split_configurations

    text = "MHA, FC1@0,2,4, lora:r=8:fc1,qkv, ia3, bias, ia3:qkv,fc2, bias@1,3, dora:r=4, LN1+bias, vera:r=64:fc1"
    assert split_configurations(text) == ["MHA", "FC1@0,2,4", "lora:r=8:fc1,qkv", "ia3", "bias", "ia3:qkv,fc2",
                                          "bias@1,3", "dora:r=4", "LN1+bias", "vera:r=64:fc1"]
    assert split_configurations("loha:r=2:qkv, lokr:r=2, auto:5%, random:2M") == [
        "loha:r=2:qkv", "lokr:r=2", "auto:5%", "random:2M"]


def test_is_configuration():
    assert all(is_configuration(c) for c in [*CONFIGURATIONS, "MHA@8-11+FC1", "auto:5%", "lora:r=16:fc1",
                                            "dora:r=4", "ia3", "bias@0+LN1", "vera:r=8:fc2"])
    assert not any(is_configuration(c) for c in ["LP", "mha", "MHA@", None, 3])


# ------------------------------------------------------------------------------------------ a tiny model's units
# tiny_vit: d = 48, 3 blocks, MLP hidden 192.
SIZES = {"LN1": 2 * 48, "LN2": 2 * 48, "MHA": (48 * 144 + 144) + (48 * 48 + 48), "FC1": 48 * 192 + 192,
         "FC2": 192 * 48 + 48}  # LN 96; MHA 7,056 + 2,352 = 9,408; FC1 9,408; FC2 9,264


def _table(model, rng, nan=()):
    depth = len(model.blocks)
    rows = [{"layer": b, "component": c, "plasticity": float(rng.random())} for b in range(depth) for c in COMPONENTS]
    for row in rows:
        if (row["component"], row["layer"]) in nan:
            row["plasticity"] = float("nan")
    return pd.DataFrame(rows)


def test_unit_counts_and_depth_ranges():
    model = tiny_vit()
    for c, size in SIZES.items():
        assert resolve(model, f"{c}@1").num_parameters == size
        assert resolve(model, c).num_parameters == 3 * size
    resolved = resolve(model, "FC1@0,2+MHA@1-2")
    assert resolved.num_parameters == 2 * SIZES["FC1"] + 2 * SIZES["MHA"]
    assert resolved.units == (("FC1", 0), ("MHA", 1), ("MHA", 2), ("FC1", 2))  # depth, then COMPONENTS order
    assert all(n.startswith(("blocks.0.mlp.fc1.", "blocks.2.mlp.fc1.", "blocks.1.attn.", "blocks.2.attn."))
               for n in resolved.names)
    with pytest.raises(ValueError, match="out of range"):
        resolve(model, "MHA@2-3")


def test_auto_picks_in_plasticity_order_first_fit():
    model = tiny_vit()
    ranked = [("FC1", 2), ("MHA", 1), ("FC2", 0), ("LN2", 2), ("MHA", 0), ("LN1", 1), ("FC2", 2), ("LN1", 0),
              ("FC1", 0), ("LN2", 0), ("LN1", 2), ("LN2", 1), ("MHA", 2), ("FC1", 1), ("FC2", 1)]
    table = pd.DataFrame([{"layer": b, "component": c, "plasticity": 1.0 - 0.05 * i}
                          for i, (c, b) in enumerate(ranked)])
    resolved = resolve(model, "auto:20000", plasticity=table)
    # FC1@2 (9,408) + MHA@1 (9,408) = 18,816; FC2@0 (9,264) would overflow 20,000: skipped, as is every
    # later MHA/FC unit; the six LayerNorms (96 each) still fit: 18,816 + 6 * 96 = 19,392.
    assert resolved.units == (("FC1", 2), ("MHA", 1), ("LN2", 2), ("LN1", 1), ("LN1", 0), ("LN2", 0),
                              ("LN1", 2), ("LN2", 1))
    assert resolved.num_parameters == 19_392 and resolved.budget == 20_000
    assert resolved.chosen == "LN1@0-2+MHA@1+LN2@0-2+FC1@2"
    assert resolve(model, resolved.chosen).names == resolved.names  # the recorded units train the same set


def test_auto_never_exceeds_budget_and_follows_plasticity():
    model = tiny_vit()
    total = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("head."))
    for seed in range(6):
        rng = np.random.default_rng(seed)
        table = _table(model, rng, nan={("MHA", 0)})
        value = {(c, b): p for c, b, p in zip(table["component"], table["layer"], table["plasticity"])}
        for budget in ["auto:96", "auto:10000", "auto:5%", "auto:25%", "auto:60%"]:
            r = resolve(model, budget, plasticity=table)
            limit = math.floor(total * float(budget[5:-1]) / 100) if budget.endswith("%") else int(budget[5:])
            assert r.budget == limit and 0 < r.num_parameters <= limit
            assert r.num_parameters == sum(SIZES[c] for c, _ in r.units)
            picked = [value[u] for u in r.units]
            assert picked == sorted(picked, reverse=True)
            assert ("MHA", 0) not in r.units  # NaN plasticity: never chosen
            for unit, p in value.items():  # every skipped measured unit would have overflowed at its turn
                if unit not in r.units and not math.isnan(p):
                    before = sum(SIZES[c] for c, b in r.units if value[(c, b)] > p)
                    assert before + SIZES[unit[0]] > limit


def test_auto_needs_a_complete_table():
    model = tiny_vit()
    table = _table(model, np.random.default_rng(0))
    with pytest.raises(ValueError, match="plasticity table"):
        resolve(model, "auto:5%")
    with pytest.raises(ValueError, match="lacks 1 unit"):
        resolve(model, "auto:5%", plasticity=table.iloc[1:])
    with pytest.raises(ValueError, match="several rows"):
        resolve(model, "auto:5%", plasticity=pd.concat([table, table]))
    with pytest.raises(ValueError, match="below the smallest unit"):
        resolve(model, "auto:95", plasticity=table)


def test_random_reproducible_per_seed_and_within_budget():
    model = tiny_vit()
    draws = {seed: resolve(model, "random:20000", seed=seed) for seed in range(5)}
    for seed, r in draws.items():
        again = resolve(model, "random:20000", seed=seed)
        assert again.units == r.units and again.names == r.names
        assert 0 < r.num_parameters <= 20_000
        assert r.num_parameters == sum(SIZES[c] for c, _ in r.units)
    assert len({r.units for r in draws.values()}) > 1  # different seeds, different units
    assert draws[0].chosen == canonical("+".join(f"{c}@{b}" for c, b in draws[0].units))
