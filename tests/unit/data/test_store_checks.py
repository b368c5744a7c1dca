"""A prepared store's checks: a truncated shard named by the shallow and the full check, row counts against
``dataset.json``, old stores without a shard list, malformed counts, and a study stopped before launch."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raystudy.cli import main
from raystudy.data.store import (
    META_FILE,
    StoreError,
    _file_sha256,
    check_store,
    compute_checksum,
    read_meta,
    shard_paths,
    verify_store,
    write_store,
)
from tests.support.stores import make_store

N_PER_SPLIT = (40, 10, 20)  # make_store's default: train, val, test


def _resharded(store: str, out: Path, rows_per_shard: int) -> str:
    """The same rows as ``store`` cut into several shards."""
    rows = [r for p in shard_paths(store) for r in pq.read_table(p).to_pylist()]
    meta = read_meta(store)
    write_store(rows, out, name=meta["name"], source="test", classes=meta["classes"], rows_per_shard=rows_per_shard)
    return str(out)


def _edit_meta(store: str, edit) -> None:
    path = Path(store) / META_FILE
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _cli_error(capsys, *args: str) -> str:
    assert main(["data", "info", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one line, no traceback
    return err


def test_truncated_shard_is_named_by_the_shallow_and_the_full_check(tmp_path, capsys):
    store = _resharded(make_store(tmp_path / "one"), tmp_path / "s", rows_per_shard=25)
    shards = shard_paths(store)
    assert len(shards) == 3
    # intact: the shallow check passes and counts what the shards hold
    meta = check_store(store)
    assert meta == read_meta(store) and meta["counts"] == dict(zip(("train", "val", "test"), N_PER_SPLIT))

    size = shards[1].stat().st_size
    with open(shards[1], "r+b") as f:
        f.truncate(size - 100)  # a copy cut short: the footer is gone
    for check in (check_store, verify_store):
        with pytest.raises(StoreError) as e:
            check(store)
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{shards[1]}: truncated or corrupt Parquet shard")
        assert "prepare the store again" in message
    err = _cli_error(capsys, store, "--verify")
    assert f"{shards[1]}: truncated or corrupt Parquet shard" in err

    # cut and padded back to its size with zeros (same length, no footer): still caught by the shallow check
    store = _resharded(make_store(tmp_path / "one"), tmp_path / "padded", rows_per_shard=25)
    shard = shard_paths(store)[2]
    data = shard.read_bytes()
    shard.write_bytes(data[:-300] + bytes(300))
    with pytest.raises(StoreError, match=rf"^{shard}: truncated or corrupt Parquet shard"):
        check_store(store)

    # the single-shard store of make_store itself, truncated
    single = make_store(tmp_path / "single")
    (shard,) = shard_paths(single)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(StoreError, match=rf"^{shard}: truncated or corrupt Parquet shard"):
        check_store(single)


def _counts_from_shards(store: str) -> tuple[Counter, Counter]:
    """Rows per split and per (split, label), read independently of raystudy."""
    splits, pairs = Counter(), Counter()
    for p in shard_paths(store):
        t = pq.read_table(p, columns=["split", "label"]).to_pylist()
        splits.update(r["split"] for r in t)
        pairs.update((r["split"], r["label"]) for r in t)
    return splits, pairs


def test_verify_compares_the_shards_row_counts_with_dataset_json(tmp_path, capsys):
    base = make_store(tmp_path / "base")
    splits, pairs = _counts_from_shards(base)
    assert verify_store(base)["counts"] == dict(splits) == dict(zip(("train", "val", "test"), N_PER_SPLIT))
    assert main(["data", "info", base, "--verify"]) == 0
    assert "checksum verified; 1 shard(s) readable and unchanged" in capsys.readouterr().out

    # dataset.json claims one more training row (total kept consistent): hashes and checksum still match
    store = make_store(tmp_path / "a")
    _edit_meta(store, lambda m: (m["counts"].update(train=41), m.update(num_rows=71)))
    expected = (f"{store}: split 'train' has {splits['train']} rows in the shards, dataset.json counts 41; "
                "the store was modified or corrupted; prepare it again")
    for check in (check_store, verify_store):
        with pytest.raises(StoreError) as e:
            check(store)
        assert str(e.value) == expected
    assert expected in _cli_error(capsys, store, "--verify")

    # the total alone
    store = make_store(tmp_path / "b")
    _edit_meta(store, lambda m: m.update(num_rows=69))
    with pytest.raises(StoreError, match=r"the shards hold 70 rows, dataset.json 'num_rows' says 69"):
        verify_store(store)

    # one class of one split
    store = make_store(tmp_path / "c")
    _edit_meta(store, lambda m: m["label_counts"]["val"].__setitem__(3, 7))
    with pytest.raises(StoreError, match=rf"split 'val' class 3 has {pairs[('val', 3)]} rows in the shards, "
                                         r"dataset.json 'label_counts' says 7"):
        verify_store(store)

    # one shard's row count: the shard is named
    store = make_store(tmp_path / "d")
    (shard,) = shard_paths(store)
    _edit_meta(store, lambda m: m["shards"][0].update(rows=71))
    with pytest.raises(StoreError, match=rf"^{shard}: 70 rows, dataset.json lists 71 for this shard"):
        check_store(store)


def test_verify_catches_a_consistently_rewritten_shard_by_its_counts(tmp_path):
    """A shard rewritten with one training row moved to val, its hash and the content checksum updated in
    dataset.json (a half-finished re-prepare): only the counts reveal it."""
    store = make_store(tmp_path / "s")
    (shard,) = shard_paths(store)
    rows = pq.read_table(shard).to_pylist()
    moved = next(r for r in rows if r["split"] == "train")
    moved["split"] = "val"
    pq.write_table(pq.read_table(shard).from_pylist(rows, schema=pq.read_table(shard).schema), shard)
    checksum, sha = compute_checksum(store), _file_sha256(shard)
    _edit_meta(store, lambda m: (m.update(checksum=checksum), m["shards"][0].update(sha256=sha)))
    with pytest.raises(StoreError, match=r"split 'train' has 39 rows in the shards, dataset.json counts 40"):
        verify_store(store)


def test_old_store_without_shard_list_still_has_its_counts_checked(tmp_path):
    """Stores written before ``shards``/``label_counts`` existed: the split counts are still compared."""
    store = make_store(tmp_path / "s")
    _edit_meta(store, lambda m: (m.pop("shards"), m.pop("label_counts"), m.pop("num_rows")))
    assert verify_store(store)["counts"] == dict(zip(("train", "val", "test"), N_PER_SPLIT))
    _edit_meta(store, lambda m: m["counts"].update(test=19))
    with pytest.raises(StoreError, match=r"split 'test' has 20 rows in the shards, dataset.json counts 19"):
        check_store(store)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m.update(counts="70"), r"'counts' must map each split to a row count >= 0"),
    (lambda m: m["counts"].update(train=-1), r"'counts' must map each split to a row count >= 0"),
    (lambda m: m.update(num_classes="10"), r"'num_classes' must be an integer >= 1"),
    (lambda m: m.update(shards=[{"file": "part-00000.parquet"}]), r"'shards' must be a list of"),
])
def test_malformed_counts_in_dataset_json_are_named(tmp_path, edit, message):
    store = make_store(tmp_path / "s")
    _edit_meta(store, edit)
    with pytest.raises(StoreError, match=rf"{Path(store) / META_FILE}: {message}"):
        read_meta(store)


def test_dataset_json_that_is_not_an_object_is_refused(tmp_path):
    store = make_store(tmp_path / "s")
    (Path(store) / META_FILE).write_text("[1, 2]")
    with pytest.raises(StoreError, match=r"dataset.json: expected a JSON object, got list"):
        read_meta(store)


def test_truncated_shard_stops_the_study_before_launch(tmp_path):
    """A study whose store has a truncated shard is refused by its file check, before any trial launches."""
    import os

    from raystudy.study.checks import SpecError
    from raystudy.study.spec import StudySpec

    store = make_store(tmp_path / "tiny")
    shard = next((tmp_path / "tiny").glob("part-*.parquet"))
    os.truncate(shard, shard.stat().st_size - 50)
    spec = StudySpec(name="t", out=str(tmp_path / "out"), datasets={"tiny": store}, weights=None)
    with pytest.raises(SpecError, match=r"datasets.tiny: store not usable: .*part-\d+\.parquet: truncated or corrupt"):
        spec.check_files(weights=False)
    assert not (tmp_path / "out").exists()

