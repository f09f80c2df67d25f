"""Shared pytest fixtures and the suite's one scheduling rule. The vLLM helpers live in
tests/vllm_support.py."""

from __future__ import annotations

import pytest
from vllm_support import tiny_model_dir  # noqa: F401  (re-exported fixture)

# Every test that runs a real vLLM engine (they all need the tiny model) goes to one xdist worker,
# one after another: two engines on two cores starve each other and the end-to-end tests that
# compare latencies under two settings then measure the neighbour instead (scripts/test.sh runs
# `-n 3 --dist loadgroup`; the other workers take the rest of the suite). They are `slow` too:
# the fast loop (`-m "not slow"`) starts no engine.
ENGINE_GROUP = "vllm-engine"
# Every test that builds vLLM's scheduler in this process (marked `vllm_in_process`) goes to one
# worker too, as a group of its own: importing vLLM (torch and transformers with it) costs a
# process ~15 s of a core, and spread over the workers each paid it (collection imports no vLLM:
# tests/plugin_harness.py imports it at the first scheduler built).
IN_PROCESS_GROUP = "vllm-in-process"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups off the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tiny_model_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(ENGINE_GROUP))
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("vllm_in_process") is not None:
            item.add_marker(pytest.mark.xdist_group(IN_PROCESS_GROUP))
