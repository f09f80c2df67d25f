"""The import contract: which layers may import which (every import, lazy ones included).

- ``scheduler`` (what runs inside vLLM, and the library the simulator shares with it) imports
  nothing of the operator side (``controlplane``, ``storage``, ``tuner``, ``tui``), the simulator
  or the CLI; its policy library imports no vLLM and no plugin;
- the simulator (``sim``) imports the scheduler library only — nothing of ``controlplane``;
- ``storage`` imports nothing of the project but the one error base (``scheduler.errors``, a module
  of no imports) — everything above may use it;
- nothing imports the CLI (the ``tailpilot`` package) but its entry points.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The library; tailpilot/ (the CLI) sits on top.
PROJECT = ("scheduler", "controlplane", "storage", "tuner", "tui", "sim")
PACKAGES = (*PROJECT, "tailpilot")  # everything, the CLI included
OPERATOR = ("controlplane", "storage", "tuner", "tui", "tailpilot")

# Modules of no imports of their own that every floor may use: the one error base, the bound and
# defaults of tenant and type names.
EVERYONES = frozenset({"scheduler.errors", "scheduler.names"})

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
            out.append((node.lineno, imported_module(node, package)))
    return out


def imported_module(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from … import`` names, a relative one resolved against ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def violations(folder: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """Imports under ``folder`` (Alembic revisions included) of a forbidden module; a layer may
    import itself."""
    own = folder.replace("/", ".")
    bad = []
    for path in sorted((root / folder).rglob("*.py")):
        for line, module in imports(path, root):
            if module == own or module.startswith(own + "."):
                continue
            if module in EVERYONES:
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
    numpy, scipy, pydantic, mypy_extensions — not the operator's CLI, storage, TUI or tuner
    packages."""
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
        "mypy_extensions",  # the compiled core's class attributes (no-ops when not compiled)
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


# --- no cycles between modules; imports inside functions only with a reason -------------------


def _module_file(name: str, root: Path) -> Path | None:
    """The file of project module ``name`` (a module or a package's ``__init__``), if any."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _runtime_imports(
    tree: ast.AST, type_checking: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """Every import that runs (module level or inside functions), ``if TYPE_CHECKING:`` aside
    unless ``type_checking``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child) and not type_checking:
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def module_graph(root: Path = ROOT, type_checking: bool = False) -> dict[str, set[str]]:
    """Project module -> the project modules it imports (lazy imports included, and with
    ``type_checking`` those only the type checker reads; a ``from a import b`` names the
    submodule ``a.b`` when there is one, else ``a``)."""
    graph: dict[str, set[str]] = {}
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            name = ".".join(parts)
            package = ".".join(rel.parts[:-1])
            edges = graph.setdefault(name, set())
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in _runtime_imports(tree, type_checking):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    module = imported_module(node, package)
                    targets = [
                        f"{module}.{a.name}" if _module_file(f"{module}.{a.name}", root) else module
                        for a in node.names
                    ]
                for target in targets:
                    while target and _module_file(target, root) is None:
                        target = target.rpartition(".")[0]
                    if target and target != name:
                        edges.add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_import_cycles_between_modules():
    assert cycles(module_graph()) == []


def test_no_type_only_import_circles():
    """Not even through ``if TYPE_CHECKING:`` imports: a module that needs a type from one that
    imports it takes a narrow protocol of its own instead (``scheduler.policies.base``'s
    ``OrderedWaiting``, ``tuner.twins.metrics``'s ``ScrapedTwin``), or the two are one class's
    concerns (``sim.engine.books.EngineBooks``, the simulator's base)."""
    assert cycles(module_graph(type_checking=True)) == []


def test_the_cycle_checker_finds_a_cycle_closed_by_a_lazy_import(tmp_path):
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "__init__.py").write_text("")
    (tmp_path / "storage" / "a.py").write_text("from storage import b\n")
    (tmp_path / "storage" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from storage import c\n"
        "def f():\n    from storage.a import x\n"
    )
    (tmp_path / "storage" / "c.py").write_text("from storage import b\n")
    for folder in PACKAGES:
        (tmp_path / folder).mkdir(exist_ok=True)
    graph = module_graph(tmp_path)
    assert graph["storage.b"] == {"storage.a"}  # the TYPE_CHECKING import is not an edge
    assert cycles(graph) == [["storage.a", "storage.b"]]
    # ... unless type-only circles are asked for: then b -> c -> b closes one too.
    typed = module_graph(tmp_path, type_checking=True)
    assert typed["storage.b"] == {"storage.a", "storage.c"}
    assert cycles(typed) == [["storage.a", "storage.b", "storage.c"]]


def unexplained_lazy_imports(root: Path = ROOT) -> list[str]:
    """Imports inside functions without a comment (on their line or the line above) saying
    why they are there: an optional dependency, a measured start-up cost, a cycle."""
    bad = []
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            lines = path.read_text(encoding="utf-8").splitlines()
            for fn in ast.walk(ast.parse("\n".join(lines))):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if not isinstance(node, (ast.Import, ast.ImportFrom)):
                        continue
                    first = lines[node.lineno - 1]
                    block = lines[node.lineno - 1 : node.end_lineno]
                    above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                    if not any("#" in line for line in block) and not above.startswith("#"):
                        bad.append(f"{path.relative_to(root)}:{node.lineno}: {first.strip()}")
    return sorted(set(bad))


def test_imports_inside_functions_say_why():
    assert unexplained_lazy_imports() == []


def test_one_http_client_library():
    """The operator side talks HTTP through aiohttp only (controlplane/http.py): no second client
    library (httpx, requests, urllib's opener) in the project's packages. (The scheduler's control
    server is the standard library's HTTP server: it serves, it is not a client.)"""
    others = ("httpx", "requests", "urllib.request", "urllib3", "http.client")
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for folder in PACKAGES
        if folder != "scheduler"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, module in imports(path)
        if any(module == o or module.startswith(o + ".") for o in others)
    ]
    assert bad == []


# --- one path per action: a name=value is taken apart in one place ------------------------------
_SPLITTERS = frozenset({"split", "rsplit", "partition", "rpartition"})
ASSIGNMENT_SPLITTER = ("scheduler/settings_change.py", "split_assignment")
# Where a second parser would be one: the packages, and the benchmarks and scripts beside them.
ASSIGNMENT_SCOPE = (*PACKAGES, "benchmarks", "scripts")


def _splits_at_equals(node: ast.AST) -> bool:
    """A call that takes text apart at ``=``: ``<str>.split("=")`` (rsplit, partition,
    rpartition; the separator positional or ``sep=``), or ``re.split("=", ...)``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr not in _SPLITTERS:
        return False
    separators = [*node.args[:1], *(k.value for k in node.keywords if k.arg in ("sep", "pattern"))]
    if isinstance(node.func.value, ast.Name) and node.func.value.id == "re":
        separators = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "pattern")]
    return any(isinstance(a, ast.Constant) and a.value == "=" for a in separators)


def assignment_splits(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line function`` of every split at ``=`` (``_splits_at_equals``) in ``path``,
    wherever it is — in a function, a class body or at module level (``<module>``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    enclosing: dict[ast.AST, str] = {}
    # Functions in the order they begin: an inner function comes after the one around it, so each
    # node ends up named by its innermost function.
    for func in sorted(
        (f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)),
        key=lambda f: f.lineno,
    ):
        for node in ast.walk(func):
            if node is not func:
                enclosing[node] = func.name
    return sorted(
        {
            f"{path.relative_to(root)}:{node.lineno} {enclosing.get(node, '<module>')}"
            for node in ast.walk(tree)
            if _splits_at_equals(node)
        }
    )


def test_a_name_value_assignment_is_split_in_one_place():
    """``scheduler.settings_change.split_assignment`` is the one parser of ``name=value`` (--set,
    the TUI's edits, KEY=VALUE options, search ranges, a vllm serve line's environment): a second
    split at ``=`` anywhere in the project, its benchmarks and scripts fails here."""
    found = [
        hit
        for folder in ASSIGNMENT_SCOPE
        for path in sorted((ROOT / folder).rglob("*.py"))
        for hit in assignment_splits(path)
    ]
    file, func = ASSIGNMENT_SPLITTER
    assert [h for h in found if not h.startswith(file) or not h.endswith(" " + func)] == []
    assert any(h.startswith(file) and h.endswith(" " + func) for h in found)


def test_the_assignment_check_sees_a_second_splitter(tmp_path):
    (tmp_path / "tuner").mkdir()
    probe = tmp_path / "tuner" / "probe.py"
    probe.write_text(
        "import re\n"
        'PAIRS = [t.partition("=") for t in ("a=1",)]\n'
        "def f(t):\n"
        '    return t.split("=", 1)\n'
        "def g(t):\n"
        '    return t.split(",")\n'
        "class C:\n"
        "    def h(self, t):\n"
        "        def inner(u):\n"
        '            return u.rsplit(sep="=", maxsplit=1)\n'
        '        return re.split("=", t)\n'
    )
    assert assignment_splits(probe, tmp_path) == [
        "tuner/probe.py:10 inner",
        "tuner/probe.py:11 h",
        "tuner/probe.py:2 <module>",
        "tuner/probe.py:4 f",
    ]


# --- one error base -------------------------------------------------------------------------------
def test_the_error_base_imports_nothing():
    assert imports(ROOT / "scheduler" / "errors.py") == [(13, "__future__")]


def test_every_error_class_derives_from_the_one_base():
    """Every exception class the project defines is a ``TailpilotError`` (the command line maps
    its ``exit_code``), whatever builtin it also is."""
    bases = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    names = {
                        b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                        for b in node.bases
                    }
                    if names & {
                        "Exception",
                        "ValueError",
                        "RuntimeError",
                        "KeyError",
                        "LookupError",
                    }:
                        bases.add(
                            (f"{path.relative_to(ROOT)}", node.name, "TailpilotError" in names)
                        )
    missing = sorted(
        (path, name)
        for path, name, ok in bases
        if not ok and (path, name) != ("scheduler/errors.py", "TailpilotError")
    )
    assert missing == []
    assert len(bases) >= 20


# --- public names ---------------------------------------------------------------------------------
def package_inits(root: Path = ROOT) -> list[Path]:
    return sorted(p for package in PACKAGES for p in (root / package).rglob("__init__.py"))


def declared_names(init: Path) -> list[str]:
    """The names a package's ``__init__.py`` declares public (``__all__``, a literal list or
    ``sorted`` of a dict's keys); [] when it declares none."""
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            value = node.value
            if isinstance(value, ast.List):
                return [e.value for e in value.elts if isinstance(e, ast.Constant)]
            return ["<computed>"]
    return []


@pytest.mark.parametrize("init", package_inits(), ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_every_package_declares_its_public_names(init):
    import importlib

    names = declared_names(init)
    assert names, f"{init.relative_to(ROOT)}: no __all__"
    package = ".".join(init.parent.relative_to(ROOT).parts)
    module = importlib.import_module(package)
    for name in module.__all__:
        assert hasattr(module, name) or importlib.util.find_spec(f"{package}.{name}"), name


def lists_rooms(folder: Path) -> bool:
    """A package whose ``__all__`` names its modules (tuner's folders), not exported names."""
    init = folder / "__init__.py"
    names = declared_names(init) if init.exists() else []
    return bool(names) and all(
        (folder / f"{n}.py").exists() or (folder / n / "__init__.py").exists() for n in names
    )


def test_another_floor_imports_only_declared_rooms():
    """An import of ``pkg.room`` (``import pkg.room``, ``from pkg.room import x``) from another
    floor names a room ``pkg/__init__.py`` declares in ``__all__``, where a package lists its rooms
    (``storage`` and ``tui`` export names instead)."""
    rooms = {}
    for package in ("scheduler", "sim", "controlplane", "tuner", "tailpilot"):
        rooms[package] = set(declared_names(ROOT / package / "__init__.py"))
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in imports(path):
                parts = module.split(".")
                if parts[0] not in rooms or parts[0] == package or len(parts) < 2:
                    continue
                folder = ROOT / parts[0] / parts[1]
                if parts[1] not in rooms[parts[0]] or (
                    # a room that is a folder listing its own rooms (tuner's): the module named
                    # is one it declares
                    len(parts) > 2
                    and lists_rooms(folder)
                    and parts[2] not in declared_names(folder / "__init__.py")
                ):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert bad == []


def test_the_tuner_folders_list_their_rooms_and_an_undeclared_one_is_refused():
    """tuner's folders are read as lists of rooms (scheduler.metrics exports names instead), so an
    import of ``tuner.autopilot.candidates`` from another floor is refused: the folder keeps it
    for its own modules."""
    assert lists_rooms(ROOT / "tuner" / "autopilot")
    assert not lists_rooms(ROOT / "scheduler" / "metrics")
    declared = declared_names(ROOT / "tuner" / "autopilot" / "__init__.py")
    assert "controller" in declared and "candidates" not in declared


_WAITS = frozenset({"sleep", "wait", "wait_for"})


def _ticks(loop: ast.While | ast.For | ast.AsyncFor) -> bool:
    """A loop that runs until told to stop — ``while not <event>.is_set()`` — or that waits between
    its turns (a ``sleep``, ``wait`` or ``wait_for`` call in its body): a periodic loop, whatever
    its test (``while True``, ``while self.running``, ``for _ in count()``)."""
    test = getattr(loop, "test", None)
    if (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and isinstance(test.operand, ast.Call)
        and isinstance(test.operand.func, ast.Attribute)
        and test.operand.func.attr == "is_set"
    ):
        return True
    return any(
        isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in _WAITS
        for statement in loop.body
        for node in ast.walk(statement)
    )


# What changes a replica's settings: steering's send, and the host's carrying out of a
# controller's change (which sends it).
_CHANGERS = ("apply_settings", "carry_out")


def own_loops_and_changes(path: Path) -> tuple[list[int], bool]:
    """(lines of periodic loops (``_ticks``), whether it changes replicas' settings: calls
    steering's ``apply_settings`` or the controller host's ``carry_out`` — by name, or as
    ``steering.apply_settings`` / ``controller_host.carry_out``; a simulator's own
    ``sim.apply_settings`` is an engine taking a document, not a controller changing a
    replica)."""
    tree = ast.parse(path.read_text())
    loops = sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.While | ast.For | ast.AsyncFor) and _ticks(node)
    )
    changes = any(
        isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id in _CHANGERS)
            or (
                isinstance(node.func, ast.Attribute)
                and node.func.attr in _CHANGERS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("steering", "controller_host")
            )
        )
        for node in ast.walk(tree)
    )
    return loops, changes


def test_a_controller_runs_in_the_one_controller_loop():
    """A module that changes replicas' settings (calls ``apply_settings`` or ``carry_out``) runs
    no loop of its own: a controller is stepped by
    ``controlplane.controller_host.run_controller``, whose loop owns the tick, the failed step and
    the bounded close (docs/architecture.md)."""
    host_path = ROOT / "controlplane" / "controller_host.py"
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            loops, changes = own_loops_and_changes(path)
            if changes and loops and path != host_path:
                bad.append(f"{path.relative_to(ROOT)}:{loops[0]}")
    assert bad == []
    loops, changes = own_loops_and_changes(host_path)
    [run] = [
        f
        for f in ast.parse(host_path.read_text()).body
        if isinstance(f, ast.AsyncFunctionDef) and f.name == "run_controller"
    ]
    # The one loop (its ticks, and its bounded wait for the close) and the one carrier of the
    # controllers' changes.
    assert loops and all(run.lineno <= line <= (run.end_lineno or 0) for line in loops)
    assert changes


# The controllers' own modules: the rule and its live hosting, of each controller.
CONTROLLER_MODULES = (
    "controlplane/governor.py",
    "controlplane/governor_live.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tuner" / "autopilot").rglob("*.py")),
)


def steering_calls(path: Path) -> list[str]:
    """``name:line`` of each use of steering's send or dry-run audit (``apply_settings``,
    ``record_dry_run``: imported, called or referred to, also through the module under another
    name) in ``path``."""
    names = ("apply_settings", "record_dry_run")
    tree = ast.parse(path.read_text())
    # The names the steering module goes by here: ``steering``, or an alias of it.
    modules = {"steering"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "controlplane.steering"}
        elif isinstance(node, ast.ImportFrom) and node.module == "controlplane":
            modules |= {a.asname or a.name for a in node.names if a.name == "steering"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"{a.name}:{node.lineno}" for a in node.names if a.name in names]
        elif isinstance(node, ast.Name) and node.id in names:
            found.append(f"{node.id}:{node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr in names:
            value, dotted = node.value, []
            while isinstance(value, ast.Attribute):
                dotted.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                dotted.append(value.id)
                if ".".join(reversed(dotted)) in modules:
                    found.append(f"{node.attr}:{node.lineno}")
    return found


def test_controllers_carry_their_changes_out_through_the_host():
    """Whether a controller's change is sent or only written to the audit as a dry run is the
    host's to say (``controller_host.carry_out``: acting, the lease, ``apply_settings`` or
    ``record_dry_run``): no controller's module calls steering itself (docs/architecture.md)."""
    bad = {m: steering_calls(ROOT / m) for m in CONTROLLER_MODULES}
    assert {m: c for m, c in bad.items() if c} == {}
    assert "tuner/autopilot/live.py" in CONTROLLER_MODULES
    assert steering_calls(ROOT / "controlplane" / "controller_host.py")  # the one that does


def test_the_steering_check_sees_a_controller_sending_itself(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from controlplane.steering import apply_settings\n"
        "from controlplane import steering\n"
        "async def act(c):\n"
        "    await steering.record_dry_run(c)\n"
        "    f = apply_settings\n"
    )
    assert sorted(steering_calls(probe)) == [
        "apply_settings:1",
        "apply_settings:5",
        "record_dry_run:4",
    ]
    probe.write_text(
        "import controlplane.steering as st\n"
        "import controlplane.steering\n"
        "async def act(c):\n"
        "    await st.apply_settings(c)\n"
        "    await controlplane.steering.record_dry_run(c)\n"
        "    await other.apply_settings(c)\n"
    )
    assert sorted(steering_calls(probe)) == ["apply_settings:4", "record_dry_run:5"]


def test_the_controller_loop_checker_sees_a_second_loop(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "async def run(stop, cluster):\n"
        "    while not stop.is_set():\n"
        "        await apply_settings(cluster, None, {})\n"
    )
    assert own_loops_and_changes(probe) == ([2], True)
    # Other shapes of a periodic loop: forever with a sleep, over a counter waiting on an event.
    probe.write_text(
        "import asyncio, itertools\n"
        "async def run(cluster, stop):\n"
        "    while True:\n"
        "        await apply_settings(cluster, None, {})\n"
        "        await asyncio.sleep(5)\n"
        "def spin(cluster, stop):\n"
        "    for _ in itertools.count():\n"
        "        stop.wait(5)\n"
        "    for r in cluster:\n"
        "        print(r)\n"
    )
    assert own_loops_and_changes(probe) == ([3, 7], True)
    # An engine's own loop that takes a document (a twin's simulator) is not a controller's.
    probe.write_text(
        "import time\n"
        "def run(sim, doc):\n"
        "    while True:\n"
        "        sim.apply_settings(doc)\n"
        "        time.sleep(1)\n"
    )
    assert own_loops_and_changes(probe) == ([3], False)
