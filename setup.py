"""Build pinpriq with its hot modules compiled by mypyc and the packed store's C core
(``pinpriq/_packed.c``, issue 20), or as plain Python when that fails.

Everything else about the package is in pyproject.toml; this file only adds the extensions
(issue 14). The compiled build needs mypyc (part of mypy, a build requirement), a C compiler
and Python's headers. Without any of them, or with PINPRIQ_PURE_PYTHON=1 set, the install
goes on with the plain-Python modules, which are always shipped as well: pinpriq/_build.py
says which build runs, and the same variable at run time forces the plain modules.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
# The same list as pinpriq/_build.py's COMPILED, as files (setup.py cannot import the package).
COMPILED = [
    "pinpriq/wire.py",
    "pinpriq/store.py",
    "pinpriq/subscriptions.py",
    "pinpriq/broker.py",
    "pinpriq/persistence/records.py",
    "pinpriq/persistence/store.py",
    "pinpriq/persistence/journal.py",
    "pinpriq/persistence/segments.py",
    "pinpriq/persistence/compaction.py",
]
PURE_VARIABLE = "PINPRIQ_PURE_PYTHON"


def _say(message: str) -> None:
    print(f"pinpriq build: {message}", file=sys.stderr)


def _pure_requested() -> bool:
    return os.environ.get(PURE_VARIABLE, "") not in ("", "0")


def _remove_stale(modules: list[str]) -> None:
    """Removes the shared libraries an earlier in-place build (an editable install) left for
    ``modules``: a build that installs their ``.py`` must not leave an older compiled copy
    beside it, which Python would import first and so run code the ``.py`` no longer says."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for module in modules:
        stale = HERE / f"{module.replace('.', '/')}{suffix}"
        if stale.exists():
            _say(f"removing {stale.relative_to(HERE)}, left by an earlier compiled build")
            stale.unlink()


def _mypyc_outputs() -> list[str]:
    """The modules a mypyc build writes in place: one per compiled file, and the shared
    library that holds them all (``group_name`` below)."""
    return [path.removesuffix(".py").replace("/", ".") for path in COMPILED] + ["pinpriq__mypyc"]


def packed_extension() -> list[Extension]:
    """The packed store's C core (pinpriq/_packed.c, issue 20): plain C on Python's C API, so
    it needs only the compiler and headers mypyc's modules need. Without it (or with
    PINPRIQ_PURE_PYTHON=1) the server uses store.QueueStore."""
    if _pure_requested():
        _remove_stale(["pinpriq._packed"])
        return []
    return [Extension("pinpriq._packed", ["pinpriq/_packed.c"], extra_compile_args=["-O2"])]


def codec_extension() -> list[Extension]:
    """The C decoder of push and pop frames (pinpriq/_codec.c, issue 20), which
    wire.FrameDecoder uses where it is built; without it (or with PINPRIQ_PURE_PYTHON=1) the
    decoder runs wire.py's own code for them."""
    if _pure_requested():
        _remove_stale(["pinpriq._codec"])
        return []
    return [Extension("pinpriq._codec", ["pinpriq/_codec.c"], extra_compile_args=["-O2"])]


def compiled_extensions() -> list[Extension]:
    """The mypyc extensions, or none when the build is to be plain Python."""
    extensions = _mypyc_extensions()
    if not extensions:
        _remove_stale(_mypyc_outputs())
    return extensions


def _mypyc_extensions() -> list[Extension]:
    if _pure_requested():
        _say(f"{PURE_VARIABLE} is set: installing the plain-Python modules")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as error:
        _say(f"mypyc is not importable ({error}): installing the plain-Python modules")
        return []
    # mypycify runs mypy on the modules, then writes C. Paths relative to this directory, as
    # setuptools runs setup.py from it; group_name names the one shared library they make.
    # pip builds in an environment of its own, without trio and the other dependencies: mypy
    # takes what it cannot find as Any (the compiled modules use none of it) and reports
    # nothing about the modules it follows imports into, which are not compiled (CI's mypy
    # run checks those).
    flags = ["--ignore-missing-imports", "--follow-imports=silent"]
    os.chdir(HERE)
    try:
        return list(mypycify([*flags, *COMPILED], opt_level="3", group_name="pinpriq"))
    except (Exception, SystemExit) as error:  # mypy found an error (it exits), or mypyc failed
        _say(f"mypyc could not translate the modules ({error!r}): installing plain Python")
        return []


class OptionalBuildExt(build_ext):
    """build_ext that falls back to the plain-Python package when compiling fails.

    A missing compiler, missing Python headers or a failing compile leave nothing half-built:
    whatever extensions were written are removed, since a compiled module whose shared library
    is missing would fail at import, whereas its ``.py`` works."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # compiler missing or failing: CCompilerError, OSError, ...
            _say(f"compiling failed ({type(error).__name__}: {error})")
            _say("installing the plain-Python modules instead")
            self._remove_outputs()
            self.extensions = []

    def _remove_outputs(self) -> None:
        for ext in self.extensions:  # in the build tree...
            Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
        # ...and the copies in the source tree, which an editable install imports (setuptools
        # builds in the build tree, then copies there); an up-to-date one was not even rebuilt.
        _remove_stale([ext.name for ext in self.extensions])


setup(
    ext_modules=[*compiled_extensions(), *packed_extension(), *codec_extension()],
    cmdclass={"build_ext": OptionalBuildExt},
)
