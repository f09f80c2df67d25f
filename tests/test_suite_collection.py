"""What every pytest-xdist worker pays before its first test: collecting the suite must not import
vLLM (torch and transformers with it: ~15 s of a core per worker, README "Tests"). The in-process
vLLM tests name its classes through ``plugin_harness.Deferred`` and import them at the first
scheduler built; this fails when a test module imports vLLM at its top again, or when pytest's
collection reaches through a ``Deferred`` (it asks ``__name__`` of what it parametrizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The modules that drive vLLM in-process or start engines: the ones that once imported it.
MODULES = [
    "tests/test_plugin_inprocess.py",
    "tests/test_breaker.py",
    "tests/test_vllm_fixture.py",
    "tests/test_contract.py",
    "tests/test_settings_safety.py",
    "tests/test_plugin_e2e.py",
]

COLLECT = """
import sys
import pytest
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]])
print("collected", int(code), "vllm" in sys.modules, "torch" in sys.modules)
"""


def test_collecting_the_vllm_tests_imports_no_vllm():
    ran = subprocess.run(
        [sys.executable, "-c", COLLECT, *MODULES],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    last = ran.stdout.strip().splitlines()[-1]
    assert last == "collected 0 False False", ran.stdout[-3000:] + ran.stderr[-3000:]
