"""What the code, tests and documents cite is in the repository: a reader of a clone can open it.

Checks every Markdown file named in pinpriq/, tests/, docs/ and benchmarks/ against those of
the repository, and that nothing there points into the team's shared folder beside it.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEARCHED = ("pinpriq", "tests", "docs", "benchmarks")
SKIPPED = {"__pycache__", "node_modules"}
CITED_DOCUMENT = re.compile(r"[\w./-]+\.md\b")
OUTSIDE = re.compile(r"\.\./shared\b|\bshared/")


def files(top: Path, pattern: str) -> list[Path]:
    """The files under ``top`` matching ``pattern``, outside hidden and generated folders."""
    return [
        path
        for path in top.rglob(pattern)
        if path.is_file()
        and not any(
            part.startswith(".") or part in SKIPPED for part in path.relative_to(REPO).parts
        )
    ]


def searched() -> list[Path]:
    return [
        path for top in SEARCHED for path in files(REPO / top, "*") if path.suffix in {".py", ".md"}
    ]


def test_every_document_cited_is_in_the_repository() -> None:
    ours = {path.name for path in files(REPO, "*.md")}
    missing = [
        f"{path.relative_to(REPO)}: {name}"
        for path in searched()
        for name in CITED_DOCUMENT.findall(path.read_text(encoding="utf-8"))
        if Path(name).name not in ours
    ]
    assert not missing


def test_nothing_points_outside_the_repository() -> None:
    outside = [
        f"{path.relative_to(REPO)}: {match}"
        for path in searched()
        for match in OUTSIDE.findall(path.read_text(encoding="utf-8"))
    ]
    assert not outside
