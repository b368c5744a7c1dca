"""A spec the user wrote or a study directory holds, malformed: one line from the command line naming the file
or the flag and saying what is wrong (exit status 2), never Python's own error."""

from __future__ import annotations

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
