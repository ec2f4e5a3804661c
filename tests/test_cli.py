"""The `k3course` command line: doctor, bench dispatch, progress, and the Triton mode switch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from k3course.cli import main


def test_doctor_reports_versions_device_triton_mode_and_oracle(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for item in ("python", "torch", "triton", "numpy", "device", "cuda / GPUs", "triton mode", "oracle (fla)",
                 "unlocks"):
        assert item in out


def test_kernels_package_switches_to_the_interpreter_without_a_gpu_and_leaves_the_environment_alone():
    code = "import os, k3course.kernels as k; print(k.TRITON_MODE, os.environ.get('TRITON_INTERPRET'))"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    import torch

    expected = "native None" if torch.cuda.is_available() else "interpreter None"
    assert out.split() == expected.split()


def test_unknown_benchmark_lists_the_valid_ones(capsys):
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'; choose one of" in capsys.readouterr().err


def test_progress_on_a_missing_folder_names_it(tmp_path, capsys):
    assert main(["progress", str(tmp_path / "missing")]) == 2
    assert "no exercise notebooks" in capsys.readouterr().err


def test_training_commands_keep_freed_memory_and_the_others_do_not(monkeypatch, tmp_path, capsys):
    import k3course.device

    calls = []
    monkeypatch.setattr(k3course.device, "keep_freed_memory", lambda: calls.append(True) or True)
    assert main(["experiments", "no-such-experiment"]) == 2  # fails after the setting: a bad name
    assert main(["train", "--preset", "no-such-preset"]) == 2
    assert len(calls) == 2, "train and experiments must keep freed memory for their many steps"
    assert main(["progress", str(tmp_path / "missing")]) == 2 and main(["bench", "nope"]) == 2
    assert len(calls) == 2, "other commands leave the allocator alone"
    capsys.readouterr()


def test_unknown_command_is_an_argparse_error():
    with pytest.raises(SystemExit):
        main(["fly"])


def test_progress_tabulates_done_not_done_and_failing(tmp_path, capsys):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from k3course.grading import ExerciseNotDone"),
                nbformat.v4.new_code_cell('# check("99.a", f)\nraise ExerciseNotDone("99.a")'),
                nbformat.v4.new_code_cell('# check("99.b", f)\nprint("ok")'),
                nbformat.v4.new_code_cell('# check("99.c", f)\n1 / 0')]
    name = "99_a_toy_notebook_with_a_long_name.ipynb"  # longer than any real one: the table widens to fit it
    nbformat.write(nb, tmp_path / name)
    assert main(["progress", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [("notebook", "exercise", "status"), (name, "99.a", "not done"), (name, "99.b", "done"),
             (name, "99.c", "failing")]
    assert lines[:4] == [f"{a:<{len(name)}}  {b:<8}  {c}" for a, b, c in table]  # columns as wide as their content
    assert lines[4] == "1 of 3 exercises done"
    # Run All stops at the ExerciseNotDone in [2]: the failing check after it has no number in JupyterLab
    assert lines[7] == f"  {name} 99.c code cell 4 (Run All stops before it, at the error in [2]): " \
        "ZeroDivisionError: division by zero"
    assert lines[-1].startswith("the full report of one: pytest --nbval") and lines[-1].endswith(name)


@pytest.mark.parametrize("stream", [False, True])
def test_generate_prints_control_characters_escaped(monkeypatch, capsys, stream):
    import k3course.train.generate

    pieces = ["def f():\n\tred \x1b[31m", "bell \x07", "del \x7f c1 \x9b é"]  # what a model may write
    monkeypatch.setattr(k3course.train.generate, "generate_command", lambda *args: iter(pieces))
    assert main(["generate", "--checkpoint", "unused"] + ["--stream"] * stream) == 0
    assert capsys.readouterr().out == "def f():\n\tred \\x1b[31mbell \\x07del \\x7f c1 \\x9b é\n"
