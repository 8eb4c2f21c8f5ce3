"""Every command's output is checked before its work: a path that cannot be written is refused at once, naming the
flag (the benchmarks made their output's directory after minutes of measuring, run-batch after the whole batch)."""

from __future__ import annotations

import pytest

from coserve.cli import main
from coserve.output_path import prepare_directory, prepare_output


def test_the_helpers_make_what_they_can_and_name_the_flag_for_what_they_cannot(tmp_path):
    assert prepare_output("--out", None) is None
    assert prepare_output("--out", tmp_path / "a" / "b.json") == tmp_path / "a" / "b.json" and (tmp_path / "a").is_dir()
    assert prepare_directory("--output", tmp_path / "c" / "d") == tmp_path / "c" / "d" and (tmp_path / "c" / "d").is_dir()
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"^--out: cannot make the directory of .*f/x\.json"):
        prepare_output("--out", tmp_path / "f" / "x.json")
    with pytest.raises(ValueError, match=r"^--output: cannot make .*f/d"):
        prepare_directory("--output", tmp_path / "f" / "d")


@pytest.mark.parametrize("command, flag", [
    (["bench-generation"], "--out"), (["bench"], "--out"), (["bench-server"], "--out"), (["bench-finetune"], "--out"),
    (["finetune", "--data", "unused.json"], "--output"),
])
def test_a_command_refuses_an_output_it_cannot_write_before_any_work(model_factory, tmp_path, capsys, command, flag):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main([*command, "--model", str(model_factory("llama")), flag, str(blocker / "x")]) == 2
    assert f"{flag}: cannot make" in capsys.readouterr().err
