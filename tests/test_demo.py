"""``tailpilot demo`` shows what tailpilot is for: the autopilot (armed on one replica, dry-run on
the others) and the governor (dry-run) over the tenants' SLOs run beside its collector, and
``--no-tui`` prints their report under the status table.

* the split: on twins whose clock the test drives, the demo's autopilot driver applies a switch on
  the armed replica (through the control API, audited) and only logs it on the dry-run one, whose
  settings never change;
* the command: ``tailpilot demo --no-tui`` in a subprocess, stopped (SIGTERM) once its database
  shows the autopilot's decisions on real data: the output carries them, the tenants' SCR and JFI
  and the governor's state; the cluster file it wrote declares the tenants' SLOs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from autopilot_support import CONFIG, DEFAULTS, run_live

from controlplane.cluster import load_cluster_file, parse_cluster_file
from storage.store import Store

TOKEN = "demo-token"


# ------------------------------------------------------------------------------ the split
# The replicas run uniboost's defaults (γ-Ada), which are not a candidate here: every decision on
# data picks settings they do not run, so the armed replica is sent it and the other only logs it.
SWITCHING = {**CONFIG, "with_defaults": False}


def autopilot_rows(store, replica: str) -> list[dict]:
    return [
        c
        for c in store.settings_log.settings_changes("twins")
        if c["who"] == "autopilot" and c["replica"] == replica
    ]


def test_the_demo_driver_applies_on_the_armed_replica_and_only_logs_on_the_others(
    tmp_path, monkeypatch
):
    from sim.traces import load_bundled
    from tuner.autopilot.controller import AutopilotConfig
    from tuner.autopilot.live import LiveConfig
    from tuner.twins.cluster import start_twins
    from tuner.twins.replica import ManualClock

    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    clock = ManualClock()
    store = Store.open(str(tmp_path / "d.db"), clock=clock.now)
    twins = start_twins(
        2, load_bundled(), rate_scale=3.0, clock=clock, settings=DEFAULTS, token=TOKEN
    )
    cluster = parse_cluster_file(yaml.safe_dump(twins.cluster_doc("twins"))).cluster()
    armed, dry = twins[0], twins[1]
    dry_version = dry.core.settings_doc()["version"]
    store.governance.set_control("autopilot", "twins", state="armed", who="test")

    def both_decided(driver) -> bool:
        notes = {n: r.get("note", "") for n, r in driver.status()["replicas"].items()}
        return any(r["result"] == "applied" for r in autopilot_rows(store, armed.name)) and (
            notes.get(dry.name, "").startswith("dry-run: would run")
        )

    try:
        driver = run_live(
            clock,
            twins,
            cluster,
            store,
            AutopilotConfig.model_validate(SWITCHING),
            LiveConfig(verify_minutes=60.0, armed_replicas=(armed.name,)),
            both_decided,
        )
        assert both_decided(driver), driver.status()
        # The armed replica runs the choice, sent through the control API and audited...
        rp = driver.pilots[armed.name]
        choice = rp.pilot.options[rp.pilot.current]
        running = armed.core.settings
        assert (running.policy, running.params) == (choice.policy, choice.params)
        assert {r["result"] for r in autopilot_rows(store, armed.name)} <= {"applied", "staged"}
        # ... the other still runs what it ran: its decisions reach the audit log as dry-run only.
        assert dry.core.settings_doc()["version"] == dry_version
        assert (dry.core.settings.policy, dry.core.settings.params) == (
            DEFAULTS.policy,
            DEFAULTS.params,
        )
        assert {r["result"] for r in autopilot_rows(store, dry.name)} <= {"dry-run"}
        status = store.governance.control("autopilot", "twins")["status"]
        assert status["armed_replicas"] == [armed.name] and "a decision every" in status["cadence"]
    finally:
        twins.stop()
        store.close()


# ------------------------------------------------------------------------------ the command
def tailpilot_command() -> list[str]:
    exe = shutil.which("tailpilot") or os.path.join(os.path.dirname(sys.executable), "tailpilot")
    assert os.path.exists(exe), "the tailpilot command is not installed (pip install -e .)"
    return [exe]


def decisions_on_data(db: str) -> bool:
    """The demo's database shows a decision on real figures for every steered replica (one that
    is not "waiting for data"), and a governor's report."""
    if not os.path.exists(db):
        return False
    try:
        with Store.open(db) as store:
            pilot = store.governance.control("autopilot", "demo")
            governor = store.governance.control("governor", "demo")
    except Exception:  # the demo is still creating its tables
        return False
    replicas = (pilot.get("status") or {}).get("replicas") or {}
    steered = [r for r in replicas.values() if "choice" in r]
    return (
        len(steered) == 2
        and all(
            any(not d["reason"].startswith("waiting for data") for d in r["last"]) for r in steered
        )
        and bool((governor.get("status") or {}).get("t_ms"))
    )


@pytest.mark.slow
def test_demo_no_tui_prints_the_autopilots_decisions_and_the_tenants_figures(tmp_path):
    cmd = [
        *tailpilot_command(),
        "demo",
        "--no-tui",
        "--replicas",
        "2",
        "--speed",
        "2",
        "--duration",
        "900",  # stopped with SIGTERM once the database shows what the output must carry
        "--db",
        "demo.db",
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        end = time.monotonic() + 240
        while not decisions_on_data(str(tmp_path / "demo.db")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < end, "no decision on data within 240 s"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    first = lines[0]
    assert first.startswith("tailpilot demo: 2 twin replicas") and "with the tenants' SLOs" in first
    assert "the autopilot armed on twin-1 (dry-run on twin-0)" in first
    assert "the governor in dry-run" in first
    # The autopilot's report: where it is armed, its pacing, each steered replica's decisions.
    assert "autopilot of demo: armed · set by tailpilot demo" in out
    assert "armed on twin-1 only; the others are dry-run" in out
    assert "a decision every 10 s (replica clock)" in out and "(the demo's pacing)" in out
    decisions = [ln for ln in lines if re.match(r"^    t=\d+ (keep|switch) \S+: ", ln)]
    assert any("waiting for data" not in ln for ln in decisions), out
    for replica in ("twin-0", "twin-1"):  # what each runs (or would run) and why
        assert re.search(rf"^  {replica}: (running|would run) \S+ · ", out, re.M), replica
    # The tenants' figures and the governor.
    assert re.search(r"^SCR \d\S*   JFI \d\S*   JFI \(seed\) \d", out, re.M), out
    for tenant in ("t0", "t1", "t2"):
        assert re.search(rf"^  {tenant}: TTFT P50 \S+", out, re.M), tenant
    assert "governor of demo: dry-run · active modes:" in out
    # The cluster file it wrote declares the tenants' SLOs (seed 003's multi-quantile targets).
    cluster = load_cluster_file(tmp_path / "tailpilot-demo.yaml").cluster("demo")
    assert cluster.governance is not None
    tenants = cluster.governance.tenants
    assert sorted(tenants) == ["t0", "t1", "t2"]
    assert all(t.commit_tok_s and t.ttft for t in tenants.values())
    assert tenants["t0"].ttft is not None and tenants["t0"].ttft.p99 == 0.8


@pytest.mark.parametrize("promise", [None, "every quantile within 2% of sarathi's"])
def test_the_report_shows_the_promise_when_the_autopilot_gives_one(promise):
    from rich.console import Console

    from tailpilot.cli_twin import demo_report

    status = {
        "t_ms": 1,
        "held": None,
        "armed_replicas": ["twin-1"],
        "replicas": {"twin-1": {"choice": "defaults", "note": "runs defaults", "last": []}},
    }
    if promise:
        status["promise"] = promise
    row = {"cluster": "demo", "state": "armed", "paused": False, "who": "x", "status": status}
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    for line in demo_report(row, None, None):
        console.print(line)
    text = console.export_text()
    assert "armed on twin-1 only" in text
    assert ("every quantile within 2% of sarathi's" in text) == bool(promise)
    assert text.count("every quantile within 2% of sarathi's") <= 1  # said once
    assert "tenants: no figures yet" in text


def test_the_demos_governance_block_is_the_one_docs_governance_md_shows():
    """The block the demo writes on the bundled trace with four twins (commitments sized on each
    tenant's demand at 1.5 × 4) is the one docs/governance.md gives to start from."""
    from pathlib import Path

    from controlplane.governance import GovernanceSpec
    from sim import traces
    from tailpilot.cli_twin import demo_governance

    text = (Path(__file__).resolve().parents[1] / "docs" / "governance.md").read_text()
    section = text.split("## A block to start from", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    documented = GovernanceSpec.model_validate(yaml.safe_load(block)["governance"])
    trace = traces.assign_tenants_zipf(traces.load_bundled(), 3, seed=0)
    assert demo_governance(trace, 1.5 * 4) == documented
    # The busiest tenant's TTFT targets are the premium tier the lineup misses (SCR 2/3).
    assert documented.tenants["t0"].ttft is not None and documented.tenants["t0"].ttft.p90 == 0.4
