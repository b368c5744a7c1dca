"""docs/fidelity.md, the ledger of the paper presets against the authors' code, checked line by line.

* The authors' values: ``tests/data/authors_protocol.yaml`` holds each value copied from their files
  (branch ``dev``, the commit :data:`tests.support.authors.COMMIT`) with its ``file:line`` and the line's
  text; :func:`read_value` reads the value back from that text, so a value that does not say what its line
  says fails here, offline.
* What matches: each line of the ledger's "What matches" table names a check of :data:`MATCHES`, which
  resolves the presets (per dataset, through the job each grid point runs) and compares them with the
  authors' values; the table and :data:`MATCHES` name the same checks.
* What differs: every difference table has an effect column with one of :data:`EFFECTS`; every option a
  "closes it" cell names exists (a setting and a value the spec accepts, a flag of the command line, a
  whole command the parser accepts, a path of the repository); a "closed" cell's settings hold in the
  presets of its section; a "none" says why.

No training, no Ray: specs, configs, an optimizer over one tensor, a tiny ViT's forward for the probe.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import math
import re
import shlex
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from raystudy.study.spec import load_preset, preset_names
from tests.support.authors import COMMIT, PROTOCOL, VAL_ROWS, rows_pin
from tests.support.processes import REPO

ROOT = REPO
LEDGER = ROOT / "docs" / "fidelity.md"
DATA = PROTOCOL
EFFECTS = ("none", "curves only", "figure only", "numbers")
#: the presets that finetune as the authors did, and the authors' config file of each of their datasets
FINETUNING = ("paper", "paper-low-data", "paper-model-size")
LOW_DATA_CONFIGS = {"cifar100": "cifar100ld", "cifar10c-motion_blur": "cifar10ld_c", "clipart": "domainld",
                    "sketch": "domainld", "pets": "ptld"}
#: the authors' component names (``freeze_model``) -> raystudy's
COMPONENTS = {"attn_norm": "LN1", "mha": "MHA", "ffn_norm": "LN2", "ffn_fc1": "FC1", "ffn_fc2": "FC2"}


# ---------------------------------------------------------------------------------------------------------
# the authors' values, read from their quoted lines
# ---------------------------------------------------------------------------------------------------------


def parse_literal(text: str) -> Any:
    """A token of a source line as a value: a Python literal (``10_000``, ``1e-2``, ``"cosine"``, ``[0]``,
    ``(0.9, 0.999)``, ``True``), else the text itself (``sgd``, ``RandomResizedCrop(size)``)."""
    text = text.strip().rstrip(",").strip()
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return list(value) if isinstance(value, tuple) else value


def read_value(entry: dict) -> Any:
    """The value a data entry's ``quote`` spells: its ``token`` (which the quote must hold); a list quote,
    one literal per line (a trailing backslash dropped); else what follows the line's last ``:`` or ``=``.
    An ``absent`` text must not occur in the quote."""
    quote = entry["quote"]
    lines = quote if isinstance(quote, list) else [quote]
    if "absent" in entry:
        assert not any(entry["absent"] in line for line in lines), f"{entry['source']}: holds {entry['absent']!r}"
    if "token" in entry:
        assert any(entry["token"] in line for line in lines), f"{entry['source']}: no {entry['token']!r} in {quote!r}"
        return parse_literal(entry["token"])
    if isinstance(quote, list):
        return [parse_literal(line.rstrip("\\")) for line in lines]
    return parse_literal(re.split(r"[:=]", quote)[-1])


def authors(key: str) -> Any:
    """The authors' value recorded under ``key``."""
    return DATA["values"][key]["value"]


def test_every_value_reads_from_its_quoted_line():
    wrong = {k: (read_value(e), e["value"]) for k, e in DATA["values"].items() if read_value(e) != e["value"]}
    assert not wrong, f"values that their quoted lines do not spell (read, recorded): {wrong}"


def test_every_source_names_a_file_and_its_lines():
    for key, entry in DATA["values"].items():
        m = re.fullmatch(r"([\w./-]+\.(?:py|sh|yaml|txt)):(\d+)(?:-(\d+))?", entry["source"])
        assert m, f"{key}: source {entry['source']!r} is not FILE:LINE or FILE:FIRST-LAST"
        first, last = int(m[2]), int(m[3] or m[2])
        if isinstance(entry["quote"], list):
            assert len(entry["quote"]) == last - first + 1, f"{key}: {len(entry['quote'])} lines quoted for {m[0]}"
        else:
            assert m[3] is None, f"{key}: one line quoted for {m[0]}"
    assert re.fullmatch(r"[0-9a-f]{40}", DATA["commit"]) and DATA["branch"] == "dev"


#: a citation of a commit of the authors' repository: ``commit <hex>`` or ``vit-plasticity/blob/<hex>``
COMMIT_CITATION = re.compile(r"(?:\bcommit:?\s+`{0,2}|vit-plasticity/(?:blob|tree)/)([0-9a-f]{7,40})\b")


def test_one_commit_of_the_authors_is_cited():
    """The ledger names the commit of ``tests/data/authors_protocol.yaml`` (:data:`tests.support.authors.COMMIT`),
    and every test or data file that cites a commit of the authors' repository cites that one."""
    assert f"`{COMMIT}`" in LEDGER.read_text()
    cited: dict[str, list[str]] = {}
    for path in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "tests" / "data").glob("*.yaml")]:
        for found in COMMIT_CITATION.findall(path.read_text()):
            cited.setdefault(found, []).append(str(path.relative_to(ROOT)))
    assert COMMIT in cited, cited
    assert {h: p for h, p in cited.items() if not COMMIT.startswith(h)} == {}


# ---------------------------------------------------------------------------------------------------------
# the presets, resolved as their trials run
# ---------------------------------------------------------------------------------------------------------


def config_name(preset: str, dataset: str) -> str:
    """The authors' config file (``apps/vit/configs/<name>.yaml``) of a preset's dataset."""
    if preset == "paper-low-data":
        return LOW_DATA_CONFIGS[dataset]
    if dataset.startswith("cifar10c-"):
        return "cifar10_c"
    return {"clipart": "domainnet", "sketch": "domainnet", "pets": "pet"}.get(dataset, dataset)


def config_value(preset: str, dataset: str, key: str) -> Any:
    return authors(f"config.{config_name(preset, dataset)}.{key}")


@functools.cache
def trial_configs(preset: str) -> dict[tuple[str, str], Any]:
    """``(dataset, optimizer) -> FinetuneConfig`` of one grid point each: what such a trial trains with."""
    from raystudy.study.jobs import finetune_job

    spec = load_preset(preset)
    out = {}
    for point in spec.grid():
        key = (point["dataset"], point["optimizer"])
        if key not in out:
            out[key] = finetune_job(spec, point, "/tmp/ledger-unused")[0]
    return out


def one_param_optimizer(cfg):
    from raystudy.core.finetune.config import make_optimizer

    return make_optimizer([torch.nn.Parameter(torch.zeros(3))], cfg, fused=False)


# ---------------------------------------------------------------------------------------------------------
# What matches: one check per line of the ledger's table
# ---------------------------------------------------------------------------------------------------------


def check_dataset_names():
    """The datasets the per-dataset checks pair: ``paper``'s CIFAR-10-C entries are ``finetuning.sh``'s
    corruptions at its severity, its DomainNet entries its domains."""
    for dataset, store in load_preset("paper").datasets.items():
        if dataset.startswith("cifar10c-"):
            corruption = authors(f"finetuning_sh.{dataset}.corruption")
            assert (dataset, store) == (f"cifar10c-{corruption}",
                                        f"cifar10c-{corruption}-{authors(f'finetuning_sh.{dataset}.severity')}")
        elif dataset in ("clipart", "sketch"):
            assert authors(f"finetuning_sh.{dataset}.domain") == dataset and store == f"domainnet-{dataset}"
    assert list(load_preset("paper-model-size").datasets) == [authors("model_size_sh.domain")] == ["clipart"]


def check_periods():
    check_dataset_names()
    for preset in FINETUNING:
        for dataset, p in load_preset(preset).protocols().items():
            theirs = tuple(config_value(preset, dataset, k) for k in ("n_steps", "eval_period", "logging_period"))
            assert (p.steps, p.eval_period, p.log_period) == theirs, (preset, dataset)
    for dataset, name in LOW_DATA_CONFIGS.items():  # the low-data datasets are those finetuning_ld.sh trains
        assert authors(f"finetuning_ld_sh.{dataset}.dataset") == name


def _adamw_grid(sgd: list[float]) -> list[float]:
    """``adam.sh``: ``printf "%.2e", $lr / 100``."""
    return [float(f"{lr / authors('adam_sh.lr_divisor'):.2e}") for lr in sgd]


def check_lr_grids():
    paper = load_preset("paper").protocols()
    adam = {k.split(".")[1] for k in DATA["values"] if k.startswith("adam_sh.") and k.endswith(".lrs")}
    assert {d for d, p in paper.items() if "adamw" in p.optimizers} == adam
    for dataset, p in paper.items():
        assert p.optimizers["sgd"] == authors(f"finetuning_sh.{dataset}.lrs"), dataset
        if dataset in adam:
            assert authors(f"adam_sh.{dataset}.lrs") == p.optimizers["sgd"], dataset
            assert p.optimizers["adamw"] == _adamw_grid(p.optimizers["sgd"]), dataset
    for dataset, p in load_preset("paper-low-data").protocols().items():
        assert p.optimizers == {"sgd": authors(f"finetuning_ld_sh.{dataset}.lrs")}, dataset
    assert load_preset("paper-model-size").protocol("clipart").optimizers == {"sgd": authors("model_size_sh.lrs")}


def check_seeds():
    for dataset, p in load_preset("paper").protocols().items():
        assert p.seeds["sgd"] == authors(f"finetuning_sh.{dataset}.seeds"), dataset
    for dataset, p in load_preset("paper-low-data").protocols().items():
        assert p.seeds == {"sgd": authors(f"finetuning_ld_sh.{dataset}.seeds")}, dataset
    assert load_preset("paper-model-size").protocol("clipart").seeds == {"sgd": authors("model_size_sh.seeds")}


def _trained(frozen: list[str]) -> str:
    """The configuration a list of frozen components of the authors' scripts trains."""
    if not frozen:
        return "All"
    if "emb" not in frozen:
        assert set(frozen) == set(COMPONENTS)
        return "Emb"
    (left,) = set(COMPONENTS) - set(frozen)
    return COMPONENTS[left]


def check_configurations():
    comps = [_trained(authors(f"finetuning_sh.comp_{i}_frozen")) for i in range(7)]
    assert comps == ["All", "Emb", "LN1", "MHA", "LN2", "FC1", "FC2"]
    assert comps[authors("adam_sh.skips_emb")] == comps[authors("model_size_sh.skips_emb")] == "Emb"
    reported = set(comps) - {"Emb"}
    for preset in FINETUNING:
        assert set(load_preset(preset).configurations) == reported, preset


def check_sgd():
    sgd_default = inspect.signature(torch.optim.SGD).parameters["nesterov"].default  # optim.py passes none
    for preset in FINETUNING:
        for (dataset, optimizer), cfg in trial_configs(preset).items():
            if optimizer != "sgd":
                continue
            assert authors(f"config.{config_name(preset, dataset)}.optimizer") == "sgd"
            group = one_param_optimizer(cfg).param_groups[0]
            assert group["momentum"] == config_value(preset, dataset, "momentum"), (preset, dataset)
            assert group["nesterov"] is sgd_default is False


def check_adamw():
    configs = {k: c for k, c in trial_configs("paper").items() if k[1] == "adamw"}
    assert len(configs) == 4 and authors("adam_sh.optimizer") == "adamw"
    for cfg in configs.values():
        opt = one_param_optimizer(cfg)
        assert isinstance(opt, torch.optim.AdamW)
        assert list(opt.param_groups[0]["betas"]) == authors("optim.betas")


def check_weight_decay():
    for preset in FINETUNING:
        for cfg in trial_configs(preset).values():
            assert one_param_optimizer(cfg).param_groups[0]["weight_decay"] == authors("optim.weight_decay")


def check_clipping():
    for preset in FINETUNING:
        for (dataset, _), cfg in trial_configs(preset).items():
            assert cfg.clip_norm == config_value(preset, dataset, "grad_clip"), (preset, dataset)


def authors_lr_cosine(step: int, warmup: int, min_factor: float, n_steps: int) -> float:
    """``lr_cosine`` of the authors' ``src/vitef/optim.py`` (lines 165-197), transcribed."""
    if step < warmup:
        return float(step) / warmup
    if step <= n_steps:
        s = float(step - warmup) / (n_steps - warmup)
        return min_factor + 0.5 * (1 - min_factor) * (math.cos(math.pi * s) + 1)
    return min_factor


def check_schedule():
    """Cosine to ``min_factor`` 0 after ``SchedulerConfig.warmup`` steps: the factor of every update after
    the warmup equals the authors' (the warmup's own factors are another line of the ledger)."""
    from raystudy.core.finetune.config import make_scheduler

    assert authors("train.min_factor") == 0
    for preset in FINETUNING:
        for (dataset, _), cfg in trial_configs(preset).items():
            assert config_value(preset, dataset, "scheduler") == "cosine"
            assert cfg.warmup == authors("optim.warmup"), (preset, dataset)
            factor = make_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), cfg).lr_lambdas[0]
            for k in range(cfg.warmup, cfg.steps, 97):
                assert factor(k) == pytest.approx(authors_lr_cosine(k, cfg.warmup, 0, cfg.steps), abs=1e-12), k


def check_batch():
    for preset in ("paper", "paper-low-data"):
        spec = load_preset(preset)
        for dataset in spec.datasets:
            assert spec.batch_size == config_value(preset, dataset, "batch_size") * config_value(
                preset, dataset, "grad_acc_steps") and spec.micro_batch_size is None, (preset, dataset)
    spec = load_preset("paper-model-size")
    assert spec.micro_batch_size == authors("model_size_sh.batch_size")
    assert spec.batch_size == authors("model_size_sh.batch_size") * authors("model_size_sh.grad_acc_steps")


def check_precision():
    for preset in (*FINETUNING, "plasticity-paper", "plasticity-gpt2", "plasticity-dinov3"):
        assert load_preset(preset).precision == authors("paper.precision").lower(), preset


#: timm ViT parameter names -> the authors' component names (``freeze_model``'s ``map_weight``)
TIMM_COMPONENTS = {"norm1.": "attn_norm", "attn.": "mha", "norm2.": "ffn_norm", "mlp.fc1.": "ffn_fc1",
                   "mlp.fc2.": "ffn_fc2"}
EMBEDDING = ("cls_token", "pos_embed", "patch_embed.")


def tiny_vit():
    from raystudy.core.models import build_model

    torch.manual_seed(0)
    return build_model("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=8, embed_dim=32, depth=2,
                       num_heads=2)


def authors_trainable(names: list[str], frozen: list[str]) -> set[str]:
    """The parameters ``freeze_model(model, frozen)`` of the authors' ``apps/vit/utils.py`` leaves trainable,
    spelled with timm's names: the embedding if ``emb`` is not frozen, each block parameter whose component
    is not frozen, and everything else (the final norm, the head)."""
    def component(name: str) -> str | None:
        if name.startswith(EMBEDDING):
            return "emb"
        if name.startswith("blocks."):
            rest = name.split(".", 2)[2]
            return next(c for prefix, c in TIMM_COMPONENTS.items() if rest.startswith(prefix))
        return None

    return {n for n in names if component(n) not in frozen}


@functools.cache
def trained_names(configuration: str, train_final_norm: bool) -> tuple[list[str], list[str]]:
    """``(every parameter, the trained ones)`` of a tiny ViT under a configuration (raystudy's selection)."""
    from raystudy.core.finetune.selection import select_and_freeze

    model = tiny_vit()
    trained = select_and_freeze(model, configuration, train_final_norm=train_final_norm).names
    return [n for n, _ in model.named_parameters()], trained


def check_final_norm():
    """``freeze_model`` freezes the embedding and block parameters only (its quoted lines never name the
    model's ``output``): on a tiny ViT, each configuration of the presets trains exactly what the authors'
    freezing leaves trainable, the final norm and the head included."""
    assert read_value(DATA["values"]["freeze.blocks"]) == "model.model.embedding.parameters()"  # absent: output
    frozen = {_trained(authors(f"finetuning_sh.comp_{i}_frozen")): authors(f"finetuning_sh.comp_{i}_frozen")
              for i in range(7)}
    for preset in FINETUNING:
        spec = load_preset(preset)
        assert spec.train_final_norm is True, preset
        for configuration in spec.configurations:
            names, trained = trained_names(configuration, spec.train_final_norm)
            assert set(trained) == authors_trainable(names, frozen[configuration]), (preset, configuration)
            assert {"norm.weight", "head.weight"} <= set(trained)


def check_head_init():
    """``head_init: torch_default`` draws the head as a new ``nn.Linear`` does: weight and bias in
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (std bound / sqrt(3), far from the trunc-normal's 0.02)."""
    from raystudy.core.finetune.selection import reset_head

    assert authors("vit.head").startswith("nn.Linear(")
    for preset in FINETUNING:
        assert load_preset(preset).head_init == "torch_default", preset
    model = tiny_vit()
    reset_head(model, seed=0, mode="torch_default")
    bound = 1 / math.sqrt(model.head.in_features)
    for p in (model.head.weight, model.head.bias):
        assert p.abs().max() <= bound
    assert float(model.head.weight.detach().std()) == pytest.approx(bound / math.sqrt(3), rel=0.15)


def authors_accuracy(hits: np.ndarray, batch_size: int) -> float:
    """``run_evaluation`` of the authors' ``eval.py``: the mean over the loader's batches (the last one
    shorter, ``drop_last=False``) of each batch's accuracy."""
    batches = [hits[i:i + batch_size].astype(float).mean() for i in range(0, len(hits), batch_size)]
    return sum(batches) / len(batches)


def check_accuracy():
    from raystudy.core.finetune.step import accuracy_of, correct_by_batch
    from raystudy.settings import accuracy_batch

    expected_val = {"paper": 512, "paper-low-data": 512, "paper-model-size": authors("model_size_sh.val_batch_size")}
    for preset in FINETUNING:
        spec = load_preset(preset)
        assert spec.accuracy == "per_batch", preset
        assert accuracy_batch(spec, "val") == expected_val[preset], preset
        assert accuracy_batch(spec, "test") == authors("eval_yaml.batch_size"), preset
    assert authors("eval_model_size_sh.batch_size") == authors("eval_yaml.batch_size")
    assert {config_value("paper", d, "val_batch_size") for d in load_preset("paper").datasets} == {512}
    hits = np.random.default_rng(0).random(1300) < 0.7
    for b in (128, 512):
        assert accuracy_of(correct_by_batch(hits, 0, len(hits), b), len(hits), b, "per_batch") == pytest.approx(
            authors_accuracy(hits, b), abs=1e-12)
    assert authors("eval.test_drop_last") is False and authors("data.val_loader") is False


def check_val_split():
    from raystudy.core.finetune.data import authors_rows
    from raystudy.data.splits import OFFICIAL_VAL_SOURCES

    for preset in FINETUNING:
        spec = load_preset(preset)
        assert spec.val_split == "authors", preset
        assert {config_value(preset, d, "train_size") for d in spec.datasets} == {0.8}, preset
    for n, seed in ((37, 0), (1000, 42), (8000, 3407)):  # their loader's draw, transcribed
        torch.manual_seed(seed)
        theirs = torch.utils.data.random_split(range(n), [int(0.8 * n), n - int(0.8 * n)])
        train, val = authors_rows(n, seed=seed)
        assert (train.tolist(), val.tolist()) == (list(theirs[0].indices), list(theirs[1].indices))
    # and the pinned draws, which a torch that draws otherwise does not give (the line above would agree)
    assert all(rows_pin(*authors_rows(n, seed)) == pin for (n, seed), pin in VAL_ROWS.items())
    assert list(OFFICIAL_VAL_SOURCES) == authors("data.predefined_val")


def check_drop_last():
    for preset in FINETUNING:
        assert load_preset(preset).drop_last is authors("data.train_loader") is True, preset


def check_crops():
    import torchvision.transforms as T1

    from raystudy.data.transforms import CROP_RATIO, CROP_SCALE, IMAGENET_MEAN, IMAGENET_STD, eval_geometry

    assert authors("data.train_crop") == "RandomResizedCrop(size)"  # torchvision's defaults
    defaults = inspect.signature(T1.RandomResizedCrop).parameters
    assert CROP_SCALE == defaults["scale"].default == (0.08, 1.0)
    assert CROP_RATIO == pytest.approx(defaults["ratio"].default) and CROP_RATIO[0] == 3 / 4
    assert inspect.signature(T1.RandomHorizontalFlip).parameters["p"].default == 0.5
    assert list(IMAGENET_MEAN) == authors("data.normalize_mean") and list(IMAGENET_STD) == authors("data.normalize_std")
    assert [type(t).__name__ for t in eval_geometry(224, "crop")] == ["Resize", "CenterCrop"]
    assert (authors("data.eval_resize"), authors("data.eval_crop")) == ("Resize(size)", "CenterCrop(size)")
    for preset in FINETUNING:
        spec = load_preset(preset)
        assert spec.augment and spec.resize == "crop" and spec.img_size == 224, preset


def _last_block_tokens(model, x) -> torch.Tensor:
    out = {}
    handle = model.blocks[-1].register_forward_hook(lambda m, i, o: out.setdefault("z", o))
    with torch.inference_mode():
        model(x)
    handle.remove()
    return out["z"]


def check_probe():
    """The classifier and the features: the mean over all tokens of the last block's output, L2-normalised
    (``cls_pooling: False``), on a tiny ViT."""
    from raystudy.core.probe import MAX_ITER, make_classifier, probe_features

    assert MAX_ITER == authors("probe.max_iter") and authors("probe_yaml.cls_pooling") is False
    scaler, logistic = [step for _, step in make_classifier(authors("probe_yaml.seed")).steps]
    assert type(scaler).__name__ == "StandardScaler" and type(logistic).__name__ == "LogisticRegression"
    assert (logistic.max_iter, logistic.random_state) == (5000, 42)
    probe = load_preset("paper").probe
    assert probe.seed == authors("probe_yaml.seed") and probe.batch_size == authors("probe_yaml.batch_size")
    assert probe.augment is (authors("data.train_transform") == "train")  # their train split, train transforms
    model = tiny_vit()
    x = torch.randn(3, 3, 32, 32)
    z = _last_block_tokens(model, x).mean(dim=1)
    torch.testing.assert_close(probe_features(model, x), z / z.norm(dim=-1, keepdim=True))


def check_statistics():
    from raystudy.analysis.options import DEFAULT_ALTERNATIVE, DEFAULT_REFERENCE
    from raystudy.analysis.tables import DDOF

    assert authors("plots.std") == "np.asarray(values).std()"  # numpy's default ddof
    assert DDOF == inspect.signature(np.std).parameters["ddof"].default == 0
    assert (DEFAULT_REFERENCE, DEFAULT_ALTERNATIVE) == (authors("plots.wilcoxon_reference"),
                                                        authors("plots.wilcoxon_alternative"))
    assert load_preset("paper").analysis_round == authors("plots.table_decimals")


def check_table_seeds():
    assert load_preset("paper-model-size").analysis_seeds == authors("ablation_model_size_py.table_seeds")
    assert authors("eval_model_size_sh.seeds") == authors("ablation_model_size_py.table_seeds")
    for dataset, p in load_preset("paper").protocols().items():
        if "adamw" in p.optimizers:
            assert p.seeds["adamw"] == authors("ablation_adam_py.table_seeds"), dataset


def check_fixed_run():
    fig5 = {"dataset": authors("plots.fixed_run.dataset").removeprefix("domainnet_"),
            "seed": authors("plots.fixed_run.seed"), "lr": authors("plots.fixed_run.lr"), "optimizer": "sgd"}
    # Fig. 54 (ablation_adam.py, dev, L524-525): `seed = 0`, `lr = f"{float('1e-2') / 100:.2e}"`, AdamW runs
    fig54 = {"dataset": "sketch", "seed": 0, "lr": float(f"{float('1e-2') / 100:.2e}"), "optimizer": "adamw"}
    assert load_preset("paper").fixed_run == [fig5, fig54]


def timm_name(hf_name: str) -> str:
    """Google's ``vit-base-patch16-224-in21k`` -> timm's ``vit_base_patch16_224.orig_in21k`` (the same
    checkpoint: timm's ``orig_in21k`` tag is the official JAX in21k weights)."""
    return hf_name.removesuffix("-in21k").replace("-", "_") + ".orig_in21k"


def check_weights():
    import timm

    assert authors("train.in21k") is authors("analysis.in21k") is True and authors("vit.hub").startswith('f"google/')
    base, large = timm_name(authors("vit.base_name")), timm_name(authors("vit.large_name"))
    for preset in ("paper", "paper-low-data", "plasticity-paper"):
        assert load_preset(preset).model == base, preset
    assert load_preset("paper-model-size").model == large
    assert {base, large, timm_name(authors("vit.huge_name"))} <= set(timm.list_pretrained("vit_*.orig_in21k"))


def authors_subset(labels: np.ndarray, n_classes: int, per_class: int) -> list[int]:
    """The low-data draw of the authors' ``cifar100ld.py`` (lines 93-104), transcribed."""
    st0 = np.random.get_state()
    np.random.seed(42)
    indices = []
    for c in range(n_classes):
        class_indices = np.where(labels == c)[0]
        class_indices = np.random.permutation(class_indices)
        indices.extend(class_indices[:per_class])
    np.random.set_state(st0)
    return [int(i) for i in indices]


def check_low_data_subsets():
    from raystudy.data.splits import AUTHORS_SEED, authors_low_data, authors_per_class
    from raystudy.vocab import LOW_DATA

    assert "authors" in LOW_DATA and AUTHORS_SEED == authors("ld_subset.seed") == authors("ld_subset.domainnet_seed")
    assert authors_per_class(100) == authors("ld_subset.samples") // 100 and authors_per_class(37) == 1000 // 37
    assert authors_per_class(345, "domainnet") == authors("ld_subset.domainnet_per_class")
    labels = np.random.default_rng(1).integers(0, 7, size=300)
    assert authors_low_data(labels, 7, 1000 // 7) == authors_subset(labels, 7, 1000 // 7)
    assert authors_low_data(labels, 7, 10) == authors_subset(labels, 7, 10)


def authors_loader_positions(n: int, batch_size: int, n_steps: int) -> list[int]:
    """The rows an unshuffled ``DataLoader(drop_last=True)`` under ``make_iterable`` yields in ``n_steps``
    batches: ``build_loader`` and ``make_iterable`` of the authors' ``src/vitef/data/images/utils.py``."""
    epoch = [i for b in range(n // batch_size) for i in range(b * batch_size, (b + 1) * batch_size)]
    return [epoch[k % len(epoch)] for k in range(batch_size * n_steps)]


def check_vit_pairs():
    from raystudy.data.pairing import sequential_positions

    b, steps = authors("analysis_sh.batch_size"), authors("analysis_sh.n_steps")
    assert authors("data.loader_shuffle") == '(mode == "train")' and authors("data.loader_drop_last") is True
    assert (authors("analysis.pretrain_mode"), authors("analysis.downstream_mode")) == ("val", "test")
    sizes = {"plasticity-paper": (b, steps), "paper": (b, steps),
             "plasticity-dinov3": (authors("dinov3_sh.7b.batch_size"), authors("dinov3_sh.7b.n_steps"))}
    for preset, (batch, n_steps) in sizes.items():
        p = load_preset(preset).plasticity
        got = (p.pairing, p.batch_size, p.pairs, p.pretrain_split)
        assert got == ("sequential", batch, batch * n_steps, "all"), preset
    for n_down in (10000, 2000, 6149, 3669):  # CIFAR test, a CIFAR-10-C test split, Flowers102, Pets
        pre, down = sequential_positions(50000, n_down, b * steps, b)
        assert down.tolist() == authors_loader_positions(n_down, b, steps), n_down
        assert pre.tolist() == authors_loader_positions(50000, b, steps)


def check_gpt2():
    p = load_preset("plasticity-gpt2").plasticity
    assert p.seq_len == authors("gpt2_sh.seq_len") and authors("gpt2.max_length") == "seq_len"
    assert p.text_rows == "padded" and (authors("gpt2.truncation"), authors("gpt2.padding")) == (True, "max_length")
    assert p.mha_input == "normed" and authors("gpt2.ln_1") == "block.ln_1(out)" and authors("gpt2.attn") is None
    assert p.pairs == authors("gpt2_sh.batch_size") * authors("gpt2_sh.n_steps")
    assert p.pairing == "random" and authors("gpt2.shuffle") is True
    assert p.pretrain_split == authors("gpt2.pretrain_mode") == authors("gpt2.downstream_mode") == "test"


def check_dinov3_fc1():
    assert load_preset("plasticity-dinov3").plasticity.gated_fc1 == "up"
    assert authors("dinov3.fc1") == "block.mlp.up_proj(out)"


#: the ledger's "What matches" lines, by the test id its table names
MATCHES = {
    "periods": check_periods, "lr_grids": check_lr_grids, "seeds": check_seeds,
    "configurations": check_configurations, "sgd": check_sgd, "adamw": check_adamw,
    "weight_decay": check_weight_decay, "clipping": check_clipping, "schedule": check_schedule,
    "batch": check_batch, "precision": check_precision, "final_norm": check_final_norm,
    "head_init": check_head_init, "accuracy": check_accuracy, "val_split": check_val_split,
    "drop_last": check_drop_last, "crops": check_crops, "probe": check_probe, "statistics": check_statistics,
    "table_seeds": check_table_seeds, "fixed_run": check_fixed_run, "weights": check_weights,
    "low_data_subsets": check_low_data_subsets, "vit_pairs": check_vit_pairs, "gpt2": check_gpt2,
    "dinov3_fc1": check_dinov3_fc1,
}


@pytest.mark.parametrize("item", list(MATCHES))
def test_what_matches(item):
    MATCHES[item]()


# ---------------------------------------------------------------------------------------------------------
# the page itself
# ---------------------------------------------------------------------------------------------------------


def ledger_tables() -> list[tuple[str, list[str], list[list[str]]]]:
    """``(section heading, header cells, rows of cells)`` of every Markdown table of the ledger."""
    tables, heading, block = [], "", []
    for line in [*LEDGER.read_text().splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if block:
            tables.append((heading, block[0], [r for r in block[2:]]))
            block = []
        if line.startswith("## "):
            heading = line[3:]
    return tables


def difference_tables():
    return [(h, head, rows) for h, head, rows in ledger_tables() if head[0] in ("difference",)]


def test_what_matches_table_names_every_check():
    (table,) = [(head, rows) for h, head, rows in ledger_tables() if h == "What matches"]
    head, rows = table
    assert head[-1] == "test" and all(len(r) == len(head) for r in rows)
    named = [r[-1].strip("`") for r in rows]
    assert len(named) == len(set(named)) and set(named) == set(MATCHES), set(named) ^ set(MATCHES)


def test_every_difference_has_an_effect_and_a_way_to_close_it():
    tables = difference_tables()
    assert len(tables) >= 6
    for heading, head, rows in tables:
        assert head[-2:] == ["effect", "closes it"], (heading, head)
        for row in rows:
            assert len(row) == len(head), (heading, row)
            assert row[-2].startswith(EFFECTS), (heading, row[0], row[-2])
            closes = row[-1]
            if closes.startswith("none"):
                assert len(closes) > len("none") + 3, f"{heading} / {row[0]}: say why nothing closes it"


def section_presets(heading: str) -> list[str]:
    names = [n for n in re.findall(r"`([^`]+)`", heading) if n in preset_names()]
    return names or list(FINETUNING)


def command_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of the command line and its sub-commands -> its action."""
    flags = {}
    for action in parser._actions:
        flags.update({s: action for s in action.option_strings})
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags.update(command_flags(sub))
    return flags


SETTING = re.compile(r"^([A-Za-z_][\w.-]*): (.+)$")


def check_option(token: str, presets: list[str], closed: bool, flags: dict) -> str | None:
    """``None`` when the option ``token`` of a "closes it" cell exists (and, in a closed cell, holds in
    ``presets``), else what is wrong."""
    from raystudy.cli import build_parser
    from raystudy.study.checks import SpecError

    if token.startswith("raystudy "):
        try:
            build_parser().parse_args(shlex.split(token)[1:])
        except SystemExit:
            return f"the command line refuses {token!r}"
        return None
    if token.startswith("--"):
        flag, *value = token.split(maxsplit=1)
        action = flags.get(flag)
        if action is None or (value and action.choices and value[0] not in action.choices):
            return f"no flag {token!r}"
        return None
    if m := SETTING.match(token):
        key, value = m[1], yaml.safe_load(m[2])
        for preset in presets:
            try:
                load_preset(preset).with_overrides({key: value}).validate(check_files=False)
            except (SpecError, ValueError, TypeError, KeyError) as e:
                return f"{preset} refuses {token!r}: {e}"
            if closed and _resolved(load_preset(preset), key) != value:
                return f"{preset}: {key} is {_resolved(load_preset(preset), key)!r}, the ledger says {value!r}"
        return None
    if token.startswith("tests/"):
        return None if (ROOT / token).exists() else f"no {token}"
    return f"{token!r} is neither a setting, a flag, a command nor a path"


def _resolved(spec, key: str) -> Any:
    value = spec
    for part in key.split("."):
        value = getattr(value, part)
    return value


def test_every_option_that_closes_a_difference_exists():
    from raystudy.cli import build_parser

    flags = command_flags(build_parser())
    problems = []
    for heading, _, rows in difference_tables():
        for row in rows:
            tokens = re.findall(r"`([^`]+)`", row[-1])
            named = [t for t in tokens if t in preset_names()]  # a cell may name the presets it is about
            presets, closed = named or section_presets(heading), row[-1].startswith("closed")
            for token in (t for t in tokens if t not in named):
                if problem := check_option(token, presets, closed, flags):
                    problems.append(f"{heading} / {row[0]}: {problem}")
    assert not problems, "\n".join(problems)


def test_the_option_check_refuses_what_does_not_exist():
    from raystudy.cli import build_parser

    flags = command_flags(build_parser())
    assert check_option("data_path: decode", ["paper"], False, flags) is None
    assert check_option("--low-data authors", ["paper"], False, flags) is None
    assert "no flag" in check_option("--low-data everything", ["paper"], False, flags)
    assert "refuses" in check_option("data_path: teleport", ["paper"], False, flags)
    assert "refuses" in check_option("no_such_setting: 1", ["paper"], False, flags)
    assert "ledger says" in check_option("train_final_norm: false", ["paper"], True, flags)
    assert "refuses" in check_option("raystudy data prepare cifar10c --split-rule nowhere --out O", [], False, flags)
    assert "neither" in check_option("cifar10c-motion_blur-5-ld", [], False, flags)


def test_low_data_evaluation_paragraph_says_why_it_is_not_compared():
    """Table 3's evaluation: ``eval_ld.sh`` and ``finetuning_ld.sh`` share the log directory pattern but not
    the dataset names (CIFAR-100's aside), so the evaluated directories are not the trained ones."""
    text = " ".join(LEDGER.read_text().split())
    assert "Table 3's evaluation cannot be recovered" in text and "Effect: numbers" in text
    assert authors("eval_ld_sh.cifar100.log_dir") == authors("finetuning_ld_sh.cifar100.log_dir")
    trained = {d: authors(f"finetuning_ld_sh.{d}.dataset") for d in ("cifar100", "cifar10c-motion_blur", "clipart")}
    tested = {d: authors(f"eval_ld_sh.{d}.dataset") for d in trained}
    assert [d for d in trained if trained[d] == tested[d]] == ["cifar100"]
    assert authors("finetuning_ld_sh.cifar100.lrs") == [0.01] and authors("finetuning_ld_sh.cifar100.seeds") == [0]


def test_the_differences_are_what_the_authors_files_say():
    """The facts of the difference tables that the recorded files show: each difference is there."""
    paper = load_preset("paper")
    adamw = {d: p.seeds["adamw"] for d, p in paper.protocols().items() if "adamw" in p.optimizers}
    assert all(authors(f"adam_sh.{d}.seeds") == [0, 42, 3407] and s == [0] for d, s in adamw.items())  # AdamW
    assert authors("finetuning_sh.every_comp") == "${!comps[@]}" and "Emb" not in paper.configurations  # Emb runs
    ld_name = (f"{authors('finetuning_ld_sh.cifar10c-motion_blur.dataset')}-corruption-"  # CIFAR-10-C's pool
               f"{authors('finetuning_ld_sh.cifar10c-motion_blur.corruption')}-severity-5")
    assert authors("data.cifar10_c_branch") not in ld_name and authors("data.cifar10ld_c_branch") in ld_name
    assert authors("data.cifar10ld_c_import") == "vitef.data.images.cifar10_c"
    size = load_preset("paper-model-size")  # where ViT-L's epoch ends
    assert (authors("model_size_sh.batch_size"), authors("model_size_sh.grad_acc_steps")) == (128, 4)
    assert size.drop_last and size.micro_batch_size * 4 == size.batch_size
    assert authors("model_size_sh.huge.model_name") == "huge" and "huge" not in size.model  # ViT-H/14
    gpt2 = load_preset("plasticity-gpt2")  # GPT-2's sides
    assert authors("gpt2.pretrain_side") == "wikitext" and gpt2.pretrain_store == "agnews"
    dinov3 = load_preset("plasticity-dinov3")  # DINOv3's model
    assert authors("dinov3_sh.7b.model_size") == "vit7b16" and dinov3.model == "vit_small_patch16_dinov3"


def source_line(key: str) -> int:
    """The (first) line number of the authors' value ``key``."""
    return int(re.search(r":(\d+)", DATA["values"][key]["source"])[1])


def test_the_probe_draws_its_rows_after_its_model():
    """The ledger's "probe's training rows": both scripts seed torch's global generator on entering their
    ``Utility`` (``set_seed``: ``torch.manual_seed``); ``train.py`` then builds its loaders (``random_split``)
    and only then its model, so its val rows are ``authors_rows(n, seed)``; ``linear_probing.py`` builds its
    model first, whose construction draws from that generator (a layer's initialisation: here one
    ``nn.Linear``), so its rows are a later draw than ``authors_rows(n, 42)``."""
    from raystudy.core.finetune.data import authors_rows

    assert authors("utility.set_seed") == "set_seed(self.seed)"
    assert authors("config.manual_seed") == "torch.manual_seed(seed=seed)"
    assert source_line("train.seeded") < source_line("train.train_loader") < source_line("train.build_model")
    assert source_line("probe.seeded") < source_line("probe.build_model") < source_line("probe.train_loader")
    assert authors("probe_yaml.seed") == 42
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(42)
        torch.nn.Linear(8, 8)  # what any model construction does before the probe's loaders are built
        theirs = torch.utils.data.random_split(range(1000), [800, 200])
    train, val = authors_rows(1000, 42)
    assert list(theirs[0].indices) != train.tolist() and sorted(theirs[1].indices) != sorted(val.tolist())


def test_vit_l_and_h_pairs_start_over_where_their_batches_of_32_end():
    """The ledger's "ViT-L/16 and ViT-H/14 pairs": ``analysis.sh``'s 32 x 400 for both, restarted loaders; the
    preset's batch of 64 restarts clipart's 9,768 test images elsewhere (and only those of the paper's test
    splits), ``plasticity.batch_size: 32`` restarts them where theirs do."""
    from raystudy.data.pairing import sequential_positions

    b, steps = authors("analysis_sh.large.batch_size"), authors("analysis_sh.large.n_steps")
    assert (b, steps) == (authors("analysis_sh.huge.batch_size"), authors("analysis_sh.huge.n_steps")) == (32, 400)
    assert (authors("analysis_sh.large.model_name"), authors("analysis_sh.huge.model_name")) == ("large", "huge")
    assert authors("data.make_iterable") == "repeat(dataloader)"
    preset = load_preset("plasticity-paper")
    assert b * steps == preset.plasticity.pairs and preset.plasticity.batch_size == 64
    larger = preset.with_overrides({"plasticity.batch_size": 32})
    larger.validate(check_files=False)
    clipart = 48_837 - int(0.8 * 48_837)
    assert clipart == 9_768
    for n in (10_000, 2_000, 6_149, 3_669, clipart):
        theirs = authors_loader_positions(n, b, steps)
        assert sequential_positions(50_000, n, b * steps, larger.plasticity.batch_size)[1].tolist() == theirs
        ours = sequential_positions(50_000, n, b * steps, preset.plasticity.batch_size)[1]
        differ = int((ours != np.asarray(theirs)).sum())
        assert differ == (3_072 if n == clipart else 0), n
        if n == clipart:
            assert (ours[9_728], theirs[9_728], theirs[9_760]) == (0, 9_728, 0)
    pre = sequential_positions(50_000, 14_000, b * steps, 64)[0]
    assert pre.tolist() == list(range(12_800))  # the ImageNet side never starts over


def test_the_logged_training_loss_of_micro_batches():
    """The ledger's "logged training loss of an update made of micro-batches": the authors' ``train.py``
    loop, transcribed, logs the last micro-batch's loss; raystudy's step logs the mean over the update's
    images (the mean of its micro-batches' losses), on a linear model with speckle noise's 4 micro-batches."""
    from raystudy.core.finetune.step import train_step

    speckle = "finetuning_sh.cifar10c-speckle_noise"
    grad_acc, micro = authors(f"{speckle}.grad_acc_steps"), authors(f"{speckle}.batch_size")
    assert (grad_acc, micro) == (authors("model_size_sh.grad_acc_steps"), authors("model_size_sh.batch_size"))
    protocol = load_preset("paper").protocol("cifar10c-speckle_noise")
    assert (protocol.micro_batch_size, load_preset("paper").batch_size) == (micro, micro * grad_acc)
    assert authors("train.loss_scaled") == "loss / config.grad_acc_steps" and authors("train.accumulate") == "continue"
    assert authors("train.logged_loss") == "loss.item() * config.grad_acc_steps"

    torch.manual_seed(0)
    model, b = torch.nn.Linear(6, 3), 4  # micro-batches of 4 stand for their 128
    batches = [(torch.randn(b, 6) * (1 + k), torch.randint(0, 3, (b,))) for k in range(grad_acc)]
    with torch.no_grad():
        per_micro = [float(torch.nn.functional.cross_entropy(model(x), y)) for x, y in batches]
    logged = None
    for acc_step, (x, y) in enumerate(batches, start=1):  # train.py's loop over one update
        loss = torch.nn.functional.cross_entropy(model(x), y) / grad_acc
        if acc_step % grad_acc != 0:
            continue
        logged = loss.item() * grad_acc
    assert logged == pytest.approx(per_micro[-1], rel=1e-6)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    ours = train_step(model, opt, sched, batches, share=b * grad_acc, trainable=list(model.parameters()),
                      group=list(model.parameters()))
    assert ours.loss == pytest.approx(sum(per_micro) / grad_acc, rel=1e-6)
    assert abs(ours.loss - logged) > 0.05
