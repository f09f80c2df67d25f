"""The controller machine's check of a change against its prediction
(``controlplane.verification``): verified only once due and ready, a verdict per change, a step
back after repeated misses. The verifier is scripted here: the live test
(tests/test_autopilot_live.py) runs the real what-if."""

from __future__ import annotations

import asyncio

from controlplane.verification import Ledger, Miss

VERIFY_MS = 60_000


def prediction(pid: int, t_ms: int) -> dict:
    return {"id": pid, "t_ms": t_ms, "summary": {}}


def scripted(outcomes: dict[int, tuple[float, float] | None], calls: list[int]):
    """A verifier answering per prediction id: (realized, predicted), or not ready (None)."""

    def verify(store, p, now_ms):
        calls.append(p["id"])
        outcome = outcomes[p["id"]]
        if outcome is None:
            return {"ready": False}
        realized, predicted = outcome
        return {
            "ready": True,
            "metrics": {"ttft_p95": {"realized": realized, "predicted": predicted}},
        }

    return verify


def check(ledger: Ledger, verifier, now_ms: int, band: float = 0.05) -> Miss | None:
    return asyncio.run(
        ledger.check(verifier, None, now_ms, verify_ms=VERIFY_MS, band=band, step_back_after=2)
    )


def test_a_change_is_verified_once_due_and_its_traffic_is_recorded():
    ledger, calls = Ledger(), []
    ledger.expect(prediction(1, t_ms=0))
    outcomes: dict[int, tuple[float, float] | None] = {1: None}
    assert check(ledger, scripted(outcomes, calls), now_ms=VERIFY_MS - 1) is None
    assert calls == [] and len(ledger.pending) == 1  # not due yet: not even asked
    assert check(ledger, scripted(outcomes, calls), now_ms=VERIFY_MS) is None
    assert calls == [1] and len(ledger.pending) == 1  # due, not ready: still pending
    outcomes[1] = (-0.10, -0.12)  # realized -10%, predicted -12%: within the 5% band
    assert check(ledger, scripted(outcomes, calls), now_ms=VERIFY_MS + 1) is None
    assert ledger.pending == [] and ledger.worse_in_row == 0
    [verdict] = ledger.verdicts
    assert verdict == {
        "id": 1,
        "predicted": -0.12,
        "realized": -0.1,
        "band": 0.05,
        "verdict": "as predicted",
    }


def test_two_misses_in_a_row_step_back_and_clear_the_ledger():
    ledger, calls = Ledger(), []
    for pid in (1, 2, 3):  # three changes due at once; the first two missed
        ledger.expect(prediction(pid, t_ms=0))
    outcomes = {1: (0.20, -0.10), 2: (0.30, -0.05), 3: (-0.1, -0.1)}
    miss = check(ledger, scripted(outcomes, calls), now_ms=VERIFY_MS)
    assert miss == Miss(realized=0.30, predicted=-0.05, band=0.05)
    # The third was applied from the settings stepped back from: never verified, dropped.
    assert calls == [1, 2] and ledger.pending == [] and ledger.worse_in_row == 0
    assert [v["verdict"] for v in ledger.verdicts] == ["worse than predicted"] * 2


def test_a_change_as_predicted_between_misses_resets_the_count():
    ledger, calls = Ledger(), []
    outcomes = {1: (0.2, -0.1), 2: (-0.1, -0.1), 3: (0.2, -0.1)}
    for pid in (1, 2, 3):
        ledger.expect(prediction(pid, t_ms=pid * VERIFY_MS))
        assert check(ledger, scripted(outcomes, calls), now_ms=(pid + 1) * VERIFY_MS) is None
    assert ledger.worse_in_row == 1 and calls == [1, 2, 3]


def test_the_verifications_own_band_wins_over_the_default():
    ledger = Ledger()
    ledger.expect(prediction(1, t_ms=0))

    def wide(store, p, now_ms):
        return {
            "ready": True,
            "band": 0.5,  # the replica's fidelity band: the simulator is that far off here
            "metrics": {"ttft_p95": {"realized": 0.2, "predicted": -0.1}},
        }

    assert check(ledger, wide, now_ms=VERIFY_MS) is None
    assert ledger.worse_in_row == 0 and ledger.verdicts[0]["band"] == 0.5


def test_a_change_with_no_traffic_after_it_has_a_verdict_and_no_count():
    ledger, calls = Ledger(), []
    ledger.expect(prediction(1, t_ms=0))

    def empty(store, p, now_ms):
        calls.append(p["id"])
        return {"ready": True, "metrics": {"ttft_p95": {"realized": None, "predicted": -0.1}}}

    assert check(ledger, empty, now_ms=VERIFY_MS) is None
    assert calls == [1] and ledger.pending == [] and ledger.worse_in_row == 0
    assert list(ledger.verdicts) == [{"id": 1, "verdict": "no traffic to verify on"}]
