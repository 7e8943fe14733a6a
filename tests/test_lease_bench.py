"""benchmarks/compare_beanstalkd.py, run small so that it cannot rot: its pinpriq half (the
beanstalkd half needs beanstalkd, which CI does not install), checking that it runs every mode
and prints its table and ratios. It asserts nothing about speed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compare_beanstalkd.py"
SMALL = ["--rounds", "1", "-n", "2000", "--n1", "200"]


def test_the_lease_benchmark_runs_and_prints_its_figures() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL, "--without-beanstalkd"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for mode in ("pinpriq pop", "pinpriq reserve+ack"):
        for pipeline in (64, 1):
            assert any(line.startswith(f"| {mode} | {pipeline} | ") for line in lines), mode
    assert any(line.startswith("-P 64: reserve+ack / pop = ") for line in lines)
    assert not any("beanstalkd" in line for line in lines)
