"""The README's Python example runs as written, and its two commands are the ones CI and learners use."""

from __future__ import annotations

import re

from helpers import ROOT

README = (ROOT / "README.md").read_text()


def test_python_example_runs(capsys):
    (example,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    exec(compile(example, "README.md", "exec"), {})
    assert "T total" in capsys.readouterr().out


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in README and "test-command" in ci
    (command,) = re.findall(r"<!-- test-command -->\n```bash\n(.*?)\n```", README, flags=re.S)
    assert command.count("\n") == 0 and "pip install torch==2.13.0 &&" in command and "pytest" in command
