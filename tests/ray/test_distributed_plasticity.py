"""The Ray plasticity pipeline against the core computed directly on the same pairs.

Stores are miniature (20x24 PNGs, 16-row shards with mixed splits); the model is the conftest tiny ViT,
saved to a weights file that every actor loads. The reference never touches the pipeline's code: it reads
each split with ``read_split``, draws the pairs with the documented numpy recipe, and calls the core
``pair_rates_tensor`` + ``rates_frame`` + ``summarize``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from raystudy.core.bounds import measure_token_stats, upper_bounds
from raystudy.core.plasticity import pair_rates_tensor, rates_frame, summarize
from raystudy.core.plasticity_stats import StreamingMoments
from raystudy.data.pairing import pair_positions
from raystudy.data.rows import locate_split, resolve_pretrain_split
from raystudy.data.store import StoreError, read_split, write_store
from raystudy.data.transforms import transform_batch
from raystudy.distributed.plasticity import PlasticityJob, run_plasticity
from raystudy.distributed.plasticity_output import combine_runs
from tests.support.models import tiny_vit
from tests.support.stores import png_bytes

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)
TIMM_NAME = "vit_tiny_patch16_224"  # overridden to the tiny sizes by TINY
PAIRS, SEED = 32, 7
RTOL = 1e-5


def _store(path, *, name, seed, counts, rows_per_shard=16):
    """A store whose splits are interleaved across small shards (so row locations are non-trivial)."""
    rng = np.random.default_rng(seed)
    splits = [s for s, n in zip(("train", "val", "test"), counts) for _ in range(n)]
    rng.shuffle(splits)
    rows = [{"image": png_bytes(rng), "label": i % 3, "split": s, "index": 10_000 * seed + 3 * i}
            for i, s in enumerate(splits)]
    write_store(rows, path, name=name, source="test", classes=["a", "b", "c"], rows_per_shard=rows_per_shard)
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distplast")
    # pretraining store without a test split: the pipeline falls back to val
    pre = _store(root / "pre", name="pretrain", seed=1, counts=(6, 45, 0))
    down_a = _store(root / "down_a", name="alpha", seed=2, counts=(5, 3, 40))
    down_b = _store(root / "down_b", name="beta", seed=3, counts=(4, 0, 20))  # 20 < PAIRS rows: reuse
    torch.manual_seed(1)  # not the controls' seed 0: the model and its random init differ
    model = tiny_vit().eval()
    weights = root / "tiny.pt"
    torch.save(model.state_dict(), weights)
    return {"root": root, "pre": pre, "down": [down_a, down_b], "weights": str(weights), "model": model}


def _positions(n_pre, n_down, pairs, seed):
    """The documented pairing recipe, written out independently of the pipeline."""
    rng = np.random.default_rng(seed)

    def draw(n):
        return np.concatenate([rng.permutation(n) for _ in range(math.ceil(pairs / n))])[:pairs]

    return draw(n_pre), draw(n_down)


def _control_model():
    """The random-init control of the job's model, built here with timm alone: seed 0 (``control_seed``'s
    default), then ``timm.create_model``."""
    import timm

    torch.manual_seed(0)
    return timm.create_model(TIMM_NAME, **TINY).eval()


def _component_control(model):
    """The component control of ``model``, built here: :func:`_control_model` with ``model``'s embedding tensors
    (patch projection, class token, position embedding, by name) copied in."""
    control = _control_model()
    with torch.no_grad():
        for name in ("patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token", "pos_embed"):
            control.get_parameter(name).copy_(model.get_parameter(name))
    return control


def _reference(setup, mode, model=None, amp_dtype=None):
    """Core rates and summary per downstream dataset on the pipeline's pairs, plus the pretraining images
    (``amp_dtype``: the core's forward under that autocast)."""
    model = model if model is not None else setup["model"]
    pre = read_split(setup["pre"], "val")
    rates, pre_images = [], None
    for store, name in zip(setup["down"], ("alpha", "beta")):
        down = read_split(store, "test")
        a, b = _positions(pre.num_rows, down.num_rows, PAIRS, SEED)
        x = transform_batch([pre["image"][int(i)].as_py() for i in a], train=False, size=32)
        y = transform_batch([down["image"][int(i)].as_py() for i in b], train=False, size=32)
        pre_images = x
        df = rates_frame(pair_rates_tensor(model, x, y, mode=mode, amp_dtype=amp_dtype))
        df.insert(0, "mode", mode)
        df.insert(0, "dataset", name)
        df.insert(0, "model", TIMM_NAME)
        rates.append(df)
    rates = pd.concat(rates, ignore_index=True)
    return rates, summarize(rates), pre_images


_RUNS: dict = {}


def _run(setup, workers, batch_size, mode="embedding", tag="", **extra):
    """Run the pipeline once per distinct arguments (``tag`` tells apart runs under an injected fault)."""
    key = (workers, batch_size, mode, tag, tuple(sorted(extra.items())))
    if key not in _RUNS:
        out = setup["root"] / f"out-{workers}-{batch_size}-{mode}-{len(_RUNS)}{tag}"
        extra.setdefault("figures", False)
        job = PlasticityJob(model=TIMM_NAME, weights=setup["weights"], model_kwargs=TINY, pretrain=setup["pre"],
                            downstream=setup["down"], pairs=PAIRS, batch_size=batch_size, mode=mode,
                            workers=workers, seed=SEED, out_dir=str(out), **extra)
        summary = run_plasticity(job, progress=False)
        _RUNS[key] = (summary, {t: pd.read_parquet(out / f"{t}.parquet") for t in
                                ("rates", "plasticity", "bounds", "pairs")})
    return _RUNS[key]


# ---------------------------------------------------------------------------------------------- pure parts


def test_pair_positions_follow_the_seeded_recipe():
    pre, down = pair_positions(45, 40, PAIRS, SEED)
    ref_pre, ref_down = _positions(45, 40, PAIRS, SEED)
    np.testing.assert_array_equal(pre, ref_pre)
    np.testing.assert_array_equal(down, ref_down)
    assert len(set(pre.tolist())) == PAIRS  # enough rows: no image used twice
    # the pretraining side does not depend on the downstream store
    np.testing.assert_array_equal(pair_positions(45, 7, PAIRS, SEED)[0], pre)
    # fewer rows than pairs: whole shuffles are appended, every row used floor/ceil(N / n) times
    _, small = pair_positions(45, 10, 25, SEED)
    counts = np.bincount(small, minlength=10)
    assert sorted(set(counts.tolist())) == [2, 3] and counts.sum() == 25
    assert sorted(small[:10].tolist()) == list(range(10))
    assert not np.array_equal(pair_positions(45, 40, PAIRS, SEED + 1)[0], pre)


def test_locate_split_points_at_the_rows_of_read_split(setup):
    import pyarrow.parquet as pq

    rows = locate_split(setup["pre"], "val")
    table = read_split(setup["pre"], "val")
    assert len(rows) == table.num_rows == 45 and rows.name == "pretrain"
    assert len(set(rows.shard.tolist())) > 1  # the split spans several shards
    np.testing.assert_array_equal(rows.index, table["index"].to_numpy())
    for i in (0, 17, 44):
        img = pq.read_table(rows.shards[rows.shard[i]], columns=["image"])["image"][int(rows.row[i])].as_py()
        assert img == table["image"][i].as_py()


def test_resolve_pretrain_split_falls_back_to_val(setup):
    assert resolve_pretrain_split(setup["pre"], "test") == ("val",)
    assert resolve_pretrain_split(setup["down"][0], "test") == ("test",)
    with pytest.raises(StoreError, match="split 'val' is empty"):
        resolve_pretrain_split(setup["down"][1], "val")


def test_locate_split_of_several_splits_keeps_store_order(setup):
    """The rows of ``("val", "test")`` are those of either split, in the order the store holds them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raystudy.data.store import shard_paths

    store = setup["down"][0]
    rows = locate_split(store, ("val", "test"))
    every = pa.concat_tables([pq.read_table(p, columns=["split", "index"]) for p in shard_paths(store)]).to_pandas()
    expected = every[every.split.isin(["val", "test"])]["index"].tolist()
    assert rows.index.tolist() == expected and len(rows) == 43 and rows.split == "val+test"
    by_split = every[every.split == "val"]["index"].tolist() + every[every.split == "test"]["index"].tolist()
    assert expected != by_split  # the store interleaves the splits: not one split after the other


def test_streaming_moments_equal_summarize():
    rng = np.random.default_rng(0)
    rates = rng.gamma(2.0, 0.7, size=(103, 3, 5)).astype(np.float32) + 10.0  # large mean, small spread
    m = StreamingMoments()
    start = 0
    for size in (1, 7, 50, 2, 43):
        m.update(rates[start:start + size])
        start += size
    ref = summarize(rates_frame(rates))
    got = m.frame()
    assert got[["layer", "component"]].equals(ref[["layer", "component"]])
    for col in ("plasticity", "std", "ci95"):
        np.testing.assert_allclose(got[col], ref[col], rtol=1e-12)
    assert (got["n_pairs"] == 103).all()
    one = StreamingMoments()
    one.update(rates[:1])
    assert (one.frame()["std"] == 0).all()


def test_bad_jobs_fail_before_any_work(setup, tmp_path):
    base = dict(model=TIMM_NAME, pretrain=setup["pre"], downstream=setup["down"], out_dir=str(tmp_path))
    for bad, msg in [({"mode": "tokens"}, r"plasticity job: mode: 'tokens' expected one of \['embedding', 'hidden'\]"),
                     ({"pretrain_split": "dev"}, "pretrain_split: unknown value 'dev'"),
                     ({"pairs": 0}, "plasticity job: pairs: 0 must be an integer >= 1"),
                     ({"workers": 0}, "workers: 0 must be an integer >= 1"),
                     ({"batch_size": 0}, "batch_size: 0 must be an integer"),
                     ({"cpus_per_worker": 0}, "cpus_per_worker: 0 must be a positive number"),
                     ({"radius": float("inf")}, "radius: inf must be None or a positive number")]:
        with pytest.raises(ValueError, match=msg):
            run_plasticity(PlasticityJob(**{**base, **bad}), progress=False)
    with pytest.raises(FileNotFoundError, match="no-such.pt"):
        run_plasticity(PlasticityJob(**base, weights=str(tmp_path / "no-such.pt")), progress=False)
    with pytest.raises(ValueError, match=r"share the dataset name\(s\) \['alpha'\]"):
        run_plasticity(PlasticityJob(**{**base, "downstream": [setup["down"][0]] * 2}), progress=False)
    with pytest.raises(StoreError, match="not a prepared store"):
        run_plasticity(PlasticityJob(**{**base, "downstream": [str(tmp_path)]}), progress=False)


# ---------------------------------------------------------------------------------------------- with Ray


@pytest.mark.parametrize("workers,batch_size,mode", [(1, 8, "embedding"), (2, 5, "embedding"), (1, 5, "hidden")])
def test_pipeline_equals_core_on_the_same_pairs(ray_session, setup, workers, batch_size, mode):
    figures = mode == "hidden"  # one run draws the figures
    summary, got = _run(setup, workers, batch_size, mode, **({"figures": True} if figures else {}))
    ref_rates, ref_plast, pre_images = _reference(setup, mode)

    # plasticity.parquet: the streamed reduction equals summarize() of the core rates, for the model
    # (weights pretrained) and for its controls on the same pairs: the random init (weights random_init) and
    # the random init with the model's embedding (weights random_blocks)
    plast = got["plasticity"]
    assert list(plast.columns[:9]) == ["model", "dataset", "mode", "layer", "component", "plasticity", "std",
                                       "ci95", "n_pairs"]
    assert len(got["rates"]) == 3 * len(ref_rates) == 3 * 2 * PAIRS * 3 * 5
    controls = {w: _reference(setup, mode, m)[:2] for w, m in (("random_init", _control_model()),
                                                               ("random_blocks", _component_control(setup["model"])))}
    for a, b in (("pretrained", "random_blocks"), ("random_init", "random_blocks")):  # three measurements
        assert not np.allclose(plast[plast["weights"] == a]["plasticity"], plast[plast["weights"] == b]["plasticity"],
                               rtol=1e-3), (a, b)
    for weights, (ref_r, ref_p) in (("pretrained", (ref_rates, ref_plast)), *controls.items()):
        sub = plast[plast["weights"] == weights].reset_index(drop=True)
        pd.testing.assert_frame_equal(sub[["model", "dataset", "mode", "layer", "component", "n_pairs"]],
                                      ref_p[["model", "dataset", "mode", "layer", "component", "n_pairs"]])
        for col in ("plasticity", "std", "ci95"):
            np.testing.assert_allclose(sub[col], ref_p[col], rtol=RTOL, err_msg=f"{weights} {col}")
        assert sub["init_seed"].isna().all() if weights == "pretrained" else (sub["init_seed"] == 0).all()
        # rates.parquet: every pair's rates, in pair order
        rates = got["rates"][got["rates"]["weights"] == weights].drop(columns="weights").reset_index(drop=True)
        assert len(rates) == len(ref_r) == 2 * PAIRS * 3 * 5
        pd.testing.assert_frame_equal(rates.drop(columns="rate"), ref_r.drop(columns="rate"))
        np.testing.assert_allclose(rates["rate"], ref_r["rate"], rtol=RTOL, err_msg=weights)

    # pairs.parquet: which images formed each pair
    pairs = got["pairs"]
    pre_idx = read_split(setup["pre"], "val")["index"].to_numpy()
    for store, name in zip(setup["down"], ("alpha", "beta")):
        down_idx = read_split(store, "test")["index"].to_numpy()
        a, b = _positions(len(pre_idx), len(down_idx), PAIRS, SEED)
        sub = pairs[pairs.dataset == name]
        np.testing.assert_array_equal(sub["pretrain_index"], pre_idx[a])
        np.testing.assert_array_equal(sub["downstream_index"], down_idx[b])

    # bounds.parquet: upper_bounds with radius and sigma measured on the same embedded pretraining images
    stats = measure_token_stats(setup["model"], pre_images)
    ref_bounds = upper_bounds(setup["model"], radius=stats.radius, seq_len=stats.seq_len, sigma=stats.sigma)
    bounds = got["bounds"]
    assert (bounds["model"] == TIMM_NAME).all() and (bounds["seq_len"] == 17).all()
    assert (bounds["n_sequences"] == PAIRS).all()
    np.testing.assert_allclose(bounds["radius"], stats.radius, rtol=RTOL)
    np.testing.assert_allclose(bounds["sigma"], stats.sigma, rtol=RTOL)
    np.testing.assert_allclose(bounds["bound"], ref_bounds["bound"], rtol=RTOL)

    assert summary["datasets"]["alpha"]["n_pairs"] == summary["datasets"]["beta"]["n_pairs"] == PAIRS
    assert summary["datasets"]["beta"]["downstream_reuse"] == 2
    assert summary["pretrain"]["split"] == "val" and summary["pairs_per_s"] > 0
    assert not list(setup["root"].glob(f"out-{workers}-{batch_size}-{mode}-*/.*stage*"))  # staging removed
    assert not list(setup["root"].glob(f"out-{workers}-{batch_size}-{mode}-*/.*.tmp"))
    if figures:  # per dataset: plasticity across depth and the rate distribution
        files = [Path(f) for f in summary["figures"]]
        assert files and all(f.is_file() and f.stat().st_size > 0 for f in files)
        for name in ("alpha", "beta"):
            assert {f.stem for f in files} >= {f"plasticity_depth_{TIMM_NAME}_{name}_hidden",
                                               f"rate_distribution_{TIMM_NAME}_{name}_hidden"}


def test_bf16_rates_are_another_measurement_and_say_so(ray_session, setup):
    """``precision: bf16`` runs the actors' forward under bf16 autocast (on the CPU too): its rates are the
    core's bf16 rates on the same pairs, other numbers than the fp32 run's, and ``plasticity.parquet``'s
    ``precision`` column tells the two apart (the fp32 run: ``auto`` on CPU actors)."""
    _, fp32 = _run(setup, 1, 8)
    _, bf16 = _run(setup, 1, 8, precision="bf16", control="none")
    assert set(fp32["plasticity"]["precision"]) == {"fp32"} and set(bf16["plasticity"]["precision"]) == {"bf16"}
    ref_rates, ref_plast, _ = _reference(setup, "embedding", amp_dtype=torch.bfloat16)
    np.testing.assert_allclose(bf16["rates"]["rate"], ref_rates["rate"], rtol=RTOL)
    np.testing.assert_allclose(bf16["plasticity"]["plasticity"], ref_plast["plasticity"], rtol=RTOL)
    fp32_plast = fp32["plasticity"][fp32["plasticity"]["weights"] == "pretrained"].reset_index(drop=True)
    gap = np.abs(bf16["plasticity"]["plasticity"] / fp32_plast["plasticity"] - 1)
    assert 1e-4 < gap.max() < 0.1  # bf16's 8-bit mantissa: another number, near the fp32 one


def test_combine_runs_concatenates_tables_and_refuses_other_pairs(ray_session, setup, tmp_path):
    import shutil

    runs = []
    for args, extra in (((1, 8, "embedding"), {}), ((1, 5, "hidden"), {"figures": True})):  # cached runs
        summary, tables = _run(setup, *args, **extra)
        runs.append((Path(summary["out_dir"]), tables))
    paths = combine_runs([d for d, _ in runs], tmp_path / "all")
    for table in ("rates", "plasticity", "bounds"):
        got = pd.read_parquet(paths[table])
        expected = pd.concat([t[table] for _, t in runs], ignore_index=True)
        pd.testing.assert_frame_equal(got, expected, check_exact=True, obj=table)
    pd.testing.assert_frame_equal(pd.read_parquet(paths["pairs"]), runs[0][1]["pairs"])
    assert sorted(set(pd.read_parquet(paths["rates"])["mode"])) == ["embedding", "hidden"]

    # a run on other pairs cannot join; a run whose rates have another schema leaves no rates file behind
    other = tmp_path / "other"
    shutil.copytree(runs[1][0], other)
    pairs = runs[1][1]["pairs"].assign(pretrain_index=lambda f: f["pretrain_index"] + 1)
    pairs.to_parquet(other / "pairs.parquet", index=False)
    with pytest.raises(ValueError, match="other stores or seeds"):
        combine_runs([runs[0][0], other], tmp_path / "bad")
    shutil.copy(runs[0][0] / "pairs.parquet", other / "pairs.parquet")
    runs[1][1]["rates"].astype({"layer": "int32"}).to_parquet(other / "rates.parquet", index=False)
    with pytest.raises(ValueError, match="is not the rates schema"):
        combine_runs([runs[0][0], other], tmp_path / "bad")
    assert sorted(p.name for p in (tmp_path / "bad").iterdir()) == ["bounds.parquet", "pairs.parquet",
                                                                     "plasticity.parquet"]


def test_actor_crash_mid_run_gives_identical_numbers(ray_session, setup, faults):
    _, clean = _run(setup, 1, 8)  # shared with the first equality test
    faults(crash_at_batch=2)  # the first actor to reach its 2nd batch kills its own process
    summary, crashed = _run(setup, 1, 8, tag="-crash")
    marker = list((setup["root"]).glob("out-1-8-embedding-*/.plasticity-crash-injected"))
    assert len(marker) == 1 and marker[0].parent.name.endswith("-crash"), "the injected crash did not fire"
    assert "exited at its batch 2" in marker[0].read_text()
    for table in ("rates", "plasticity", "bounds", "pairs"):
        pd.testing.assert_frame_equal(crashed[table], clean[table], check_exact=True, obj=table)
    assert summary["n_pairs"] == 2 * PAIRS


def test_actors_that_leave_no_cpu_for_loading_are_refused(ray_session, setup, tmp_path):
    # 2 CPUs in the test cluster: 4 actors x 0.5 CPU would starve the load tasks and hang forever
    job = PlasticityJob(model=TIMM_NAME, weights=setup["weights"], model_kwargs=TINY, pretrain=setup["pre"],
                        downstream=setup["down"][:1], pairs=8, workers=4, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"4 x 0.5 CPUs plus 0.25 for a load task exceed the cluster's 2 CPUs"):
        run_plasticity(job, progress=False)
    assert not list(tmp_path.glob(".plasticity-stage-*")) and not (tmp_path / "rates.parquet").exists()
