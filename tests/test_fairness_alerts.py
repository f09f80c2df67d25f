"""Alerts with Prometheus-like hysteresis (a condition holds ``for_s`` before firing and is gone
``keep_firing_for_s`` before resolving) and the collector counting a starved tenant: it has
requests waiting on the replicas (``/state``'s ``waiting_by_tenant``) and no completion."""

from __future__ import annotations

import pytest

from controlplane.governance import AlertEvaluator, AlertThresholds, GovernanceSpec
from scheduler import contract


def test_an_alert_holds_for_s_before_firing_and_keeps_firing_before_resolving():
    ev = AlertEvaluator(AlertThresholds(for_s=30.0, keep_firing_for_s=60.0))
    assert ev.evaluate({"jfi": 0.7}, 0.0) == [] and ev.pending() == {"jfi": "warning"}
    assert ev.evaluate({"jfi": 0.95}, 10.0) == [] and ev.pending() == {}  # a dip: never fired
    assert ev.evaluate({"jfi": 0.7}, 20.0) == []
    [fire] = ev.evaluate({"jfi": 0.7}, 50.0)
    assert (fire["name"], fire["state"]) == ("jfi", "firing")
    # back above for 2 s, below again, above again: no flapping (the issue saw firing →
    # resolved → firing within 2 s)
    assert ev.evaluate({"jfi": 0.95}, 51.0) == [] and ev.evaluate({"jfi": 0.7}, 52.0) == []
    assert ev.evaluate({"jfi": 0.95}, 53.0) == [] and ev.evaluate({"jfi": None}, 100.0) == []
    assert ev.evaluate({"jfi": 0.95}, 112.0) == []
    [gone] = ev.evaluate({"jfi": 0.95}, 113.0)
    assert (gone["name"], gone["state"]) == ("jfi", "resolved") and ev.active == {}


def test_scr_escalates_and_steps_down_through_the_same_holds():
    ev = AlertEvaluator(AlertThresholds(for_s=30.0, keep_firing_for_s=60.0))
    ev.evaluate({"scr": 0.5}, 0.0)
    [fire] = ev.evaluate({"scr": 0.5}, 30.0)
    assert (fire["severity"], fire["state"]) == ("critical", "firing")
    assert ev.evaluate({"scr": 0.93}, 40.0) == []  # warning-level now: critical kept for 60 s
    [down] = ev.evaluate({"scr": 0.93}, 100.0)
    assert (down["severity"], down["state"]) == ("warning", "firing")


def test_the_defaults_are_in_the_cluster_files_alert_settings():
    t = GovernanceSpec.model_validate({"alerts": {"for_s": 120, "keep_firing_for_s": 300}}).alerts
    assert (t.for_s, t.keep_firing_for_s) == (120.0, 300.0)
    d = AlertThresholds()
    assert (d.for_s, d.keep_firing_for_s) == (30.0, 60.0)


def test_the_collector_counts_a_starved_tenant():
    """Two tenants served, one whose requests all wait on the replica: it counts in SCR and JFI
    once its wait so far (seen over the collector's polls) passes its P99 target."""
    from controlplane.cluster import ClusterSpec, ReplicaSpec
    from controlplane.collector import Collector
    from storage.rows import CompletionRow

    gov = GovernanceSpec.model_validate(
        {
            "tenants": {t: {"weight": 1.0, "ttft": {"p99": 2.0}} for t in "abc"},
            "alerts": {"for_s": 0.0},
        }
    )
    spec = ClusterSpec(
        name="c",
        governance=gov,
        window_s=60.0,
        replicas=[
            ReplicaSpec(name="r", api_url="http://127.0.0.1:9", control_url="http://127.0.0.1:9")
        ],
    )
    now = [100.0]
    col = Collector(spec, clock=lambda: now[0])
    view = col.views["r"]
    view.health.healthy = True
    view.window.add(
        [
            CompletionRow("r", f"{t}{i}", t, "chat", 90.0 + i, 90.2 + i, 91.0 + i, 100, 100, 0)
            for t in "ab"
            for i in range(5)
        ]
    )
    view.state = contract.State(
        completions=[], next_cursor=0, waiting_by_tenant={"c": 3}, waiting_by_type={"chat": 3}
    )
    first = col.govern()
    assert first["scr"] == 1.0 and first["tenants"]["c"]["waiting"] == 3  # counted; not late yet
    now[0] += 30.0
    later = col.govern()
    assert (
        later["tenants"]["c"]["waited_s"] == pytest.approx(30.0)
        and later["tenants"]["c"]["starved"]
    )
    assert later["scr"] == pytest.approx(2 / 3) and later["jfi"] == pytest.approx(2 / 3)
    assert later["alerts"] == {"scr": "critical", "jfi": "warning"}
    # one admitted: the oldest may be newer now
    view.state = contract.State(completions=[], next_cursor=0, waiting_by_tenant={"c": 2})
    assert col.govern()["tenants"]["c"]["waited_s"] == 0.0
