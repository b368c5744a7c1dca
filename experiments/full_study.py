#!/usr/bin/env python
"""The full study: finetuning grid (Ray Tune over Ray Train), plasticity, bounds and analysis.

    python experiments/full_study.py                       # the demo: built-in data, local Ray, minutes
    python experiments/full_study.py --preset paper --address auto --set data_root=/mnt/shared/data
    python experiments/full_study.py --resume results/paper   # continue an interrupted study

Every flag of ``raystudy study`` works here (``--help``). Re-running a finished study launches nothing.
"""

import sys

from _environment import study_main  # this folder: checks the Python before raystudy is imported

if __name__ == "__main__":
    sys.exit(study_main("full_study.py")())
