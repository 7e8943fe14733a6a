"""What an install of pinpriq holds, built as the Docker image builds it: the wire fixtures ride
along as package data, and the installed ``pinpriq-conformance`` finds them from any directory.

The wheel is built from a copy of exactly what the Dockerfile copies, offline (no index, no
build isolation: the test extras bring setuptools), and installed with ``pip install --target``,
which unpacks it and writes its scripts as into a venv, without the seconds a venv costs. The
checkout itself (this editable install) reads wire-fixtures/ in place: test_conformance.py
runs every fixture that way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from functools import partial
from pathlib import Path

import pytest
import trio

from pinpriq.admin import serve_admin
from pinpriq.conformance import DEFAULT_FIXTURES
from tests.conftest import LiveServer

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "wire-fixtures"
PIP_SECONDS = 240  # a build that compiles (tests/test_build.py) takes a minute or more


def dockerfile_sources() -> list[str]:
    """The paths the Dockerfile copies into the image, before its ``pip install .``."""
    sources = []
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not words[1].startswith("--from="):  # not between stages
            sources += words[1:-1]
    return sources


def pip(*args: str | Path, env: dict[str, str] | None = None) -> None:
    """Run pip; ``env`` is added to the environment it (and a setup.py it runs) sees."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=PIP_SECONDS,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, f"pip {args[0]} failed:\n{done.stderr[-4000:]}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("image")
    for name in dockerfile_sources():
        if (REPO / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.so")  # an editable build's
            shutil.copytree(REPO / name, source / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    # Plain Python: what the wheel holds besides the compiled modules is the same either way, and
    # compiling takes a minute; tests/test_build.py covers the builds themselves (issue 14).
    wheel = ["wheel", "--no-deps", "--no-index", "--no-build-isolation", "-w", out, source]
    pip(*wheel, env={"PINPRIQ_PURE_PYTHON": "1"})
    [built] = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed into a directory of its own; put it first on PYTHONPATH to use it."""
    target = tmp_path_factory.mktemp("installed") / "site"
    pip("install", "--no-deps", "--no-index", "--target", target, wheel)
    return target


def test_the_checkout_reads_wire_fixtures_in_place() -> None:
    assert DEFAULT_FIXTURES == FIXTURES
    # The one copy: pinpriq/fixtures exists in installs only, made from wire-fixtures/.
    assert not (REPO / "pinpriq" / "fixtures").exists()


def test_the_wheel_ships_the_fixtures_and_their_readme(wheel: Path) -> None:
    expected = {path.name for path in FIXTURES.glob("*.txt")} | {"README.md"}
    with zipfile.ZipFile(wheel) as archive:
        shipped = {
            name.removeprefix("pinpriq/fixtures/"): archive.read(name)
            for name in archive.namelist()
            if name.startswith("pinpriq/fixtures/")
        }
    assert set(shipped) == expected
    assert all(shipped[name] == (FIXTURES / name).read_bytes() for name in expected)


def test_the_wheel_ships_every_module(wheel: Path) -> None:
    # pyproject lists pinpriq's subpackages by hand (the fixtures' mapping needs it): a new
    # subpackage missing from that list would be missing from every install.
    modules = {path.relative_to(REPO).as_posix() for path in (REPO / "pinpriq").rglob("*.py")}
    with zipfile.ZipFile(wheel) as archive:
        assert modules <= set(archive.namelist())


def test_the_wheel_ships_the_dashboard(wheel: Path) -> None:
    # Package data, not a module: the admin listener serves it, and cannot start without it.
    page = REPO / "pinpriq" / "admin" / "dashboard.html"
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("pinpriq/admin/dashboard.html") == page.read_bytes()


async def run_installed(installed: Path, cwd: Path, *argv: str | Path) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    with trio.fail_after(60):
        done = await trio.run_process(
            list(map(str, argv)),
            cwd=cwd,
            env=env,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_an_installed_conformance_runner_finds_its_fixtures_from_any_directory(
    installed: Path, tmp_path: Path, live: LiveServer
) -> None:
    code = "import pinpriq.conformance as c; print(c.__file__); print(c.DEFAULT_FIXTURES)"
    status, out, err = await run_installed(installed, tmp_path, sys.executable, "-c", code)
    assert status == 0, err
    module, default = map(Path, out.splitlines())
    assert module.is_relative_to(installed)  # the installed copy, not this checkout
    assert default == installed / "pinpriq" / "fixtures"

    script = installed / "bin" / "pinpriq-conformance"
    status, out, err = await run_installed(installed, tmp_path, script, "--help")
    assert status == 0, err
    assert "pinpriq/fixtures" in "".join(out.split())  # the default shown, however wrapped

    status, out, err = await run_installed(installed, tmp_path, script, f"127.0.0.1:{live.port}")
    assert status == 0, out + err
    paths = list(FIXTURES.glob("*.txt"))
    count = len(paths)
    # Those that need a server with a token are reported, not run, against this one.
    tokened = sum("\nrequires token\n" in path.read_text() for path in paths)
    assert tokened > 0
    assert out.splitlines()[-1].startswith(
        f"{count} fixtures: {count - tokened} passed, 0 failed, {tokened} not run"
    )


# -- the Dockerfile and the declared dependencies ---------------------------------------------


def dockerfile_instruction(name: str) -> list[str]:
    """The exec-form arguments (a JSON array) of the Dockerfile's one ``name`` instruction."""
    [line] = [
        line for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith(name)
    ]
    return list(json.loads(line[len(name) :]))


def test_the_dockerfile_passes_hadolint() -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "hadolint"), "--no-color", "Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr  # DL3066 among others: numeric USER


def test_options_given_to_docker_run_keep_the_host() -> None:
    """``docker run pinpriq --max-memory 2GiB`` replaces CMD, so the host lives in ENTRYPOINT,
    and so does the data directory."""
    entrypoint = dockerfile_instruction("ENTRYPOINT")
    assert entrypoint[:3] == ["pinpriq-server", "--host", "0.0.0.0"]
    assert "--host" not in dockerfile_instruction("CMD")
    assert "--data-dir" not in dockerfile_instruction("CMD")


def test_the_log_lives_in_the_declared_volume() -> None:
    entrypoint = dockerfile_instruction("ENTRYPOINT")
    data_dir = entrypoint[entrypoint.index("--data-dir") + 1]
    assert dockerfile_instruction("VOLUME") == [data_dir]
    text = (REPO / "Dockerfile").read_text()
    assert f"chown 10001 {data_dir}" in text  # the unprivileged user can write its log there


async def test_the_health_check_asks_the_admin_listener_and_fails_without_one(
    live: LiveServer, nursery: trio.Nursery
) -> None:
    text = (REPO / "Dockerfile").read_text()
    start = text.index("HEALTHCHECK")
    command = json.loads(text[text.index("CMD", start) + 3 : text.index("]", start) + 1])
    assert (command[0], command[-1]) == ("pinpriq", "health")
    argv = [str(Path(sys.executable).parent / command[0]), *command[1:]]
    (listener,) = await nursery.start(partial(serve_admin, live.server, 0))
    admin = {"PINPRIQ_ADMIN_URL": f"http://127.0.0.1:{listener.socket.getsockname()[1]}"}
    answered = await trio.run_process(argv, env=os.environ | admin, capture_stdout=True)
    assert answered.stdout.startswith(b"ok: http://127.0.0.1:")
    with trio.socket.socket() as placeholder:  # bound, never listening
        await placeholder.bind(("127.0.0.1", 0))
        admin = {"PINPRIQ_ADMIN_URL": f"http://127.0.0.1:{placeholder.getsockname()[1]}"}
        refused = await trio.run_process(
            argv, env=os.environ | admin, check=False, capture_stderr=True
        )
    assert refused.returncode == 1


def test_every_dependency_has_an_upper_bound() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["test"]
    unbounded = [spec for spec in declared if "<" not in spec and "==" not in spec]
    assert not unbounded, f"no upper bound: {unbounded}"
