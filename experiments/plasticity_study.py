#!/usr/bin/env python
"""The paper's plasticity experiments: a plasticity-only study (no finetuning grid) through the study code.

    python experiments/plasticity_study.py              # = raystudy study --preset plasticity-demo
    python experiments/plasticity_study.py --preset paper --address auto --set data_root=/mnt/shared/data
    python experiments/plasticity_study.py --preset paper --model vit_large_patch16_224.orig_in21k \\
        --set plasticity.batch_size=32 --weights weights/vit_large_patch16_224.orig_in21k.safetensors \\
        --out results/plasticity-paper-l16

The presets are the study presets ``plasticity-demo`` and ``plasticity-paper`` (``raystudy/presets/``;
``--preset demo`` here means ``plasticity-demo``), study specs with ``configurations: []``: the bounds
and the plasticity of every dataset land in ``<out>/plasticity.parquet``, ``rates.parquet`` and
``bounds.parquet``, then the analysis. Every flag of ``raystudy study`` works here (``--help``);
re-running a finished study measures nothing again.
"""

import sys

from _environment import study_main  # this folder: checks the Python before raystudy is imported

if __name__ == "__main__":
    sys.exit(study_main("plasticity_study.py")(prog="plasticity_study.py", preset_prefix="plasticity-"))
