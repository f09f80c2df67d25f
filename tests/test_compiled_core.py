"""The optional compiled core (scheduler.compiled, scripts/build_core.py): compiled and pure
Python replay every policy alike, bit for bit; a core built from other sources is refused."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler import compiled
from scheduler.policies.predictors import PREDICTORS, HistoryPredictor

REPO = Path(__file__).resolve().parents[1]

# Every policy (and the variants whose paths differ: preemption, MemGuard off, a fixed γ, the
# oracle), on the bundled window at 2.5x its rate: preemptions, KV pressure, event skipping.
REPLAY = r"""
import hashlib, json, sys
from sim.engine import Simulator
from sim.traces import load_bundled, scale_rate
from scheduler.settings import Settings
import scheduler.compiled, scheduler.policies.base
rows = {
    "fcfs": {"policy": "fcfs"}, "sarathi": {"policy": "sarathi"},
    "sjf": {"policy": "sjf", "params": {"predictor": "history"}},
    "srpt": {"policy": "srpt", "params": {"predictor": "history"}},
    "srpt-oracle": {"policy": "srpt", "params": {"predictor": "oracle"}},
    "las": {"policy": "las"}, "distboost": {"policy": "distboost"},
    "uniboost": {"policy": "uniboost"},
    "uniboost-nomg": {"policy": "uniboost", "params": {"memguard": False}},
    "uniboost-g": {"policy": "uniboost", "params": {"gamma_ada": False, "gamma": 0.01}},
    "tie": {"policy": "tie", "params": {"predictor": "history"}},
    "vtc": {"policy": "vtc"}, "slofq": {"policy": "slofq"},
}
trace = scale_rate(load_bundled(), 2.5)
out = {"compiled": scheduler.compiled.is_compiled(),
       "module": scheduler.policies.base.__file__}
for name, doc in rows.items():
    res = Simulator(trace, Settings.model_validate(doc)).run()
    h = hashlib.sha256()
    for c in sorted(res.completions, key=lambda c: c.id):
        h.update(repr((c.id, c.arrival, c.scheduled_at, c.first_token_at, c.finished_at,
                       c.preemptions, c.recomputed_tokens)).encode())
    out[name] = [h.hexdigest(), res.preemptions, res.steps]
json.dump(out, sys.stdout)
"""


def _copy_tree(dest: Path, *, with_core: bool) -> None:
    """The packages a replay needs, into ``dest``: with or without the compiled core."""
    core = (*importlib.machinery.EXTENSION_SUFFIXES, compiled.STAMP.name)

    def skip(directory: str, names: list[str]) -> set[str]:
        return {
            n
            for n in names
            if n == "__pycache__" or n.endswith(".pyc") or (not with_core and n.endswith(core))
        }

    for package in ("scheduler", "sim"):
        shutil.copytree(REPO / package, dest / package, ignore=skip)
    (dest / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "build_core.py", dest / "scripts" / "build_core.py")
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")  # the type checker's settings


def _python_in(root: Path, *args: str, timeout: float) -> str:
    """Run Python with ``args`` on the packages under ``root`` (before the editable install);
    its standard output, the run required to succeed."""
    done = subprocess.run(
        [sys.executable, *args],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    return done.stdout


def _replay(root: Path) -> dict[str, object]:
    """The replays' hashes, run from the packages under ``root``."""
    result: dict[str, object] = json.loads(_python_in(root, "-c", REPLAY, timeout=600))
    assert str(result["module"]).startswith(str(root)), "the replay ran another tree's modules"
    return result


@pytest.mark.slow
def test_compiled_and_pure_python_replay_every_policy_alike(tmp_path):
    """The pure-Python path is the compiled core's reference: every policy's replay (completion
    times, preemptions, steps) is identical. Where the working tree has no core, one is built
    in a copy (a minute)."""
    pure, core = tmp_path / "pure", tmp_path / "core"
    _copy_tree(pure, with_core=False)
    _copy_tree(core, with_core=True)
    if not compiled.is_compiled():
        _python_in(core, "scripts/build_core.py", timeout=900)
    got_pure, got_core = _replay(pure), _replay(core)
    assert got_pure.pop("compiled") is False
    assert got_core.pop("compiled") is True
    assert str(got_core.pop("module")).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    got_pure.pop("module")
    assert got_core == got_pure
    assert any(v[1] > 0 for v in got_pure.values())  # type: ignore[index]  # preemptions ran


def test_a_core_built_from_other_sources_is_refused(tmp_path):
    _copy_tree(tmp_path, with_core=False)
    compiled.check(tmp_path)  # no core: the pure-Python path, nothing to check
    extension = (
        tmp_path / "scheduler" / "policies" / ("base" + importlib.machinery.EXTENSION_SUFFIXES[0])
    )
    extension.write_bytes(b"")  # a core is present ...
    assert compiled.is_compiled(tmp_path)
    stamp = tmp_path / compiled.STAMP
    stamp.write_text(compiled.digest(tmp_path) + "\n")
    compiled.check(tmp_path)  # ... built from these sources: taken
    source = tmp_path / "sim" / "engine" / "step.py"
    source.write_text(source.read_text() + "\n# edited after the build\n")
    with pytest.raises(compiled.StaleCoreError, match=r"scripts/build_core\.py"):
        compiled.check(tmp_path)  # an edited source: refused, naming the fix
    stamp.unlink()
    with pytest.raises(compiled.StaleCoreError):
        compiled.check(tmp_path)  # no stamp at all: refused too


def test_every_compiled_source_is_in_the_digest():
    names = {p.relative_to(REPO).as_posix() for p in compiled.sources()}
    assert "scheduler/policies/base.py" in names and "sim/engine/simulator.py" in names
    assert all((REPO / n).exists() for n in names)


def test_predictor_parameters_name_their_constructors():
    """``make_predictor`` checks keywords against ``PARAMETERS`` (a compiled constructor's
    signature reads ``*args, **kwargs``): each list is its constructor's, read from the source."""
    tree = ast.parse((REPO / "scheduler" / "policies" / "predictors.py").read_text())
    inits = {
        node.name: [a.arg for a in item.args.args[1:] + item.args.kwonlyargs]
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.FunctionDef) and item.name == "__init__"
    }
    for cls in PREDICTORS.values():
        assert list(cls.PARAMETERS) == inits[cls.__name__], cls.__name__


def test_a_predictors_copy_carries_every_attribute_it_sets():
    """``HistoryPredictor`` names the state it pickles (a compiled one has no ``__dict__``): the
    list is every attribute but its lock, and a copy predicts as the original does."""
    import pickle
    from types import SimpleNamespace

    h = HistoryPredictor(min_samples=2)
    for i in range(30):
        h.observe(SimpleNamespace(id=f"r{i}", prompt_tokens=100), 10 + i)
    h.refit()
    tree = ast.parse((REPO / "scheduler" / "policies" / "predictors.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HistoryPredictor")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {
        target.attr
        for node in ast.walk(init)
        for target in (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if isinstance(target, ast.Attribute)
    }
    assert assigned - {"_lock"} == set(HistoryPredictor.STATE)
    copy = pickle.loads(pickle.dumps(h))
    probe = SimpleNamespace(id="p", prompt_tokens=100)
    assert copy.predict_dist(probe) == h.predict_dist(probe)
    assert copy.version == h.version and copy._lock is not h._lock


@pytest.mark.slow
def test_the_reference_comparisons_run_on_the_pure_sources(tmp_path):
    """``tests/test_deep_queue.py``'s ``pure_path`` tests compare the fast paths with a plain
    reference by swapping the library's internals (mock.patch), which cannot reach a compiled
    core: they run here on a copy of the pure sources, whichever the working tree has."""
    _copy_tree(tmp_path, with_core=False)
    (tmp_path / "tests").mkdir()
    shutil.copy(REPO / "tests" / "test_deep_queue.py", tmp_path / "tests")
    out = _python_in(
        tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "pure_path", timeout=900
    )
    assert " passed" in out and "skipped" not in out, out[-2000:]
