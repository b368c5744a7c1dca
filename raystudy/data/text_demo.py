"""Built-in tiny text stores for the text demo: two small corpora of synthetic sentences with different
vocabularies (no download).

``text-news`` (the pretraining-like side: markets, politics, sport, science news) and ``text-nature``
(the downstream side: rivers, forests, birds, weather), each ``count`` sentences of 14 to 24 words drawn
from a seeded generator, labelled by topic (4 classes each; a quarter of the words from the topic, the rest
from a pool shared by every class, so that topic words overlap), split 60/20/20 into train/val/test by
position. Deterministic: the same ``seed`` writes the same rows (and the same store checksums).

    python -m raystudy.data.text_demo ROOT      # writes ROOT/text-news and ROOT/text-nature
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from .store import write_store

#: store name -> topic (class name) -> its words; the two stores share only the function words
CORPORA: dict[str, dict[str, list[str]]] = {
    "text-news": {
        "markets": "market shares investors bank stocks profit quarter earnings trade prices rates bonds".split(),
        "politics": "government minister election parliament vote policy senator campaign law treaty".split(),
        "sport": "team match season coach league score goal players championship final victory".split(),
        "science": "researchers study software computer network data launch satellite device chip".split(),
    },
    "text-nature": {
        "rivers": "river stream water valley delta bank current flood stones banks estuary".split(),
        "forests": "forest trees oak pine moss leaves canopy roots fern clearing woodland".split(),
        "birds": "birds heron owl sparrow nest wings feathers song flock migration eggs".split(),
        "weather": "rain clouds wind storm snow fog thunder sunlight frost breeze drizzle".split(),
    },
}
_GLUE = "the a of in and on with near after over under through".split()
SPLIT_SHARES = (("train", 0.6), ("val", 0.2), ("test", 0.2))
#: Share of a sentence's words drawn from its own topic (the rest from the shared pool): low enough that a
#: short finetuning does not reach 100% on text-nature and the configurations' accuracies differ.
TOPIC_SHARE = 0.25


def sentences(corpus: str, count: int, seed: int = 0, topic_share: float = TOPIC_SHARE) -> list[tuple[str, int]]:
    """``count`` ``(sentence, label)`` of ``corpus``: label ``i % 4``, 14 to 24 words, each from its topic with
    probability ``topic_share``, else from the shared pool (function words and every topic's words, its own
    included), so that topic words overlap across classes."""
    topics = list(CORPORA[corpus].values())
    shared = _GLUE + [w for words in topics for w in words]
    rng = np.random.default_rng([seed, sorted(CORPORA).index(corpus)])
    out = []
    for i in range(count):
        label = i % len(topics)
        words = [str(rng.choice(topics[label] if rng.random() < topic_share else shared))
                 for _ in range(int(rng.integers(14, 25)))]
        out.append((" ".join(words).capitalize() + ".", label))
    return out


def _split(i: int, count: int) -> str:
    edge = 0.0
    for name, share in SPLIT_SHARES:
        edge += share
        if i < round(edge * count):
            return name
    return SPLIT_SHARES[-1][0]


def prepare_text_demo(root: str | os.PathLike, count: int = 300, seed: int = 0,
                      topic_share: float = TOPIC_SHARE) -> dict[str, str]:
    """Write both stores under ``root`` (``root/<name>``); returns ``{name: store path}``."""
    out = {}
    for name, topics in CORPORA.items():
        rows = [{"text": text, "label": label, "split": _split(i, count), "index": i}
                for i, (text, label) in enumerate(sentences(name, count, seed, topic_share))]
        path = Path(root) / name
        write_store(rows, path, name=name, source="raystudy.data.text_demo", classes=list(topics), kind="text",
                    allow_empty=False)
        out[name] = str(path)
    return out


if __name__ == "__main__":  # pragma: no cover - a one-line entry point
    for store_name, store_path in prepare_text_demo(sys.argv[1] if len(sys.argv) > 1 else "data/text-demo").items():
        print(f"{store_name}: {store_path}")
