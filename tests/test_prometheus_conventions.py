"""The recorder's page by Prometheus's conventions (controlplane/exporter.py): ``promtool check
metrics`` finds nothing on a real page (and does find the previous version's mistakes, so the
check can fail); counts are counters that count each completion once; a replica that is down
shows no figure of its last answer; the renames are documented (docs/metrics.md)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from test_prometheus import governed_collector, run_promtool, scrape_families
from twin_support import governed_cluster, poll_all

from controlplane.exporter import CompletionCounters, render
from controlplane.series import RENAMED, SERIES

ROOT = Path(__file__).resolve().parent.parent
DEAD = "http://127.0.0.1:1"  # nothing listens on port 1: every poll of it fails at once


@pytest.fixture
def governed(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILPILOT_TOKEN", "gov-token")
    with governed_cluster(tmp_path) as found:
        yield found


def check_metrics(page: str, tmp_path: Path) -> str:
    """promtool's findings on ``page`` ('' when none); asserts its exit status agrees."""
    res = run_promtool("check", "metrics", cwd=tmp_path, stdin=page)
    findings = (res.stdout + res.stderr).strip()
    assert (res.returncode == 0) == (findings == ""), findings
    return findings


def kill(collector, replica: str) -> None:
    """Point the collector at a dead address for ``replica``: its next polls fail for real."""
    view = collector.views[replica]
    view.spec = view.spec.model_copy(update={"api_url": DEAD, "control_url": DEAD})


def test_a_real_page_passes_promtool_check_metrics_with_no_findings(governed, tmp_path):
    path, _twin, _ = governed
    c, _ = governed_collector(path, 3)
    c.governor_status = {"state": "dry-run", "paused": False, "active": {"scr": {}}, "dry": ["scr"]}
    page = render(c).decode()
    assert check_metrics(page, tmp_path) == ""
    fams = scrape_families(page)
    # nearly every family is on it (so the check covers them): fcfs has no γ/β, nobody waits
    assert set(SERIES) - set(fams) == {
        "tailpilot_gamma",
        "tailpilot_beta",
        "tailpilot_tenant_waited_seconds",
    }
    # the previous version's page: quantile labels on gauges, a counter without _total
    old = (
        "# HELP tailpilot_latency_seconds x\n# TYPE tailpilot_latency_seconds gauge\n"
        'tailpilot_latency_seconds{latency="ttft",quantile="0.99"} 1.0\n'
        "# HELP tailpilot_preemptions x\n# TYPE tailpilot_preemptions counter\n"
        "tailpilot_preemptions 1.0\n"
    )
    findings = check_metrics(old, tmp_path)
    assert (
        'non-summary metrics should not have "quantile" label' in findings and "_total" in findings
    )


def test_a_down_replica_shows_none_of_its_last_answer(governed, tmp_path):
    """One replica, polled, then down: only up=0 and the recorder's own counts of it remain, and
    no governance figure (none is current) — the collector's alert states stay."""
    path, twin, trace = governed
    c, _ = governed_collector(path, 2)
    before = scrape_families(render(c).decode())
    kill(c, twin.name)
    poll_all(c, 1)
    c.govern()
    page = render(c).decode()
    assert check_metrics(page, tmp_path) == ""
    fams = scrape_families(page)
    assert [s.value for s in fams["tailpilot_replica_up"]] == [0.0]
    for gone in (
        "tailpilot_latency_seconds",
        "tailpilot_waiting_requests",
        "tailpilot_kv_usage_ratio",
        "tailpilot_preemptions",
        "tailpilot_refused_requests",
        "tailpilot_breaker_trips",
        "tailpilot_replica_info",
        "tailpilot_group_requests",
        "tailpilot_scr_ratio",
        "tailpilot_jfi_ratio",
        "tailpilot_tenant_latency_seconds",
        "tailpilot_alert_value",
        "tailpilot_governance_requests",
    ):
        assert gone in before and gone not in fams, gone
    for kept in (
        "tailpilot_requests_completed",
        "tailpilot_output_tokens",
        "tailpilot_ingest_rejected",
    ):
        assert [s.value for s in fams[kept]] == [s.value for s in before[kept]], (
            kept
        )  # counts, unchanged
    assert sum(s.value for s in fams["tailpilot_requests_completed"]) == len(
        trace
    )  # each counted once
    assert {s.labels["alert"] for s in fams["tailpilot_alert_firing"] if s.value} == {
        "scr"
    }  # the collector's


def test_a_down_replica_among_others_is_counted_stale(governed, tmp_path):
    """Two replicas (both read the same twin); one goes down: the governance figures stay (one
    is up) and say how many down replicas' windows they still hold."""
    path, twin, _ = governed
    doc = yaml.safe_load(path.read_text())
    doc["clusters"][0]["replicas"].append(
        {**doc["clusters"][0]["replicas"][0], "name": "twin-copy"}
    )
    two = path.with_name("two.yaml")
    two.write_text(yaml.safe_dump(doc))
    c, _ = governed_collector(two, 1)
    assert scrape_families(render(c).decode())["tailpilot_governance_stale_replicas"][0].value == 0
    kill(c, "twin-copy")
    poll_all(c, 1)
    c.govern()
    fams = scrape_families(render(c).decode())
    assert {s.labels["replica"]: s.value for s in fams["tailpilot_replica_up"]} == {
        twin.name: 1.0,
        "twin-copy": 0.0,
    }
    assert (
        fams["tailpilot_governance_stale_replicas"][0].value == 1 and "tailpilot_scr_ratio" in fams
    )
    assert {s.labels["replica"] for s in fams["tailpilot_latency_seconds"]} == {twin.name}


def test_counters_keep_their_label_sets_and_count_once():
    """Names past the bound go to "other" for good (the cluster file's always apart); a refusal
    is not a completion; each poll's completions are added once."""
    listeners = []
    spec = SimpleNamespace(tenants={"vip": {}}, type_shares={})
    collector = SimpleNamespace(cluster=SimpleNamespace(governance=spec), on_poll=listeners.append)
    counters = CompletionCounters(collector, max_names=2)
    assert listeners == [counters.observe]

    def row(tenant, reason="finished"):
        return SimpleNamespace(
            tenant=tenant, type="chat", prompt_tokens=10, output_tokens=5, reason=reason
        )

    counters.observe(
        "r",
        SimpleNamespace(cursor=5, completions=[row("a"), row("b"), row("c"), row("vip"), row("a")]),
    )
    counters.observe(
        "r", SimpleNamespace(cursor=8, completions=[row("c"), row("a", "rejected"), row("d")])
    )
    assert counters.tenants == {
        ("r", "a"): [2, 20, 10],
        ("r", "b"): [1, 10, 5],
        ("r", "other"): [3, 30, 15],
        ("r", "vip"): [1, 10, 5],
    }
    assert counters.types == {("r", "chat"): 7}
    counters.observe(
        "r", SimpleNamespace(cursor=None, completions=[])
    )  # its /state not read: a failed poll
    assert counters.state_read == {"r": False} and counters.types == {("r", "chat"): 7}


def test_the_docs_list_every_series_and_every_rename():
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`(tailpilot_[a-z0-9_]+)`", text))
    assert {s.sample for s in SERIES.values()} <= documented
    for old, new in RENAMED.items():
        assert re.search(rf"^\| `{old}` \| .*`{new or ''}", text, flags=re.M), old
    assert not set(RENAMED) & {
        s.sample for s in SERIES.values()
    }  # an old name is never served again
