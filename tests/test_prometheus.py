"""Prometheus and Grafana (controlplane/exporter.py, series.py, monitoring/): the recorder's
``/metrics`` against the collector's own figures, the exported alert rules judged by ``promtool``
(syntax, and unit tests that they fire exactly when the collector's alerts do, at a cluster's own
thresholds and on a real scrape), the Grafana dashboard loaded back and its every query parsed by
promtool, and the ServiceMonitors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from net_support import free_port
from prometheus_client.parser import text_string_to_metric_families
from twin_support import governed_cluster, poll_all

from controlplane.cluster import parse_cluster_file
from controlplane.governance import AlertEvaluator
from controlplane.monitoring import MonitoringExportError
from controlplane.monitoring.checks import check_dashboard, dashboard_queries
from controlplane.monitoring.grafana import grafana_dashboard_doc
from controlplane.series import SERIES

ROOT = Path(__file__).resolve().parent.parent


def promtool() -> str:
    """promtool is part of the test tools (scripts/test.sh installs it): a missing one fails."""
    found = shutil.which("promtool")
    assert found, (
        "promtool not found on PATH: scripts/test.sh installs it (Debian package prometheus)"
    )
    return found


def run_promtool(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120
    )


def scrape_families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def cluster_from(doc: dict, name: str | None = None):
    return parse_cluster_file(yaml.safe_dump(doc), "test.yaml").cluster(name)


# 0.6000001: a threshold that "%g" would round (the rule must keep it exactly)
THRESHOLDS = {"scr_warning": 0.8, "scr_critical": 0.6000001, "jfi": 0.7, "type_fairness": 0.3}
CLUSTER = {
    "clusters": [
        {
            "name": "odd",
            "replicas": [
                {"name": "r0", "api_url": "http://127.0.0.1:1", "control_url": "http://127.0.0.1:2"}
            ],
            "governance": {"tenants": {"a": {"weight": 1.0}}, "alerts": THRESHOLDS},
        }
    ]
}


@pytest.fixture
def governed(tmp_path):
    with governed_cluster(tmp_path) as found:
        yield found


# --- the recorder's page --------------------------------------------------------------------


def without_holds(path: Path) -> Path:
    """The cluster file at ``path`` with ``alerts.for_s: 0``: one govern() fires what it judges."""
    doc = yaml.safe_load(path.read_text())
    doc["clusters"][0]["governance"]["alerts"] = {"for_s": 0}
    out = path.with_name("now-" + path.name)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def governed_collector(path: Path, polls: int):
    """A collector on the cluster file at ``path`` (alerts without holds), its page's counters
    attached before its first poll (as the recorder's are), polled and governed once."""
    from controlplane.cluster import load_cluster_file
    from controlplane.collector import Collector
    from controlplane.exporter import completion_counters

    c = Collector(load_cluster_file(without_holds(path)).cluster())
    completion_counters(c)
    poll_all(c, polls)
    return c, c.govern()


def test_the_page_carries_the_collectors_own_figures(governed, monkeypatch):
    from controlplane.exporter import render

    path, twin, trace = governed
    monkeypatch.setenv("TAILPILOT_TOKEN", "gov-token")
    c, g = governed_collector(path, 5)
    fams = scrape_families(render(c).decode())
    assert set(fams) <= set(SERIES) and all(name.startswith("tailpilot_") for name in fams)

    def value(name, **labels):
        [v] = [s.value for s in fams[name] if all(s.labels.get(k) == x for k, x in labels.items())]
        return v

    assert value("tailpilot_scr_ratio", cluster="gov") == g["scr"]
    assert (
        value("tailpilot_jfi_ratio") == pytest.approx(g["jfi"]) and g["jfi"] == 1.0
    )  # everyone was served
    assert (
        value("tailpilot_jfi_seed_ratio") == pytest.approx(g["jfi_seed"]) and g["jfi_seed"] < 0.9
    )  # reported only
    assert value("tailpilot_governance_requests") == len(trace)
    assert value("tailpilot_governance_stale_replicas") == 0
    assert value("tailpilot_governance_timestamp_seconds") == g["t_ms"] / 1000
    for tenant, f in g["tenants"].items():  # exact percentiles, not a histogram's estimate
        assert (
            value(
                "tailpilot_tenant_latency_seconds", tenant=tenant, latency="ttft", percentile="p99"
            )
            == f["ttft_p99"]
        )
        assert (
            value("tailpilot_tenant_slo_seconds", tenant=tenant, latency="ttft", percentile="p50")
            == f["limits"]["ttft_p50"]
        )
        assert value("tailpilot_tenant_slo_compliant", tenant=tenant) == float(f["compliant"])
        assert value("tailpilot_tenant_omega_ratio", tenant=tenant) == f["omega"]
        assert value("tailpilot_tenant_service_ratio", tenant=tenant) == f["service_ratio"]
        assert value("tailpilot_tenant_starved", tenant=tenant) == float(f["starved"]) == 0.0
        assert value("tailpilot_tenant_waiting_requests", tenant=tenant) == f["waiting"]
        # one definition of tokens: the governance's served tokens (prompt + output) are the
        # counters'
        served = sum(
            value(f"tailpilot_{part}_tokens", tenant=tenant) for part in ("prompt", "output")
        )
        assert (
            served
            == f["served_tokens"]
            == value("tailpilot_tenant_window_served_tokens", tenant=tenant)
        )
        assert (
            value("tailpilot_requests_completed", tenant=tenant, replica=twin.name) == f["requests"]
        )
    row = c.views[twin.name].sample
    assert (
        value("tailpilot_latency_seconds", replica=twin.name, latency="ttlt", percentile="p95")
        == row.latency.ttlt_p95
    )
    assert value("tailpilot_replica_info", replica=twin.name, policy="fcfs") == 1.0
    assert value("tailpilot_settings_version", replica=twin.name) == row.settings_version
    groups = {(s.labels["kind"], s.labels["group"]) for s in fams["tailpilot_group_requests"]}
    assert groups == {
        ("tenant", "a"),
        ("tenant", "b"),
        ("tenant", "noisy"),
        ("type", "chat"),
        ("type", "batch"),
    }
    assert sum(s.value for s in fams["tailpilot_type_requests_completed"]) == len(trace)
    # the alerts as the collector has them: scr critical, nothing else (JFI is 1: nobody suppressed)
    firing = {
        (s.labels["alert"], s.labels["severity"])
        for s in fams["tailpilot_alert_firing"]
        if s.value == 1
    }
    assert firing == {(a, sev) for a, sev in g["alerts"].items()} == {("scr", "critical")}
    assert not any(s.value for s in fams["tailpilot_alert_pending"])
    for name in (
        "refused_requests",
        "preemptions",
    ):  # the replica's own counts: counters, ..._total
        [sample] = fams[f"tailpilot_{name}"]
        state_key = {"refused_requests": "refused_total", "preemptions": "preemptions_total"}[name]
        assert sample.name == f"tailpilot_{name}_total" and sample.value == getattr(
            c.views[twin.name].state, state_key
        )
    assert "tailpilot_gamma" not in fams  # fcfs has no γ: left out, never NaN
    assert "tailpilot_governor_state" not in fams  # no governor on this collector


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


@pytest.fixture
def recording(governed, tmp_path):
    """``tailpilot record --govern --metrics-port`` against the governed twin, as an operator runs
    it (a process of its own); yields (url, process, twin)."""
    path, twin, _ = governed
    port = free_port()
    env = {**os.environ, "TAILPILOT_TOKEN": "gov-token", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tailpilot.cli",
            "record",
            "--cluster",
            str(path),
            "--db",
            str(tmp_path / "rec.db"),
            "--govern",
            "--metrics-port",
            str(port),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        yield url, proc, twin
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_for_page(url: str, proc, want: str, timeout_s: float = 120.0) -> str:
    """The page once it carries ``want`` (waits on the recorder, not on a guess of its speed)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            last = scrape(url)
        except OSError:
            last = ""
        if want in last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{want!r} never on the page; last:\n{last[-2000:]}")


def test_record_serves_metrics_with_the_governor(recording):
    url, proc, _twin = recording
    text = wait_for_page(url, proc, 'tailpilot_governor_mode_dry_run{cluster="gov",mode="scr"} 1.0')
    fams = scrape_families(text)
    states = {s.labels["state"]: s.value for s in fams["tailpilot_governor_state"]}
    assert states == {"armed": 0.0, "dry-run": 1.0, "disarmed": 0.0}  # --govern without --arm
    # decided in dry-run, so logged, not applied: not "active" (the mode alert stays quiet)
    assert {s.labels["mode"]: s.value for s in fams["tailpilot_governor_mode_active"]} == {
        "scr": 0.0,
        "jfi": 0.0,
        "type": 0.0,
    }
    assert [s.value for s in fams["tailpilot_replica_up"]] == [1.0]
    # only GET /metrics and /health: nothing of the control API
    with urllib.request.urlopen(url.replace("/metrics", "/health"), timeout=5) as resp:
        assert resp.status == 200
    for path in ("/tailpilot/v1/state", "/tailpilot/v1/settings", "/settings"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url.replace("/metrics", path), timeout=5)
        assert err.value.code == 404, path
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and json.loads(out.strip().splitlines()[-1])["metrics_url"] == url


# --- alert rules, judged by promtool ----------------------------------------------------------


def render_annotation(template: str, value: float, labels: dict[str, str]) -> str:
    """The two template forms the rules use, as Go's text/template renders them."""
    out = template.replace('{{ $value | printf "%.3f" }}', f"{value:.3f}")
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], out)


def export(*args: str) -> str:
    from tailpilot.cli import main

    res = CliRunner().invoke(main, ["export", *args])
    assert res.exit_code == 0, res.output
    return res.stdout


def test_rules_pass_promtool_check(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CLUSTER))
    for fmt, extract in (
        ("prometheus-rules", lambda d: d),
        ("prometheusrule", lambda d: d["spec"]),
    ):
        text = export("--cluster", str(tmp_path / "c.yaml"), "--format", fmt, "--for", "2m")
        rules = tmp_path / f"{fmt}.yaml"
        rules.write_text(yaml.safe_dump(extract(yaml.safe_load(text))))
        res = run_promtool("check", "rules", str(rules), cwd=tmp_path)
        assert res.returncode == 0 and "SUCCESS: 10 rules found" in res.stdout, (
            res.stdout + res.stderr
        )
    # a broken rule file is refused by the same check (so the check can fail)
    (tmp_path / "bad.yaml").write_text(
        "groups:\n- name: x\n  rules:\n  - alert: X\n    expr: tailpilot_scr <\n"
    )
    assert run_promtool("check", "rules", "bad.yaml", cwd=tmp_path).returncode != 0


def alert_tests(
    rules: dict, series: dict[str, list[float]], expect: list[tuple[int, str, list[dict]]]
) -> dict:
    """A promtool unit-test document: ``series`` one value a minute; at each (minute, alert) the
    alerts expected (labels; annotations rendered from the rule's templates)."""
    by_name = {r["alert"]: r for r in rules["groups"][0]["rules"]}
    tests = []
    for minute, name, alerts in expect:
        exp = []
        for a in alerts:
            labels = {**by_name[name]["labels"], **a["labels"]}
            notes = {
                k: render_annotation(v, a["value"], labels)
                for k, v in by_name[name]["annotations"].items()
            }
            exp.append({"exp_labels": labels, "exp_annotations": notes})
        tests.append({"eval_time": f"{minute}m", "alertname": name, "exp_alerts": exp})
    return {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": s,
                        "values": " ".join("_" if v is None else repr(float(v)) for v in vals),
                    }
                    for s, vals in series.items()
                ],
                "alert_rule_test": tests,
            }
        ],
    }


HOLDS = {"for_s": 120.0, "keep_firing_for_s": 60.0}  # two evaluations to fire, one to resolve
RULE_OF = {
    ("scr", "critical"): "TailpilotSCRCritical",
    ("scr", "warning"): "TailpilotSCRWarning",
    ("jfi", "warning"): "TailpilotJFILow",
    ("type_fairness", "warning"): "TailpilotTypeFairnessLow",
}


def test_rules_fire_exactly_when_the_collectors_alerts_do(tmp_path):
    """A cluster with its own thresholds and holds; figures stepping across them (boundaries
    included) and windows without data (None: the figure is absent from the page). promtool
    evaluates the exported rules on the recorder's series minute by minute; the expected alerts
    are, rule by rule, what governance.AlertEvaluator — the collector's own alerts — says at each
    minute on the same clock (for_s and keep_firing_for_s as the rules' for and keep_firing_for)."""
    doc = {
        "clusters": [
            {
                **CLUSTER["clusters"][0],
                "governance": {
                    **CLUSTER["clusters"][0]["governance"],
                    "alerts": {**THRESHOLDS, **HOLDS},
                },
            }
        ]
    }
    cluster = cluster_from(doc)
    text = export("--cluster", _write(tmp_path, doc), "--format", "prometheus-rules")
    (tmp_path / "rules.yaml").write_text(text)
    rules = yaml.safe_load(text)
    governance = {
        r["alert"]: r for r in rules["groups"][0]["rules"] if r["alert"] in RULE_OF.values()
    }
    assert {(r.get("for"), r.get("keep_firing_for")) for r in governance.values()} == {("2m", "1m")}
    steps = {
        "scr": [1.0, 0.8, 0.79, 0.6, 0.6, None, None, 0.59, 0.0, 0.7, 0.95, 0.7, 0.95, None, 0.95],
        "jfi": [0.9, 0.7, 0.69, 0.2, 0.2, None, 0.71, 1.0, 0.5, 0.5, 0.7, None, 0.3, 0.3, 0.3],
        "type_fairness_min": [
            1.0,
            0.3,
            0.29,
            0.0,
            0.0,
            2.0,
            None,
            0.31,
            0.3,
            0.1,
            0.1,
            0.2,
            None,
            0.2,
            1.0,
        ],
    }
    figure = {"scr": "scr", "jfi": "jfi", "type_fairness": "type_fairness_min"}
    evaluator = AlertEvaluator(cluster.governance.alerts)
    minutes = len(steps["scr"])
    series: dict[str, list] = {
        f'tailpilot_{k}{{cluster="odd"}}': v
        for k, v in (
            ("scr_ratio", steps["scr"]),
            ("jfi_ratio", steps["jfi"]),
            ("type_fairness_min_ratio", steps["type_fairness_min"]),
        )
    }
    series['tailpilot_window_seconds{cluster="odd"}'] = [60.0] * minutes
    values = {
        a: series.setdefault(f'tailpilot_alert_value{{alert="{a}",cluster="odd"}}', [])
        for a in figure
    }
    expect, fired, gap_fired, held, kept = [], set(), False, False, False
    last: dict[
        str, float
    ] = {}  # per figure, the last one with data: what the page holds through a gap
    below_at: dict[
        tuple[str, str], float
    ] = {}  # per rule, its figure when last below: the alert's $value
    for minute in range(minutes):
        figures = {k: v[minute] for k, v in steps.items()}
        last.update({k: v for k, v in figures.items() if v is not None})
        # Judged on the held figures: Prometheus's for/keep_firing_for run on through a window
        # without data (the collector's evaluator pauses them there: docs/metrics.md)
        evaluator.evaluate({k: last.get(k) for k in figures}, minute * 60.0)
        for a in figure:  # what the page carries: the figure each alert was last judged on
            values[a].append(evaluator.value.get(a))
        for (alert, severity), rule in RULE_OF.items():
            state = evaluator.rules.get((alert, severity))
            on = state is not None and state.firing
            below = alert in evaluator.value and evaluator.value[
                alert
            ] < cluster.governance.alerts.threshold(alert, severity)
            if below:
                below_at[(alert, severity)] = evaluator.value[alert]
            held |= below and not on  # below, not yet for for_s: pending
            kept |= on and not below  # back above, still within keep_firing_for_s
            if on:
                fired.add((alert, severity))
                gap_fired |= figures[figure[alert]] is None
            expect.append(
                (minute, rule, [{"labels": {}, "value": below_at[(alert, severity)]}] if on else [])
            )
    assert (
        fired == set(RULE_OF) and gap_fired and held and kept
    )  # every rule fires; holds both ways; gaps
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump(alert_tests(rules, series, expect), sort_keys=False)
    )
    res = run_promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    # the same test against rules at the default thresholds and holds fails: both are the cluster's
    for other in (
        {"tenants": {"a": {"weight": 1.0}}, "alerts": HOLDS},
        {"tenants": {"a": {"weight": 1.0}}, "alerts": THRESHOLDS},
    ):
        doc_other = {"clusters": [{**CLUSTER["clusters"][0], "governance": other}]}
        (tmp_path / "rules.yaml").write_text(
            export("--cluster", _write(tmp_path, doc_other), "--format", "prometheus-rules")
        )
        assert run_promtool("test", "rules", "tests.yaml", cwd=tmp_path).returncode != 0


def _write(tmp_path: Path, doc: dict) -> str:
    path = tmp_path / f"cluster-{abs(hash(json.dumps(doc, sort_keys=True)))}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_rules_on_a_real_scrape_fire_the_recorders_alerts(governed, monkeypatch, tmp_path):
    """The page of a real collector as promtool's input: the rules that fire are the collector's."""
    from controlplane.exporter import render

    path, _twin, _ = governed
    monkeypatch.setenv("TAILPILOT_TOKEN", "gov-token")
    c, g = governed_collector(path, 3)
    text = export("--cluster", str(without_holds(path)), "--format", "prometheus-rules")
    (tmp_path / "rules.yaml").write_text(text)
    rules = yaml.safe_load(text)
    series = {}
    for fam in text_string_to_metric_families(render(c).decode()):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            series[f"{s.name}{{{labels}}}"] = [s.value] * 5
    values = {"scr": g["scr"], "jfi": g["jfi"], "type_fairness": g["type_fairness_min"]}
    assert g["alerts"] == {"scr": "critical"}
    alerts = (
        c.cluster.governance.alerts
    )  # no hold: a rule fires when its figure is below its threshold
    firing = {(a, sev) for a, sev in RULE_OF if values[a] < alerts.threshold(a, sev)}
    assert firing == {("scr", "critical"), ("scr", "warning")}  # rule by rule: SCR 0 is below both
    expect = [
        (2, rule, [{"labels": {}, "value": values[a]}] if (a, sev) in firing else [])
        for (a, sev), rule in RULE_OF.items()
    ]
    expect.append(
        (
            2,
            "TailpilotTenantMissesSLO",
            [
                {"labels": {"tenant": t}, "value": 0.0}
                for t, f in sorted(g["tenants"].items())
                if not f["compliant"]
            ],
        )
    )
    expect += [
        (2, "TailpilotReplicaDown", []),
        (2, "TailpilotRecorderAbsent", []),
        (2, "TailpilotBreakerTripped", []),
        (2, "TailpilotRequestsRefused", []),
    ]
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump(alert_tests(rules, series, expect), sort_keys=False)
    )
    res = run_promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_bad_export_input_names_the_option(tmp_path):
    from tailpilot.cli import main

    path = _write(tmp_path, CLUSTER)
    for args, needle in (
        (["--format", "grafana"], "needs --cluster"),
        (["--format", "grafana", "--cluster", path, "--settings", path], "not --settings"),
        (["--format", "prometheus-rules", "--cluster", path, "--for", "5 minutes"], "--for"),
        (["--format", "servicemonitor", "--cluster", path, "--interval", "0s"], "--interval"),
        (["--format", "prometheus-rules", "--cluster", path, "--for", "1s1m"], "--for"),
        (["--format", "servicemonitor", "--cluster", path, "--label", "release"], "--label"),
        (["--format", "servicemonitor", "--cluster", path, "--label", "a=b c"], "--label"),
        (["--format", "helm", "--cluster", path], "--cluster goes with"),
    ):
        res = CliRunner().invoke(main, ["export", *args])
        assert res.exit_code == 2 and needle in res.output, res.output


# --- Grafana ---------------------------------------------------------------------------------


def test_the_dashboard_loads_back_and_every_query_parses(tmp_path):
    cluster = cluster_from(CLUSTER)
    out = tmp_path / "dash.json"
    export("--cluster", _write(tmp_path, CLUSTER), "--format", "grafana", "--out", str(out))
    doc = json.loads(out.read_text())
    check_dashboard(doc, cluster)
    titles = {p["title"] for p in doc["panels"]}
    assert {
        "SCR",
        "JFI",
        "Type fairness (lowest)",
        "SCR over time",
        "JFI over time",
        "Type fairness ratio per type",
    } <= titles  # seed 003's checklist
    scr = next(p for p in doc["panels"] if p["title"] == "SCR")["fieldConfig"]["defaults"][
        "thresholds"
    ]["steps"]
    assert [(s["color"], s["value"]) for s in scr] == [
        ("red", None),
        ("yellow", 0.6000001),
        ("green", 0.8),
    ]
    # the template variables, and every query filtering on them (walked here, apart from
    # check_dashboard)
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert (
        variables["cluster"]["current"]["value"] == "odd"
        and variables["cluster"]["type"] == "query"
    )
    assert variables["replica"]["includeAll"] and variables["replica"]["allValue"] == ".*"
    assert "$cluster" in variables["replica"]["definition"]  # the replicas of the cluster picked
    targets = [t for p in doc["panels"] for t in p.get("targets", [])]
    queries = [t["expr"] for t in targets]
    assert queries == dashboard_queries(doc) and len(queries) >= 30
    per_replica = 0
    for q in queries:
        found = re.findall(r"\b(tailpilot_\w+)\{([^}]*)\}", q)
        assert found and len(found) == len(re.findall(r"\btailpilot_\w+", q)), (
            q
        )  # every series selected
        for name, matchers in found:
            assert 'cluster="$cluster"' in matchers, q
            family = SERIES[name[: -len("_total")] if name.endswith("_total") else name]
            if "replica" in family.labels:
                per_replica += 1
                assert 'replica=~"$replica"' in matchers, q
            if family.counter:
                assert re.search(rf"\brate\({name}\{{", q), q  # counters only through rate()
    assert per_replica >= 12 and "odd" not in json.dumps(targets)  # no cluster hard-coded
    # promtool parses every query (as recording rules, the variables as Grafana fills them in) —
    # a typo in PromQL fails here
    filled = [
        q.replace("$cluster", "odd").replace("$replica", ".*").replace("$__rate_interval", "1m")
        for q in queries
    ]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"tailpilot:query_{i}", "expr": q} for i, q in enumerate(filled)
                ],
            }
        ]
    }
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump(rules))
    res = run_promtool("check", "rules", "queries.yaml", cwd=tmp_path)
    assert res.returncode == 0 and f"SUCCESS: {len(queries)} rules found" in res.stdout, (
        res.stdout + res.stderr
    )
    rules["groups"][0]["rules"].append(
        {"record": "tailpilot:broken", "expr": 'sum(tailpilot_scr_ratio{cluster="odd"}'}
    )
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump(rules))
    assert run_promtool("check", "rules", "queries.yaml", cwd=tmp_path).returncode != 0


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda d: d["panels"][1]["targets"][0].update(expr="tailpilot_scrr"), "does not serve"),
        (lambda d: d["panels"][2].update(gridPos=dict(d["panels"][1]["gridPos"])), "overlaps"),
        (
            lambda d: d["panels"][1]["fieldConfig"]["defaults"]["thresholds"]["steps"][1].update(
                value=0.9
            ),
            "thresholds",
        ),
        (lambda d: d["panels"][3].update(id=2), "duplicate panel ids"),
        (lambda d: d["panels"][1].update(targets=[]), "no query"),
        (lambda d: d["templating"]["list"].pop(2), r"no \$replica"),
        (lambda d: d["templating"]["list"][1]["current"].update(value="prod"), "does not default"),
        (
            lambda d: d["panels"][1]["targets"][0].update(
                expr='tailpilot_scr_ratio{cluster="odd"}'
            ),
            "not filtered",
        ),
        (
            lambda d: d["panels"][-1]["targets"][0].update(
                expr='tailpilot_replica_info{cluster="$cluster"}'
            ),
            "not filtered",
        ),
        (
            lambda d: d["panels"][1]["targets"][0].update(
                expr='tailpilot_preemptions_total{cluster="$cluster"}'
            ),
            "counter",
        ),
    ],
)
def test_a_damaged_dashboard_is_refused(damage, needle):
    cluster = cluster_from(CLUSTER)
    doc = grafana_dashboard_doc(cluster)
    damage(doc)
    with pytest.raises(MonitoringExportError, match=needle):
        check_dashboard(doc, cluster)


def test_an_ungoverned_cluster_gets_replica_panels_and_rules_only(tmp_path):
    plain = {"clusters": [{**CLUSTER["clusters"][0]}]}
    del plain["clusters"][0]["governance"]
    doc = json.loads(export("--cluster", _write(tmp_path, plain), "--format", "grafana"))
    assert not any("tailpilot_scr" in q for q in dashboard_queries(doc)) and doc["panels"]
    rules = yaml.safe_load(
        export("--cluster", _write(tmp_path, plain), "--format", "prometheus-rules")
    )
    assert [r["alert"] for r in rules["groups"][0]["rules"]] == [
        "TailpilotReplicaDown",
        "TailpilotBreakerTripped",
        "TailpilotRequestsRefused",
        "TailpilotRecorderAbsent",
    ]


# --- ServiceMonitors -------------------------------------------------------------------------


def test_the_recorders_service_monitor(tmp_path):
    doc = yaml.safe_load(
        export(
            "--cluster",
            _write(tmp_path, CLUSTER),
            "--format",
            "servicemonitor",
            "--namespace",
            "obs",
            "--interval",
            "30s",
            "--label",
            "release=prom",
        )
    )
    assert (doc["apiVersion"], doc["kind"], doc["metadata"]["namespace"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        "obs",
    )
    assert doc["metadata"]["labels"]["release"] == "prom"  # what kube-prometheus-stack selects on
    assert doc["spec"]["selector"]["matchLabels"]["tailpilot/cluster"] == "odd"
    [endpoint] = doc["spec"]["endpoints"]
    assert endpoint == {
        "port": "metrics",
        "path": "/metrics",
        "interval": "30s",
        "scrapeTimeout": "10s",
    }
    [endpoint] = yaml.safe_load(
        export(
            "--cluster", _write(tmp_path, CLUSTER), "--format", "servicemonitor", "--interval", "5s"
        )
    )["spec"]["endpoints"]
    assert endpoint["scrapeTimeout"] == "5s"  # never above the interval (Prometheus refuses that)


@pytest.mark.parametrize("name", ["Prod_EU.west-1-", "1e3", "a" * 64])
def test_names_kubernetes_and_grafana_accept_for_any_cluster_name(tmp_path, name):
    """A cluster name the cluster file accepts (letters of both cases, '_', '.', a trailing '-',
    64 characters, a number) becomes valid Kubernetes names and label values and a Grafana uid,
    with a hash where it had to change; a value YAML could read as a number is quoted."""
    from controlplane.monitoring.checks import DNS_NAME, GRAFANA_UID, LABEL_VALUE

    doc = {"clusters": [{**CLUSTER["clusters"][0], "name": name}]}
    path = _write(tmp_path, doc)
    sm_text = export("--cluster", path, "--format", "servicemonitor")
    for text in (sm_text, export("--cluster", path, "--format", "prometheusrule")):
        meta = yaml.safe_load(text)["metadata"]
        assert DNS_NAME.match(meta["name"]) and LABEL_VALUE.match(
            str(meta["labels"]["tailpilot/cluster"])
        )
        assert isinstance(meta["labels"]["tailpilot/cluster"], str)
    if name == "1e3":
        assert (
            'tailpilot/cluster: "1e3"' in sm_text
        )  # quoted: Kubernetes' reader would take 1e3 for a number
    uid = json.loads(export("--cluster", path, "--format", "grafana"))["uid"]
    assert GRAFANA_UID.match(uid)
    other = {"clusters": [{**CLUSTER["clusters"][0], "name": name[:-1] + "x"}]}
    assert (
        json.loads(export("--cluster", _write(tmp_path, other), "--format", "grafana"))["uid"]
        != uid
    )


def test_the_helm_values_enable_the_charts_service_monitor(tmp_path):
    import jsonschema

    settings = tmp_path / "s.json"
    settings.write_text(json.dumps({"policy": "slofq"}))
    values = yaml.safe_load(
        export(
            "--settings",
            str(settings),
            "--format",
            "helm",
            "--service-monitor",
            "--interval",
            "20s",
        )
    )
    monitor = values["servingEngineSpec"]["serviceMonitor"]
    # the chart's own keys (vllm-stack helm/values.schema.json, servingEngineSpec.serviceMonitor)
    jsonschema.validate(monitor, CHART_SERVICE_MONITOR_SCHEMA)
    assert (monitor["enabled"], monitor["interval"], monitor["scrapeTimeout"]) == (
        True,
        "20s",
        "10s",
    )
    # off by default: the chart would create it unconditionally, and a cluster without the
    # Prometheus Operator's CRDs refuses the whole install
    values = yaml.safe_load(export("--settings", str(settings), "--format", "helm"))
    assert "serviceMonitor" not in values["servingEngineSpec"]


CHART_SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "enabled": {"type": "boolean"},
        "additionalLabels": {"type": "object"},
        "interval": {"type": "string"},
        "scrapeTimeout": {"type": "string"},
        "honorLabels": {"type": "boolean"},
        "metricRelabelings": {"type": "array"},
        "relabelings": {"type": "array"},
    },
}


def test_a_taken_metrics_port_fails_the_start_and_begins_nothing(governed, tmp_path, monkeypatch):
    from tailpilot.cli import main

    path, _twin, _ = governed
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        res = CliRunner().invoke(
            main,
            [
                "record",
                "--cluster",
                str(path),
                "--db",
                str(tmp_path / "t.db"),
                "--recording",
                "r1",
                "--metrics-port",
                str(port),
            ],
        )
    assert res.exit_code == 1 and f"cannot serve /metrics on 127.0.0.1:{port}" in res.output, (
        res.output
    )
    from storage.store import Store

    with Store.open(str(tmp_path / "t.db")) as store:
        assert store.recordings.all("gov") == []  # no recording left open


def test_tenants_from_clients_do_not_grow_the_page_without_bound(governed, monkeypatch):
    """Per-tenant series for at most MAX_TENANTS tenants (the cluster file's first, then the
    busiest); the rest counted; a tenant name the text format cannot carry as is still renders."""
    from controlplane.cluster import load_cluster_file
    from controlplane.collector import Collector
    from controlplane.exporter import render
    from scheduler.names import MAX_GROUPS_PER_WINDOW as MAX_TENANTS
    from storage.rows import GroupSampleRow

    path, twin, _ = governed
    monkeypatch.setenv("TAILPILOT_TOKEN", "gov-token")
    c = Collector(load_cluster_file(path).cluster())
    poll_all(c, 2)
    c.govern()
    view = c.views[twin.name]
    view.groups = view.groups + [
        GroupSampleRow(
            replica=twin.name, t_ms=0, kind="tenant", group=f"client-{i}", completed=1000 + i
        )
        for i in range(300)
    ]
    view.groups.append(
        GroupSampleRow(
            replica=twin.name, t_ms=0, kind="tenant", group='odd\ud800"name\n', completed=10**6
        )
    )
    fams = scrape_families(render(c).decode())
    tenants = {
        s.labels["group"] for s in fams["tailpilot_group_requests"] if s.labels["kind"] == "tenant"
    }
    assert (
        len(tenants) == MAX_TENANTS and {"a", "b", "noisy"} <= tenants
    )  # the cluster file's tenants first
    assert "client-299" in tenants and "client-0" not in tenants  # then the busiest
    assert 'odd?"name\n' in tenants  # an unencodable name, replaced, not a broken page
    [omitted] = fams["tailpilot_tenants_omitted"]
    assert omitted.value == 3 + 301 - MAX_TENANTS


def test_the_page_is_served_on_the_loop_and_stops(governed, monkeypatch):
    """MetricsServer on a picked port: answers, then frees the port when stopped."""
    from controlplane.cluster import load_cluster_file
    from controlplane.collector import Collector
    from controlplane.exporter import MetricsServer

    path, _twin, _ = governed
    c = Collector(load_cluster_file(path).cluster())

    async def run() -> tuple[str, int]:
        server = MetricsServer(c, port=0)
        port = await server.start()
        try:
            text = await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics")
        finally:
            await server.stop()
        return text, port

    text, port = asyncio.run(run())
    assert (
        'tailpilot_replica_up{cluster="gov",replica="twin-0"} 0.0' in text
    )  # not polled yet: down
    with pytest.raises(OSError):
        scrape(f"http://127.0.0.1:{port}/metrics")


def test_the_readmes_monitoring_examples_run_on_its_cluster_file(tmp_path, monkeypatch):
    """The README's cluster file (its yaml block) and its `tailpilot export --cluster` lines, as
    written."""
    import shlex

    from test_newcomer import readme_commands

    from tailpilot.cli import main

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    [cluster_yaml] = [
        b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S) if "governance:" in b
    ]
    (tmp_path / "clusters.yaml").write_text(cluster_yaml)
    monkeypatch.chdir(tmp_path)
    lines = [line for line in readme_commands(("tailpilot export --cluster",))]
    assert len(lines) >= 3
    for line in lines:
        res = CliRunner().invoke(main, shlex.split(line)[1:])
        assert res.exit_code == 0, f"{line}\n{res.output}"
    rules = yaml.safe_load((tmp_path / "tailpilot-rules.yaml").read_text())
    assert {"TailpilotSCRCritical", "TailpilotJFILow"} <= {
        r["alert"] for r in rules["groups"][0]["rules"]
    }
    check_dashboard(
        json.loads((tmp_path / "tailpilot-dashboard.json").read_text()),
        parse_cluster_file(cluster_yaml, "clusters.yaml").cluster(),
    )
