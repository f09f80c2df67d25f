"""Pure render functions of the TUI (tui/render.py) on known inputs."""

from __future__ import annotations


def test_verification_cell_says_predicted_then_realized_with_the_band():
    from tui.render import verification_cell

    assert verification_cell(None).plain == "—"
    waiting = {
        "ready": False,
        "due_ms": 1_700_000_000_000,
        "predicted": {"ttft_p95": -0.29},
        "band": None,
    }
    assert verification_cell(waiting).plain.startswith("-29% → due ")
    done = {
        "ready": True,
        "predicted": {"ttft_p95": -0.29},
        "band": 0.09,
        "metrics": {"ttft_p95": {"realized": -0.17}},
    }
    assert verification_cell(done).plain == "-29% → -17% (±9%)"
