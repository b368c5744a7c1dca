#!/usr/bin/env python
"""The full study: finetuning grid (Ray Tune over Ray Train), plasticity, bounds and analysis.

    python experiments/full_study.py                       # the demo: built-in data, local Ray, minutes
    python experiments/full_study.py --preset paper --address auto --set data_root=/mnt/shared/data
    python experiments/full_study.py --resume results/paper   # continue an interrupted study

Every flag of ``raystudy study`` works here (``--help``). Re-running a finished study launches nothing.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a fresh clone

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

from raystudy.commands.study import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
