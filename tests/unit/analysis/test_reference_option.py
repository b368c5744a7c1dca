"""``raystudy analyze --reference``: a misspelt reference gets a "did you mean", whether the names alone tell
(``mha``, refused before the grammar loads torch) or the grammar does (``mhaa``)."""

from __future__ import annotations

import pytest

from raystudy.cli import main as cli
from tests.support.study_tables import make_study

EXPECTED = ("['LN1', 'MHA', 'LN2', 'FC1', 'FC2', 'Emb', 'All', 'Head', 'LP'] or a configuration expression "
            "(MHA+FC1, MHA@8-11, auto:5%, lora:r=8)")


@pytest.mark.parametrize("reference, closest", [("mha", "MHA"), ("Mha", "MHA"), ("lp", "LP"), ("fc2", "FC2")])
def test_a_reference_that_differs_by_case_gets_a_did_you_mean(tmp_path, capsys, reference, closest):
    study = make_study(tmp_path / "study", plasticity=False, bounds=False, curves=False)
    for command in ("analyze", "report"):
        assert cli([command, str(study), "--reference", reference, "--no-figures"]) == 2
        assert capsys.readouterr().err == (f"raystudy {command}: error: reference: unknown value {reference!r}; "
                                           f"did you mean {closest!r}? expected one of {EXPECTED}\n")
    assert not (study / "analysis").exists()


def test_the_grammar_names_the_closest_reference_too():
    from raystudy.analysis.stats import canonical_reference

    with pytest.raises(ValueError) as e:
        canonical_reference("mhaa")  # not a name up to case: the grammar refuses it, the message suggests
    assert str(e.value) == f"reference: unknown value 'mhaa'; did you mean 'MHA'? expected one of {EXPECTED}"
    assert canonical_reference("FC1+MHA") == "MHA+FC1"
