"""The soak script (``python -m pinpriq.soak``) still runs: a few seconds of it, so it cannot rot.

The real soak is a minute or more and is run by hand; see README, "Soak test".
"""

from __future__ import annotations

import re
import subprocess
import sys

RSS_LINE = re.compile(r"^\s*\d+\.\d+s  ops .* rss \d+\.\d MiB$", re.MULTILINE)


def test_a_short_soak_runs_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pinpriq.soak", "--seconds", "3", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(RSS_LINE.findall(result.stdout)) >= 4, result.stdout  # one at start, then ~6
    assert "rss: start " in result.stdout
    assert "rss levelled off: " in result.stdout
    assert "server exited with status 0" in result.stdout
    assert result.stdout.rstrip().endswith("soak: ok"), result.stdout
