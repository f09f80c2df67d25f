"""The frozen workloads of the autopilot benchmark (benchmarks/autopilot_frozen.py): built from the
repository's public traces exactly as the README records them (its sha256 per workload), so a
change to a builder shows; the held-out shape shift runs its three phases back to back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import autopilot_frozen as frozen  # noqa: E402
from benchmarks.autopilot_workloads import phase_of  # noqa: E402

TRACES = REPO / "traces"
# Both tests read one build of every workload (~30 s of a core): on one xdist worker, it is built
# once.
pytestmark = pytest.mark.xdist_group("frozen-workloads")


@pytest.fixture(scope="module")
def built():
    return {name: frozen.build_frozen_workload(name, TRACES)[0] for name in frozen.FROZEN_WORKLOADS}


@pytest.mark.slow
def test_every_frozen_workload_is_the_one_the_readme_records(built):
    readme = (REPO / "README.md").read_text()
    for name, trace in built.items():
        digest = frozen.digest(trace)
        assert f"`{digest}`" in readme, f"{name}: sha256 {digest} is not what the README records"


@pytest.mark.slow
def test_the_held_out_shift_runs_its_phases_back_to_back(built):
    trace = built["shift_heldout"]
    order = []
    for r in trace:
        if not order or order[-1] != phase_of(r.id):
            order.append(phase_of(r.id))
    assert order == ["sharegpt", "mooncake", "bwb"]  # each phase once, in this order
    spans = {
        p: [r.arrival for r in trace if phase_of(r.id) == p]
        for p in ("sharegpt", "mooncake", "bwb")
    }
    for p, arrivals in spans.items():
        assert (
            0.9 * frozen.SHIFT_HELDOUT_PHASE_S
            < max(arrivals) - min(arrivals)
            < 1.1 * (frozen.SHIFT_HELDOUT_PHASE_S)
        ), p
    assert all(r.prompt_tokens + r.output_tokens <= frozen.CONTEXT_TOKENS for r in trace)
