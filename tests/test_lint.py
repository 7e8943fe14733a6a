"""The code stays ruff-clean, ruff-formatted and mypy-strict (the settings in pyproject.toml),
checked in the suite so that CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "pinpriq", "tests", "benchmarks"],
        ["ruff", "format", "--check", "pinpriq", "tests", "benchmarks"],
        ["mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_the_code_passes(command: list[str]) -> None:
    done = subprocess.run(
        [str(BIN / command[0]), *command[1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
