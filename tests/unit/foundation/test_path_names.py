"""Names that become path components (stores, datasets) are one component: nothing writes outside its folder."""

from __future__ import annotations

import pytest

from raystudy.storage import check_path_name


@pytest.mark.parametrize("bad", ["", ".", "..", "../x", "a/b", "a\\b", ".hidden", "nul\x00byte", "new\nline",
                                 "tab\tname", "x" * 129, None, 3])
def test_check_path_name_refuses_what_is_not_one_component(bad):
    with pytest.raises(ValueError) as e:
        check_path_name(bad, "dataset.json 'name'")
    assert str(e.value).startswith(f"dataset.json 'name': {bad!r} is not a valid name")


@pytest.mark.parametrize("good", ["cifar10", "CIFAR-10-C_snow.v2", "my dataset", "x" * 128, "é"])
def test_check_path_name_keeps_ordinary_names(good):
    assert check_path_name(good, "--dataset") == good

