"""The paper authors' repository as the tests cite it: one branch and one commit, defined once.

``tests/data/authors_protocol.yaml`` records the values of the authors' files (github.com/ambroiseodt/
vit-plasticity) with their ``file:line`` at the commit it names; every test that cites the authors' lines
(the fidelity ledger's, the transcriptions of their code) cites that commit, read from here, and
docs/fidelity.md names it (tests/unit/study/test_fidelity_ledger.py checks both).
"""

from __future__ import annotations

import yaml

from tests.support.processes import REPO

#: the authors' values, each with its source line (read by tests/unit/study/test_fidelity_ledger.py)
PROTOCOL: dict = yaml.safe_load((REPO / "tests" / "data" / "authors_protocol.yaml").read_text())
REPOSITORY: str = PROTOCOL["repository"]
BRANCH: str = PROTOCOL["branch"]
#: the commit (40 hex digits) at which every cited line of the authors' files reads as cited
COMMIT: str = PROTOCOL["commit"]
