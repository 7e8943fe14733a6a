"""Which build of pinpriq runs: the hot modules compiled by mypyc, or plain Python (issue 14).

``setup.py`` compiles the modules named in ``COMPILED`` when it can; each compiled module is an
extension (``store.cpython-311-x86_64-linux-gnu.so``) beside its ``.py``, and Python's import
system prefers the extension. Setting ``PINPRIQ_PURE_PYTHON=1`` makes ``pinpriq/__init__.py``
put a finder ahead of the import system's own that loads those modules from their ``.py``
source instead: the same code, interpreted, for debugging or comparing.

Imports nothing from pinpriq: ``pinpriq/__init__.py`` calls it before any other module loads.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = [
    "CODEC",
    "COMPILED",
    "PACKED",
    "PURE_VARIABLE",
    "build_name",
    "compiled_modules",
    "force_pure_python",
    "optional_extension",
    "packed_store_built",
]

#: The modules setup.py compiles: the codec, the store and what applies frames to it.
COMPILED = (
    "pinpriq.wire",
    "pinpriq.store",
    "pinpriq.subscriptions",
    "pinpriq.broker",
    "pinpriq.persistence.records",
    "pinpriq.persistence.store",
    "pinpriq.persistence.journal",
    "pinpriq.persistence.segments",
    "pinpriq.persistence.compaction",
)
#: The packed store's C core (``pinpriq/_packed.c``), built beside the mypyc modules; with
#: ``PURE_VARIABLE`` set it is not loaded (``pinpriq/packed.py``), and the server uses
#: ``store.QueueStore``.
PACKED = "pinpriq._packed"
#: The C decoder of the hot frames (push, push with options, pop: ``pinpriq/_codec.c``), which
#: ``wire.FrameDecoder`` uses where it is built, unless ``PURE_VARIABLE`` is set.
CODEC = "pinpriq._codec"
#: Set to anything but "" or "0": run the plain-Python modules even where compiled ones exist.
#: Read by setup.py too, which then compiles nothing.
PURE_VARIABLE = "PINPRIQ_PURE_PYTHON"

_PACKAGE_DIR = Path(__file__).resolve().parent


def pure_python_requested() -> bool:
    """Whether the environment asks for the plain-Python modules."""
    return os.environ.get(PURE_VARIABLE, "") not in ("", "0")


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of ``COMPILED`` as their ``.py`` files, shadowing the extensions."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED:
            return None
        source = _PACKAGE_DIR.joinpath(*fullname.split(".")[1:]).with_suffix(".py")
        return importlib.util.spec_from_file_location(fullname, source)


def force_pure_python() -> None:
    """Load the compiled modules from source from now on. Must run before any of them loads:
    one already imported stays what it is."""
    if not any(isinstance(finder, _SourceFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SourceFinder())


def optional_extension(name: str) -> ModuleType | None:
    """The C extension ``name`` (``PACKED``, ``CODEC``), or ``None`` where it is not built (no
    compiler) or not wanted (``PURE_VARIABLE``): its user then runs its Python code."""
    if pure_python_requested():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _is_extension(module: ModuleType) -> bool:
    name = getattr(module, "__file__", None) or ""
    return name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def compiled_modules() -> list[str]:
    """Those of ``COMPILED`` that run as compiled extensions in this process (importing them)."""
    return [name for name in COMPILED if _is_extension(importlib.import_module(name))]


def packed_store_built() -> bool:
    """Whether the packed store's C core is installed and wanted in this process."""
    if pure_python_requested():
        return False
    spec = importlib.util.find_spec(PACKED)
    # Beside this file: an editable install's import hooks may find another checkout's.
    return spec is not None and Path(spec.origin or "").parent == _PACKAGE_DIR


def build_name() -> str:
    """What runs, in a few words, for ``--version`` and the server's first log line."""
    compiled = compiled_modules()
    packed = packed_store_built()
    if len(compiled) == len(COMPILED):
        return "compiled (mypyc, packed store)" if packed else "compiled (mypyc, no packed store)"
    if compiled:  # a broken install: some extensions built, some not
        return "partly compiled (mypyc): " + ", ".join(compiled)
    if pure_python_requested():
        return f"pure Python ({PURE_VARIABLE} is set)"
    if packed:  # mypyc was missing, the C compiler was not
        return "pure Python with the packed store (C)"
    return "pure Python (not compiled when installed)"
