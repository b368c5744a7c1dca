"""``python -m raystudy``: the same command line as ``raystudy``."""

import sys

from raystudy.cli import main

if __name__ == "__main__":
    sys.exit(main())
