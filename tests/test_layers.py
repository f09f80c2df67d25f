"""The import contract: which layers may import which (every import, lazy ones included).

- ``scheduler`` (what runs inside vLLM, and the library the simulator shares with it) imports
  nothing of the operator side (``controlplane``, ``storage``, ``tuner``, ``tui``), the simulator
  or the CLI; its policy library imports no vLLM and no plugin;
- the simulator (``sim``) imports the scheduler library only — nothing of ``controlplane``;
- ``storage`` imports nothing of the project — everything above may use it;
- nothing imports the CLI (the ``tailpilot`` package) but its entry points.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The library; tailpilot/ (the CLI) sits on top.
PROJECT = ("scheduler", "controlplane", "storage", "tuner", "tui", "sim")
OPERATOR = ("controlplane", "storage", "tuner", "tui", "tailpilot")

RULES = {
    "scheduler": (*OPERATOR, "sim"),
    "scheduler/policies": (*OPERATOR, "sim", "vllm", "scheduler.plugin"),
    "sim": (*OPERATOR, "vllm", "scheduler.plugin"),
    "storage": PROJECT,
}


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, relative ones resolved."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
    return out


def violations(folder: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """Imports under ``folder`` (Alembic revisions included) of a forbidden module; a layer may
    import itself."""
    own = folder.replace("/", ".")
    bad = []
    for path in sorted((root / folder).rglob("*.py")):
        for line, module in imports(path, root):
            if module == own or module.startswith(own + "."):
                continue
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("folder", list(RULES))
def test_layer_imports_only_what_it_may(folder):
    assert violations(folder, RULES[folder]) == []


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "probe.py").write_text(
        "import json\n\ndef f():\n    from controlplane import settings\n    from . import engine\n"
        "    import tui.app\n"
    )
    found = imports(tmp_path / "storage" / "probe.py", tmp_path)
    assert (4, "controlplane") in found and (5, "storage") in found and (6, "tui.app") in found
    assert violations("storage", PROJECT, tmp_path) == [
        "storage/probe.py:4 imports controlplane",
        "storage/probe.py:6 imports tui.app",
    ]


def test_the_plugin_needs_only_the_base_install():
    """What the plugin loads into vLLM's process (vLLM itself aside) is the base install's:
    numpy, scipy, pydantic — not the operator's CLI, storage, TUI or tuner packages."""
    import json
    import subprocess
    import sys

    code = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        "import scheduler.plugin.api, scheduler.plugin.core, scheduler.plugin.env\n"
        "import scheduler.policies.preemption, scheduler.policies.predictors\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(json.dumps(sorted(m for m in new if m not in sys.stdlib_module_names)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(out.stdout))
    base = {
        "scheduler",
        "numpy",
        "scipy",
        "pydantic",
        "pydantic_core",
        "annotated_types",
        "typing_extensions",
        "typing_inspection",
    }
    operator = {
        "click",
        "rich",
        "sqlalchemy",
        "alembic",
        "psycopg",
        "httpx",
        "aiohttp",
        "prometheus_client",
        "yaml",
        "textual",
        "textual_plotext",
        "optuna",
        "controlplane",
        "storage",
        "tuner",
        "tui",
        "sim",
    }
    assert not loaded & operator, sorted(loaded & operator)
    extra = {m for m in loaded - base if not m.startswith("_") and m != "cython_runtime"}
    assert extra <= {"charset_normalizer"}, sorted(extra)  # numpy/scipy's optional helpers aside


def test_nothing_imports_the_cli():
    """The CLI (the ``tailpilot`` package) sits above everything it imports: no library module
    imports it (entry points aside)."""
    entry_points = {"tui/__main__.py"}
    bad = []
    for folder in PROJECT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in entry_points:
                continue
            bad += [
                f"{rel}:{line} imports {m}"
                for line, m in imports(path)
                if m == "tailpilot" or m.startswith("tailpilot.")
            ]
    assert bad == []
