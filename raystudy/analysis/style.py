"""The look of every figure, defined once: the palette, the markers and the font scale.

Colours are the Okabe-Ito palette (colour-blind safe) plus a dark grey, one per configuration of the
vocabulary, each with its own marker, so that no two configurations share a colour or a marker (LN1 blue
``v``, LN2 bluish green ``^``; ``Head`` dark grey ``X``, ``LP`` yellow ``h``): a figure reads in colour, for a
colour-blind reader and in grey-scale print. Configurations outside the vocabulary (expressions) get
:func:`configuration_styles`' extra colours and markers. Datasets, where a scatter plot shows several, are
told apart by :func:`dataset_markers`.

Every text of a figure takes its size from :data:`FONT` (the figure functions run under :func:`styled`,
which sets matplotlib's sizes to it): one font scale across the report.
"""

from __future__ import annotations

import functools
import hashlib

import matplotlib

from raystudy.vocab import TRIALS_CONFIGURATIONS

#: The Okabe-Ito palette (Okabe & Ito 2008), distinguishable under the common colour-vision deficiencies.
OKABE_ITO: dict[str, str] = {
    "black": "#000000", "orange": "#E69F00", "sky blue": "#56B4E9", "bluish green": "#009E73",
    "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "reddish purple": "#CC79A7",
}

#: One colour per configuration, shared by every figure: eight Okabe-Ito colours and a grey, all distinct.
CONFIGURATION_COLORS: dict[str, str] = {
    "LN1": OKABE_ITO["blue"],
    "MHA": OKABE_ITO["vermillion"],
    "LN2": OKABE_ITO["bluish green"],
    "FC1": OKABE_ITO["orange"],
    "FC2": OKABE_ITO["reddish purple"],
    "All": OKABE_ITO["black"],
    "Emb": OKABE_ITO["sky blue"],
    "Head": "#555555",  # dark grey, a baseline (a mid grey would come within reach of bluish green or purple)
    "LP": OKABE_ITO["yellow"],  # the linear probe, the other baseline: not a second grey
}
assert set(CONFIGURATION_COLORS) == set(TRIALS_CONFIGURATIONS)
assert len(set(CONFIGURATION_COLORS.values())) == len(CONFIGURATION_COLORS)

#: One marker per configuration, all distinct (the configuration reads without colour too).
MARKERS: dict[str, str] = {
    "LN1": "v", "MHA": "o", "LN2": "^", "FC1": "s", "FC2": "D", "Emb": "P", "All": "*", "Head": "X", "LP": "h",
}
assert set(MARKERS) == set(CONFIGURATION_COLORS) and len(set(MARKERS.values())) == len(MARKERS)

#: Colours of the configurations outside the vocabulary (expressions: ``MHA+FC1``, ``auto:10%``, ``lora:r=8``,
#: ...), see :func:`configuration_styles`. Chosen once, greedily: each the sRGB colour (of a 21-step grid, CIELAB
#: lightness 32-70 and chroma 30-80: visible on white, not neon) farthest from the vocabulary's nine colours and
#: the ones chosen before it; every one is at least 29 CIE76 delta E from every other colour here and from
#: :data:`CONFIGURATION_COLORS` (the closest pair of the whole palette is the Okabe-Ito blue and sky blue, 26.4),
#: where the colours of tab10 and tab20b they replace came as close as 4.6 to each other (#1F77B4, #3182BD: two
#: blues) and 2.9 to the vocabulary's (#1F77B4 and LN1's #0072B2).
EXTRA_COLORS: tuple[str, ...] = (
    "#6633B3", "#F22659", "#4DA600", "#66660D", "#D99973", "#FF73F2", "#8C3333", "#B399FF", "#990073", "#664080",
    "#00660D", "#99B373", "#FF4DA6", "#0073F2", "#A6000D", "#0D5940", "#734000", "#FF8080", "#008C99", "#99A626",
)
EXTRA_MARKERS: tuple[str, ...] = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">", "p")

#: Markers of the datasets of a scatter plot, in sorted dataset order (cycled past the tenth).
DATASET_MARKERS: tuple[str, ...] = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")

#: The one font scale (points): figure title, panel title, axis labels and body text, tick and legend text,
#: annotations.
FONT: dict[str, float] = {"title": 12.0, "panel": 10.0, "label": 9.0, "tick": 8.0, "small": 7.0}

#: matplotlib's text sizes set to :data:`FONT` while a figure is drawn (:func:`styled`).
RC: dict[str, float] = {
    "font.size": FONT["label"], "figure.titlesize": FONT["title"], "axes.titlesize": FONT["panel"],
    "axes.labelsize": FONT["label"], "xtick.labelsize": FONT["tick"], "ytick.labelsize": FONT["tick"],
    "legend.fontsize": FONT["tick"], "legend.title_fontsize": FONT["label"],
}


def styled(plot):
    """``plot`` run under :data:`RC` (every text it makes takes a size of :data:`FONT`)."""
    @functools.wraps(plot)
    def run(*args, **kwargs):
        with matplotlib.rc_context(RC):
            return plot(*args, **kwargs)
    return run


def configuration_styles(names) -> dict[str, tuple[str, str]]:
    """``{name: (colour, marker)}`` for the configurations ``names`` of one figure.

    The vocabulary's configurations keep :data:`CONFIGURATION_COLORS` and :data:`MARKERS`. Every other one
    (in sorted order) takes the colour of :data:`EXTRA_COLORS` its name hashes to, or the next one no other
    configuration of the figure has (distinct colours, every two at least 29 delta E apart, up to 20 of them),
    and a marker that makes its (colour, marker) pair unique (up to 240). The hash makes a configuration's
    style the same in every figure that shows it, unless two of them hashed alike and one figure shows only
    one of the two.
    """
    names = list(dict.fromkeys(map(str, names)))
    styles = {n: (CONFIGURATION_COLORS[n], MARKERS[n]) for n in names if n in CONFIGURATION_COLORS}
    n_colors, n_markers = len(EXTRA_COLORS), len(EXTRA_MARKERS)
    colors, pairs = set(), set()
    for name in sorted(set(names) - set(styles)):
        h = int(hashlib.sha256(name.encode()).hexdigest(), 16)
        c = next(((h + k) % n_colors for k in range(n_colors) if (h + k) % n_colors not in colors), h % n_colors)
        m0 = (h // n_colors) % n_markers
        m = next(((m0 + k) % n_markers for k in range(n_markers) if (c, (m0 + k) % n_markers) not in pairs), m0)
        colors.add(c)
        pairs.add((c, m))
        styles[name] = (EXTRA_COLORS[c], EXTRA_MARKERS[m])
    return styles


def dataset_markers(datasets) -> dict[str, str]:
    """``{dataset: marker}`` of :data:`DATASET_MARKERS`, in sorted dataset order."""
    names = sorted(set(map(str, datasets)))
    return {d: DATASET_MARKERS[i % len(DATASET_MARKERS)] for i, d in enumerate(names)}
