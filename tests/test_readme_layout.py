"""The README's layout section matches the tree: every path it names exists, and every module of
the project's packages is named in it (a newcomer reads the table to find a room)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler", "controlplane", "sim", "storage", "tuner", "tui", "tailpilot")


def layout_rows(readme: str) -> list[list[str]]:
    """The cells of each row of the table under ``## Layout``."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def named_paths(rows: list[list[str]], root: Path = ROOT) -> tuple[set[Path], list[str]]:
    """Every existing path the table names, and the names that resolve to nothing. A name
    without a slash is looked up in the folder of its row's first path."""
    found: set[Path] = set()
    missing: list[str] = []
    for cells in rows:
        first = re.findall(r"`([^`]+)`", cells[0])
        if not first:
            continue
        head = root / first[0]
        folder = head if first[0].endswith("/") else head.parent
        for cell in cells:
            for name in re.findall(r"`([\w./-]+\.(?:py|tcss)|[\w./-]+/)`", cell):
                candidates = (
                    [root / name] if "/" in name.rstrip("/") else [folder / name, root / name]
                )
                hit = next((c for c in candidates if c.exists()), None)
                if hit is None:
                    missing.append(f"{first[0]}: {name}")
                else:
                    found.add(hit.resolve())
    return found, missing


def unnamed_modules(found: set[Path], root: Path = ROOT) -> list[str]:
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "migrations" in path.parts or path.name == "__init__.py":
                continue
            # A module is named by its own path, or (inside a sub-package) by its folder's.
            in_subpackage = path.parent != root / package
            if path.resolve() in found or (in_subpackage and path.parent.resolve() in found):
                continue
            out.append(str(path.relative_to(root)))
    return out


def test_every_path_in_the_layout_exists_and_every_module_is_named():
    found, missing = named_paths(layout_rows((ROOT / "README.md").read_text(encoding="utf-8")))
    assert missing == []
    assert unnamed_modules(found) == []


def test_the_checker_sees_a_missing_and_an_unnamed_module(tmp_path):
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "store.py").write_text("")
    (tmp_path / "storage" / "orphan.py").write_text("")
    readme = (
        "# x\n\n## Layout\n\n| folder | what |\n|---|---|\n"
        "| `storage/store.py` | `gone.py` |\n\n## Next\n"
    )
    found, missing = named_paths(layout_rows(readme), tmp_path)
    assert missing == ["storage/store.py: gone.py"]
    assert [m for m in unnamed_modules(found, tmp_path) if m.startswith("storage/")] == [
        "storage/orphan.py"
    ]
