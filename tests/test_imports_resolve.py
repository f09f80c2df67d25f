"""Every ``from <project module> import name`` in the tests, the benchmarks and the library names
something that exists. mypy checks the library's imports but not the tests' and the benchmarks',
and an import inside a slow test's body fails only when that test runs (a function moved from one
module to another once broke a slow test this way, found only by a fresh clone's CI run)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("scheduler", "controlplane", "storage", "tuner", "tui", "sim", "tailpilot", "benchmarks")


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks (annotations only: never imported at run time)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def unresolved(paths: list[Path]) -> list[str]:
    bad = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            if node.module.split(".")[0] not in PROJECT or node.lineno in skip:
                continue
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            where = f"{shown}:{node.lineno}"
            try:
                module = importlib.import_module(node.module)
            except ImportError as err:
                bad.append(f"{where} {node.module}: {err}")
                continue
            for alias in node.names:
                if alias.name == "*" or hasattr(module, alias.name):
                    continue
                try:  # a submodule named in the import
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    bad.append(f"{where} {node.module} has no {alias.name}")
    return bad


def test_every_import_of_a_project_name_resolves():
    paths = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    for package in PROJECT:
        paths += sorted((ROOT / package).rglob("*.py"))
    assert unresolved(paths) == []


def test_the_checker_sees_a_name_a_module_does_not_have(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from tuner.autopilot.live import only_for_annotations\n"
        "def f():\n"
        "    from tuner.autopilot.live import no_such_name\n",
        encoding="utf-8",
    )
    assert unresolved([probe]) == ["probe.py:5 tuner.autopilot.live has no no_such_name"]
