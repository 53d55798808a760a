"""The README's demo really trains: digits under shoalrun with 2 workers reaches at least 95% test accuracy."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, SHOALRUN, clean_env


def test_digits_example_with_two_workers() -> None:
    command = [*SHOALRUN, "-np", "2", sys.executable, str(REPO / "examples" / "digits.py"), "--epochs", "6"]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("[0]<stdout>:")
    summary = json.loads(last.split(":", 1)[1])
    assert summary["example"] == "digits" and summary["world"] == 2
    assert summary["test_accuracy"] >= 0.95, summary
