"""The README's examples, run as written against a live server, so they can never rot.

* Each ``python`` block of "Using pinpriq from Python" and "Jobs that must not be lost" runs in
  a fresh interpreter against a fresh server, with the README's port 7000 replaced by the test
  server's; when a ``text`` block follows it, that is exactly what it must print.
* Each ``console`` block of "From the shell" is a transcript: ``$ `` lines are commands, the
  lines after each are its stdout. The commands run with ``PINPRIQ_URL`` naming the test server.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import trio

from tests.conftest import LiveServer

README = Path(__file__).parent.parent / "README.md"
BIN = Path(sys.executable).parent
TIMEOUT = 30
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)


def section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def blocks(title: str) -> list[tuple[str, str, int]]:
    """(language, code, end offset) of each fenced block in a section."""
    return [(m[1], m[2], m.end()) for m in _FENCE.finditer(section(title))]


def python_examples() -> list[tuple[str, str | None]]:
    """Each Python example and the output shown after it, if any."""
    found = blocks("Using pinpriq from Python") + blocks("Jobs that must not be lost")
    examples = []
    for i, (language, code, _) in enumerate(found):
        if language == "python":
            following = found[i + 1] if i + 1 < len(found) else None
            expected = following[1] if following and following[0] == "text" else None
            examples.append((code, expected))
    return examples


def transcripts() -> list[list[tuple[str, str]]]:
    """Each console block as (command, expected stdout) pairs."""
    result = []
    for language, code, _ in blocks("From the shell"):
        if language != "console":
            continue
        steps: list[tuple[str, str]] = []
        for line in code.splitlines(keepends=True):
            if line.startswith("$ "):
                steps.append((line[2:].strip(), ""))
            else:
                command, output = steps[-1]
                steps[-1] = (command, output + line)
        result.append(steps)
    return result


def test_the_readme_has_the_examples() -> None:
    assert len(python_examples()) >= 3
    assert all(expected for _, expected in python_examples())
    assert transcripts()


async def run(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    with trio.fail_after(TIMEOUT):
        done = await trio.run_process(
            argv, capture_stdout=True, capture_stderr=True, check=False, env=env
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.mark.parametrize(
    ("code", "expected"),
    python_examples(),
    ids=[f"python-{i}" for i in range(1, len(python_examples()) + 1)],
)
async def test_python_example_runs(live: LiveServer, code: str, expected: str | None) -> None:
    assert '"127.0.0.1", 7000' in code, "examples must name the server the test replaces"
    code = code.replace('"127.0.0.1", 7000', f'"127.0.0.1", {live.port}')
    status, stdout, stderr = await run([sys.executable, "-c", code], dict(os.environ))
    assert (status, stderr) == (0, "")
    if expected is not None:
        assert stdout == expected


@pytest.mark.parametrize(
    "steps", transcripts(), ids=[f"console-{i}" for i in range(1, len(transcripts()) + 1)]
)
async def test_shell_transcript_runs(live: LiveServer, steps: list[tuple[str, str]]) -> None:
    env = dict(os.environ, PINPRIQ_URL=f"pinpriq://127.0.0.1:{live.port}")
    for command, expected in steps:
        argv = shlex.split(command)
        assert argv[0] == "pinpriq"
        status, stdout, stderr = await run([str(BIN / "pinpriq"), *argv[1:]], env)
        assert (status, stderr) == (0, ""), command
        # Tabs in the README may have become spaces in an editor; compare what a reader sees.
        assert stdout.expandtabs() == expected.expandtabs(), command


def test_the_quick_starts_data_directory_is_git_ignored() -> None:
    """The quick start runs the server in the checkout: its log must not show up as files to
    commit."""
    _, install_and_start, _ = blocks("Quick start")[0]
    started = re.search(r"--data-dir (\S+)", install_and_start)
    assert started is not None  # the quick start keeps a log
    ignored = (README.parent / ".gitignore").read_text(encoding="utf-8").splitlines()
    assert started[1].removeprefix("./").rstrip("/") + "/" in ignored
