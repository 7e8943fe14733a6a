"""The two builds of issue 14: the hot modules compiled by mypyc, and plain Python.

An install compiles when it can and falls back to plain Python when it cannot (no compiler, no
headers, a failing compile), never failing for it; ``PINPRIQ_PURE_PYTHON=1`` asks for the plain
modules at build time and at run time; ``pinpriq-server --version`` says which build runs.
Wheels are built as tests/test_packaging.py builds them: offline, without build isolation.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from pinpriq._build import COMPILED, PURE_VARIABLE, build_name
from tests.test_packaging import REPO, dockerfile_sources, pip

SERVER = Path(sys.executable).parent / "pinpriq-server"


def run(
    argv: list[str | Path],
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    timeout: float = 60,
) -> str:
    done = subprocess.run(
        list(map(str, argv)),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=True,
    )
    return done.stdout


def copy_sources(out: Path) -> Path:
    """The sources the Dockerfile copies, without build outputs, in ``out/source``."""
    source = out / "source"
    source.mkdir()
    for name in dockerfile_sources():
        if (REPO / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.so")
            shutil.copytree(REPO / name, source / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, source / name)
    return source


def build_wheel(out: Path, env: dict[str, str]) -> Path:
    """A wheel of the sources the Dockerfile copies, built with ``env`` added to the
    environment setup.py sees."""
    source = copy_sources(out)
    wheel = ["wheel", "--no-deps", "--no-index", "--no-build-isolation", "-w", out, source]
    pip(*wheel, env=env)
    [built] = out.glob("*.whl")
    return built


def extensions(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return [name for name in archive.namelist() if name.endswith(".so")]


def installed_build(wheel: Path, target: Path) -> str:
    """What ``build_name()`` says in an install of ``wheel`` alone."""
    pip("install", "--no-deps", "--no-index", "--target", target, wheel)
    code = "from pinpriq._build import build_name; print(build_name())"
    env = {"PYTHONPATH": str(target), PURE_VARIABLE: ""}
    # From the install's own directory: python -c puts the working directory first on the path.
    return run([sys.executable, "-c", code], env=env, cwd=target).strip()


# mypyc checks and translates the modules before the compiler is first called: about a minute.
@pytest.mark.timeout(300)
def test_a_build_whose_compiler_fails_installs_plain_python(tmp_path: Path) -> None:
    # CC=false: a compiler that fails every compile, as a missing one or missing headers would.
    wheel = build_wheel(tmp_path, {"CC": "false", PURE_VARIABLE: ""})
    assert extensions(wheel) == []
    with zipfile.ZipFile(wheel) as archive:
        assert {f"{name.replace('.', '/')}.py" for name in COMPILED} <= set(archive.namelist())
    assert installed_build(wheel, tmp_path / "site") == "pure Python (not compiled when installed)"


def test_the_variable_at_build_time_compiles_nothing(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path, {PURE_VARIABLE: "1"})
    assert extensions(wheel) == []  # neither the mypyc modules nor the packed store


def stale_libraries(source: Path) -> list[Path]:
    """Shared libraries as an earlier in-place (editable) compiled build leaves them."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    names = [*COMPILED, "pinpriq._packed", "pinpriq._codec", "pinpriq__mypyc"]
    stale = [source / f"{name.replace('.', '/')}{suffix}" for name in names]
    for path in stale:
        path.write_bytes(b"an older build")
    return stale


# mypy checks the modules before it fails: about a minute.
@pytest.mark.timeout(300)
def test_a_plain_build_in_place_removes_an_older_compiled_build(tmp_path: Path) -> None:
    # The trap of an editable install: a later build that falls back to plain Python (here:
    # mypy finds an error) left the older .so files, which shadowed the edited .py files.
    source = copy_sources(tmp_path)
    wire = source / "pinpriq" / "wire.py"
    wire.write_text(wire.read_text() + '\n_BROKEN: int = "not an int"\n')
    stale = stale_libraries(source)
    build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    run(build, env={PURE_VARIABLE: ""}, cwd=source, timeout=280)
    left = {path.name: path.read_bytes() for path in stale if path.exists()}
    # mypyc's outputs are gone; the two C cores, which need no mypy, were rebuilt.
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert sorted(left) == [f"_codec{suffix}", f"_packed{suffix}"]
    assert b"an older build" not in left.values()


def test_the_variable_at_build_time_removes_an_older_compiled_build(tmp_path: Path) -> None:
    source = copy_sources(tmp_path)
    stale = stale_libraries(source)
    build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    run(build, env={PURE_VARIABLE: "1"}, cwd=source)
    assert [path.name for path in stale if path.exists()] == []


def test_the_variable_at_run_time_loads_the_plain_modules() -> None:
    code = (
        "import pinpriq.store, pinpriq.wire, pinpriq._build as b;"
        "print(pinpriq.store.__file__, pinpriq.wire.__file__, b.build_name())"
    )
    store, wire, *build = run([sys.executable, "-c", code], env={PURE_VARIABLE: "1"}).split()
    assert store.endswith("store.py")
    assert wire.endswith("wire.py")
    assert " ".join(build) == f"pure Python ({PURE_VARIABLE} is set)"


def test_version_says_which_build_runs() -> None:
    assert run([SERVER, "--version"]).strip().endswith(build_name())
    plain = run([SERVER, "--version"], env={PURE_VARIABLE: "1"})
    assert plain.strip().endswith(f"pure Python ({PURE_VARIABLE} is set)")


@pytest.mark.skipif(
    os.environ.get("PINPRIQ_EXPECT_COMPILED") != "1",
    reason="PINPRIQ_EXPECT_COMPILED=1 (set by .ci/run) says this install must be compiled",
)
def test_this_install_is_compiled() -> None:
    # CI runs the suite on the compiled build: a silent fallback would test the wrong thing.
    assert os.environ.get(PURE_VARIABLE, "") in ("", "0")
    assert build_name() == "compiled (mypyc, packed store)"
