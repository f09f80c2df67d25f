"""The governance text views (``tailpilot status``'s lines, the TUI's alert bar, alerts panel and
replica summary) show the governance report's figures and compute none of their own: JFI beside
JFI (seed), pending alerts, ω with the over-consumers marked, starved tenants' waits, and the
governor's throttled tenants, held reason and kept changes. The report is the worked example of
docs/governance.md (tests/test_fairness_figures.py)."""

from __future__ import annotations

import pytest
from test_fairness_figures import example_report

from controlplane.views import (
    alert_text,
    governance_lines,
    governor_notes,
    omega_text,
    waiting_text,
)
from storage.rows import GroupSampleRow, LatencyPercentiles
from tui import render as R
from tui.alerts_render import (
    GOVERNANCE_COLUMNS,
    governance_rows,
    governance_summary,
    governor_line,
)


@pytest.fixture
def report() -> dict:
    rep = example_report()  # JFI 0.750, JFI (seed) 0.533, gamma over-consumes, delta starved
    rep.update(alerts={"scr": "warning"}, alerts_pending={"jfi": "warning", "scr": "critical"})
    return rep


def plain(lines) -> list[str]:
    return [line.plain for line in lines]


def test_status_lines_give_both_jfis_pending_alerts_omega_and_the_starved(report):
    lines = plain(governance_lines(report))
    assert lines[0] == "ALERT SCR 0.75 (warning)   pending: SCR 0.75 (critical), JFI 0.75 (warning)"
    assert lines[1] == (
        "SCR 0.75   JFI 0.75   JFI (seed) 0.533   type fairness (min) 0.417   "
        "12 requests in the window"
    )
    assert lines[2] == "over-consumers (ω < 1): gamma ω 0.4   starved: delta (3 waiting ≥12.00s)"
    by_tenant = {line.split(":")[0].strip(): line for line in lines[3:]}
    assert sorted(by_tenant) == ["acme", "beta", "delta", "gamma"]
    assert "served/entitled 1   ω 0.4 over" in by_tenant["gamma"] and by_tenant["gamma"].endswith(
        "meets"
    )
    assert "ω 2 " in by_tenant["beta"] and "over" not in by_tenant["beta"]
    assert (
        "0 tok/s   served/entitled 0   ω 4   waiting starved 3 ≥12.00s   misses ttft_p99"
        in by_tenant["delta"]
    )
    assert "waiting" not in by_tenant["acme"]


def test_the_jfi_shown_is_the_reports_whatever_it_is(report):
    """No second computation: change the report's figures and the text follows them."""
    report.update(jfi=0.123, jfi_seed=0.456, over_consumers=["beta"])
    lines = plain(governance_lines(report))
    assert "JFI 0.123   JFI (seed) 0.456" in lines[1]
    assert lines[2].startswith("over-consumers (ω < 1): beta ω 2")
    summary = governance_summary(report).plain
    assert "JFI 0.123 · JFI (seed) 0.456" in summary and "over-consumers (ω < 1): beta" in summary


def test_the_alert_bar_says_no_alerts_and_what_is_pending():
    assert (
        alert_text({"scr": 0.8, "alerts": {}, "alerts_pending": {"scr": "critical"}}).plain
        == "governance: no alerts   pending: SCR 0.8 (critical)"
    )
    assert alert_text({"scr": 1.0, "alerts": {}}).plain == "governance: no alerts"
    # A stored window from before the report had pending alerts or JFI (seed): shown as far as
    # known.
    old = {
        "scr": 0.5,
        "jfi": 0.82,
        "requests": 3,
        "alerts": {"jfi": "warning"},
        "tenants": {"acme": {"tok_s": 5.0, "normalised": 0.5, "compliant": True}},
    }
    assert plain(governance_lines(old))[:2] == [
        "ALERT JFI 0.82 (warning)",
        "SCR 0.5   JFI 0.82   JFI (seed) —   type fairness (min) —   3 requests in the window",
    ]
    assert governance_rows(old)[0][6:10] == (
        "—",
        "0.5",
        omega_text(old, "acme"),
        waiting_text({}),
    )


def test_alerts_panel_rows_carry_service_ratio_use_omega_and_waiting(report):
    rows = {r[0] if isinstance(r[0], str) else r[0].plain: r for r in governance_rows(report)}
    keys = [k for k, _, _ in GOVERNANCE_COLUMNS]
    col = {k: i for i, k in enumerate(keys)}
    assert all(len(r) == len(keys) for r in rows.values())
    gamma, delta = rows["gamma"], rows["delta"]
    assert (gamma[col["x"]], gamma[col["norm"]], gamma[col["omega"]].plain) == (
        "1",
        "2.5",
        "0.4 over",
    )
    assert "yellow" in str(gamma[col["omega"]].style)
    assert (delta[col["x"]], delta[col["omega"]].plain, delta[col["waiting"]].plain) == (
        "0",
        "4",
        "starved 3 ≥12.00s",
    )
    assert (
        "red" in str(delta[col["waiting"]].style) and delta[col["slo"]].plain == "misses ttft_p99"
    )
    assert rows["acme"][col["waiting"]].plain == "—"
    assert rows["type batch"][col["slo"]].plain == "8% = 0.42× its min share"


def test_governor_line_names_the_throttled_the_held_reason_and_kept_changes():
    status = {
        "active": {"jfi": 10.0},
        "dry": [],
        "replaced": [["jfi", "r0", {}]],
        "targets": {"jfi": ["gamma"], "scr": ["stale"]},
        "keep": True,
        "held": "JFI 0.7 < 0.8, but no tenant uses more than its commitment: nobody to throttle",
    }
    assert governor_notes(status) == ["jfi throttles gamma", "held: " + status["held"]]
    line = governor_line({"state": "disarmed", "paused": False, "status": status}).plain
    assert "active modes: jfi (kept after disarm" in line
    assert "· jfi throttles gamma · held: JFI 0.7 < 0.8" in line
    assert (
        governor_notes({"active": {}, "targets": {"jfi": ["gamma"]}}) == []
    )  # a mode no longer active
    assert governor_notes(None) == []


def test_replica_summary_reads_the_clusters_jfis_and_computes_none():
    groups = [
        GroupSampleRow("r", 0, "tenant", t, 10, tok, LatencyPercentiles(ttft_p99=0.5, ttlt_p99=5.0))
        for t, tok in (("a", 100.0), ("b", 300.0))
    ]
    _, summary = R.tenant_table(groups, {"ttft_p99": 1.0}, {"jfi": 0.75, "jfi_seed": 0.533})
    assert summary.plain.endswith("│ cluster: JFI 0.75 · JFI (seed) 0.533")
    _, ungoverned = R.tenant_table(groups, {"ttft_p99": 1.0})
    assert (
        ungoverned.plain.endswith("│ JFI — (not governed)") and "SCR 1.00 (2/2" in ungoverned.plain
    )
