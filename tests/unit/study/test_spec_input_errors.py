"""A spec the user wrote or a study directory holds, malformed: one line from the command line naming the file
or the flag and saying what is wrong (exit status 2), never Python's own error."""

from __future__ import annotations

import pytest

from raystudy.cli import main

LATIN1_SPEC = "configurations: [MHA]\nname: caf\u00e9\n".encode("latin-1")  # byte 0xe9 on line 2


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def test_a_spec_file_that_is_not_utf8_is_named(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_bytes(LATIN1_SPEC)
    said = f"{path}: not UTF-8 text (byte 0xe9 on line 2); save it as UTF-8"
    assert main(["study", "--preset", str(path), "--dry-run"]) == 2
    assert _one_error_line(capsys) == f"raystudy study: error: {said}"
    # the spec.yaml of a study directory: --resume and status read it too
    assert main(["study", "--resume", str(tmp_path), "--dry-run"]) == 2
    assert _one_error_line(capsys) == f"raystudy study: error: {said}"
    assert main(["status", str(tmp_path)]) == 2
    assert _one_error_line(capsys) == f"raystudy status: error: {said}"


@pytest.mark.parametrize("value, said", [
    ("!!python/object:os.system", "YAML tags such as !!python/object:os.system are refused; the value must be a "
                                  "mapping, e.g. model_kwargs={name: value}"),
    ("!!python/object/apply:os.system [echo]", "YAML tags such as !!python/object/apply:os.system are refused; the "
                                               "value must be a mapping, e.g. model_kwargs={name: value}"),
    ("[1, 2]", "the value must be a mapping, e.g. model_kwargs={name: value}, not '[1, 2]'"),
    ("depth", "the value must be a mapping, e.g. model_kwargs={name: value}, not 'depth'"),
])
def test_set_model_kwargs_must_be_a_mapping(tmp_path, capsys, value, said):
    assert main(["study", "--preset", "demo", "--out", str(tmp_path / "s"), "--set", f"model_kwargs={value}",
                 "--print-spec"]) == 2
    assert _one_error_line(capsys) == f"raystudy study: error: --set model_kwargs: {said}"
    assert not (tmp_path / "s").exists()


def test_set_values_with_tags_are_refused_and_mappings_still_read(tmp_path, capsys):
    import yaml

    assert main(["study", "--preset", "demo", "--set", "steps=!!python/int 3", "--print-spec"]) == 2
    assert _one_error_line(capsys) == ("raystudy study: error: --set steps: YAML tags such as !!python/int are "
                                       "refused; give a plain value")
    assert main(["study", "--preset", "demo", "--out", str(tmp_path / "s"), "--set", "model_kwargs={depth: 2}",
                 "--set", "data_root=/data/it!s", "--print-spec"]) == 0
    spec = yaml.safe_load(capsys.readouterr().out)
    assert spec["model_kwargs"] == {"depth": 2} and spec["data_root"] == "/data/it!s"  # a '!' in a plain value


def test_a_spec_file_whose_model_kwargs_is_no_mapping_is_named(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text("configurations: [MHA]\nmodel_kwargs: depth\n")
    assert main(["study", "--preset", str(path), "--print-spec"]) == 2
    assert _one_error_line(capsys) == ("raystudy study: error: model_kwargs: expected a mapping of timm.create_model "
                                       "arguments, e.g. {depth: 3}, not 'depth'")
