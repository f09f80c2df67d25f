"""The optional compiled core (issue 34): the policy library and the simulator's engine built
into C extensions by mypyc (``python scripts/build_core.py``), beside their sources.

Python imports an extension module before a source file of the same name, so once built the core
is what every replay, shadow and plugin step runs; the sources stay the pure-Python path, giving
the same results bit for bit (``tests/test_compiled_core.py`` replays every policy both ways).
A core built from other sources than the ones beside it would run old code silently: the build
stamps the sources' digest (``STAMP``) and importing ``scheduler`` refuses a stale core
(``StaleCoreError``) — rebuild it, or remove it with ``scripts/build_core.py --clean``.

This module imports nothing of the project but the error base: ``scheduler/__init__.py`` runs its
check before any policy module loads.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
from pathlib import Path

from scheduler.errors import TailpilotError

__all__ = ["COMPILED_MODULES", "STAMP", "StaleCoreError", "check", "digest", "is_compiled"]

ROOT = Path(__file__).resolve().parents[1]  # the directory holding scheduler/ and sim/
# What mypyc compiles (paths from ROOT; a directory is every module in it but its __init__).
COMPILED_MODULES: tuple[str, ...] = (
    "scheduler/policies",
    "sim/engine/step.py",
    "sim/engine/simulator.py",
    "sim/engine/books.py",
)
# The digest of the sources a build compiled, written beside them by the build (path from a root).
STAMP = Path("scheduler") / "compiled_core.sha256"


class StaleCoreError(TailpilotError, ImportError):
    """The compiled core beside the sources was built from other sources."""


def sources(root: Path = ROOT) -> list[Path]:
    """The source files the core is compiled from, in a fixed order."""
    out: list[Path] = []
    for entry in COMPILED_MODULES:
        path = root / entry
        # A package's ``__init__`` stays interpreted: compiled, its ``__path__`` names the shared
        # library's directory, and its submodules could not be imported by name.
        out += (
            sorted(p for p in path.glob("*.py") if p.name != "__init__.py")
            if path.is_dir()
            else [path]
        )
    return out


def digest(root: Path = ROOT) -> str:
    """SHA-256 over the compiled sources' names and contents."""
    h = hashlib.sha256()
    for path in sources(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def extensions(root: Path = ROOT) -> list[Path]:
    """The core's extension modules present beside the sources (none: the pure-Python path);
    in a compiled directory, any extension module (one left by an earlier build included)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found: list[Path] = []
    for entry in COMPILED_MODULES:
        path = root / entry
        if path.is_dir():
            found += sorted(p for p in path.iterdir() if p.name.endswith(suffixes))
        else:
            found += [path.with_name(path.stem + s) for s in suffixes]
    return [p for p in found if p.exists()]


def is_compiled(root: Path = ROOT) -> bool:
    """Whether the compiled core is present (and so what the policy library runs)."""
    return bool(extensions(root))


def check(root: Path = ROOT) -> None:
    """Refuse a compiled core whose stamp does not name the sources beside it."""
    if not is_compiled(root):
        return
    stamp = root / STAMP
    built = stamp.read_text().strip() if stamp.exists() else ""
    if built != digest(root):
        raise StaleCoreError(
            "the compiled core (scheduler/policies, sim/engine) was built from other sources than "
            "the ones beside it: rebuild it with `python scripts/build_core.py`, or remove it "
            "with `python scripts/build_core.py --clean` to run the pure-Python path"
        )
