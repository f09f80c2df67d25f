"""SVG snapshots of every screen of the TUI on the committed recording (replay: deterministic).

Update the baselines after an intended change with ``pytest tests/test_tui_snapshots.py
--snapshot-update`` and review the SVGs (``tests/__snapshots__/test_tui_snapshots/``).
The recording is made by ``tests/fixtures/make_recording.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tui_support import wait_for  # tests/tui_support.py

from controlplane.cluster import ClusterSpec, ReplicaSpec
from scheduler.settings_change import SettingsChange
from tui.dialogs import ConfirmScreen
from tui.main import build_app

FIXTURE = Path(__file__).parent / "fixtures" / "recording_small.db"
SIZE = (160, 48)
START_MS = 1_700_000_000_000  # the recording's first sample (make_recording.EPOCH)
# The SLOs and window the recording was made with (a replay takes them from the cluster file).
SPEC = ClusterSpec(
    name="fixture",
    window_s=30.0,
    slos={"ttft_p99": 1.0, "ttlt_p99": 15.0},
    replicas=[
        ReplicaSpec(
            name=f"twin-{i}", api_url="http://127.0.0.1:1", control_url="http://127.0.0.1:1"
        )
        for i in range(3)
    ],
)


@pytest.fixture
def replay_app(tmp_path):
    db = tmp_path / "rec.db"
    shutil.copy(FIXTURE, db)

    def make(offset_s: float = 60.0):
        return build_app(SPEC, replay=str(db), start_ms=START_MS + int(offset_s * 1000))

    return make


def _drawn(app) -> bool:
    """Whether the panel on screen has what its workers fetch (the policy panel's form, the
    audit log's rows): a screenshot taken before then would depend on the machine's speed."""
    if app.panel == "policy":
        panel = app.query_one("#policy")
        return panel.form_policy is not None and not panel.building
    if app.panel == "audit":
        return app.query_one("#audit").data is not None
    return True


async def ready(pilot, *keys: str) -> None:
    """Wait for the replay's snapshot at the start position, press keys, and wait for the panel
    they open to be drawn from its data; then settle."""
    app = pilot.app
    await wait_for(
        pilot,
        lambda: app.snapshot is not None and app.snapshot.t_ms == app.source.position,
        what="the snapshot at the start position",
    )
    for key in keys:
        await pilot.press(key)
        await pilot.pause()
    await wait_for(pilot, lambda: _drawn(app), what=f"the {app.panel} panel drawn")
    await pilot.pause(0.1)


def test_cluster_screen(replay_app, snap_compare):
    assert snap_compare(replay_app(60), terminal_size=SIZE, run_before=lambda p: ready(p))


def test_cluster_screen_with_an_unhealthy_replica_sorted_and_selected(replay_app, snap_compare):
    async def before(pilot):
        await ready(pilot)
        panel = pilot.app.query_one("#cluster")
        panel.set_sort("ttlt", reverse=True)
        pilot.app.selected = {"twin-0", "twin-2"}
        pilot.app.refresh_selection_marks()
        await pilot.pause(0.1)

    assert snap_compare(replay_app(75), terminal_size=SIZE, run_before=before)


def test_replica_screen(replay_app, snap_compare):
    # twin-1: sarathi → uniboost at 30 s, γ pinned at 55 s (both marked on the time axis).
    assert snap_compare(
        replay_app(90), terminal_size=SIZE, run_before=lambda p: ready(p, "down", "2")
    )


def test_policy_panel(replay_app, snap_compare):
    assert snap_compare(
        replay_app(90), terminal_size=SIZE, run_before=lambda p: ready(p, "down", "3")
    )


def test_confirm_dialog(replay_app, snap_compare):
    async def before(pilot):
        await ready(pilot)
        app = pilot.app
        edits = {
            "twin-1": SettingsChange(params={"gamma": 25.0}, unpin=frozenset({"gamma"})),
            "twin-2": SettingsChange(params={"beta": 2.0}),  # tie's β ≤ 1: refused, not sent
            "twin-0": SettingsChange(policy="uniboost", params={"quant_ratio": 4.0}),
        }  # settings unknown
        app.push_screen(ConfirmScreen("Apply to 3 replica(s)?", app._plans(edits)))
        await pilot.pause(0.1)

    assert snap_compare(replay_app(90), terminal_size=SIZE, run_before=before)


def test_audit_screen(replay_app, snap_compare):
    assert snap_compare(replay_app(100), terminal_size=SIZE, run_before=lambda p: ready(p, "4"))


def test_help_screen(replay_app, snap_compare):
    assert snap_compare(
        replay_app(60), terminal_size=SIZE, run_before=lambda p: ready(p, "question_mark")
    )


def test_alerts_panel_with_a_firing_alert(tmp_path, snap_compare):
    """The alert bar and the alerts panel on a recording with governance rows stored 30 s in."""
    from storage.rows import AlertRow, Batch, GovernanceRow
    from storage.store import Store

    db = tmp_path / "gov.db"
    shutil.copy(FIXTURE, db)
    # The governance report's keys (controlplane.governance.report): acme over-consumes (ω < 1),
    # delta is starved (requests waiting, nothing completed); JFI 0.667 beside JFI (seed) 0.578;
    # type fairness below its alert, pending.
    tenant = {
        "ttft_p50": 0.21,
        "ttft_p90": 0.9,
        "ttft_p99": 2.4,
        "ttlt_p99": 12.0,
        "tok_s": 812.0,
        "normalised": 1.6,
        "service_ratio": 1.0,
        "omega": 0.625,
        "waiting": 0,
        "waited_s": None,
        "starved": False,
        "limits": {"ttft_p50": 0.5, "ttft_p99": 1.0},
        "missed": ["ttft_p99"],
        "compliant": False,
    }
    starved = {
        **{k: None for k in ("ttft_p50", "ttft_p90", "ttft_p99", "ttlt_p99")},
        "tok_s": 0.0,
        "normalised": 0.0,
        "service_ratio": 0.0,
        "omega": 4.0,
        "waiting": 4,
        "waited_s": 12.5,
        "starved": True,
        "limits": {"ttft_p99": 1.0},
        "missed": ["ttft_p99"],
        "compliant": False,
    }
    figures = {
        "scr": 0.333,
        "jfi": 0.667,
        "jfi_seed": 0.578,
        "type_fairness_min": 0.45,
        "requests": 240,
        "over_consumers": ["acme"],
        "alerts_pending": {"type_fairness": "warning"},
        "tenants": {
            "acme": tenant,
            "beta": {
                **tenant,
                "ttft_p99": 0.8,
                "missed": [],
                "compliant": True,
                "normalised": 0.7,
                "omega": 1.43,
            },
            "delta": starved,
        },
        "types": {
            "chat": {"share": 0.9, "minimum": 0.35, "ratio": 1.2, "ttft_p50": 0.2, "ttft_p99": 2.0},
            "batch": {
                "share": 0.1,
                "minimum": 0.22,
                "ratio": 0.45,
                "ttft_p50": 0.3,
                "ttft_p99": 2.6,
            },
        },
    }
    with Store.open(str(db)) as store:
        store.recordings.write(
            "fixture",
            Batch(
                governance=[GovernanceRow(t_ms=START_MS + 30_000, summary=figures)],
                alerts=[
                    AlertRow(
                        START_MS + 30_000,
                        "scr",
                        "critical",
                        "firing",
                        {
                            "value": 0.333,
                            "threshold": 0.9,
                            "missed": {"acme": ["ttft_p99"], "delta": ["ttft_p99"]},
                        },
                    ),
                    AlertRow(
                        START_MS + 31_000,
                        "jfi",
                        "warning",
                        "firing",
                        {"value": 0.667, "threshold": 0.9},
                    ),
                ],
            ),
        )
    app = build_app(SPEC, replay=str(db), start_ms=START_MS + 60_000)
    assert snap_compare(app, terminal_size=SIZE, run_before=lambda p: ready(p, "6"))
