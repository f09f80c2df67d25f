"""The operator TUI driven by keys (App.run_test + Pilot) against twin replicas over real HTTP,
and replaying the committed recording.

Live: switch a policy with P (the twin's GET /settings shows it, the store has the audit row);
pin γ with N (γ-Ada no longer moves it, while an unpinned twin's γ keeps moving); edit and pin
in the policy panel with inline validation by the settings model; --readonly refuses; a twin
that goes down shows as unhealthy with the reason and the app keeps running.
Replay: seeking and stepping show exactly the values the store recorded at that time.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest
from tui_support import wait_for  # tests/tui_support.py

from controlplane.cluster import ClusterSpec, ReplicaSpec
from controlplane.replica_http import make_client
from controlplane.views import fmt_figure, fmt_number, fmt_seconds
from scheduler.settings import GAMMA_DEFAULT, Settings
from scheduler.settings_change import SettingsChange
from sim import traces
from storage.store import Store
from tui import keys as K
from tui import render as R
from tui.main import build_app
from tui.replay import ReplaySource
from tuner.twins.cluster import start_twins

TOKEN = "tui-test-token"
TOKEN_ENV = "TP_TUI_TEST_TOKEN"
SPEED = 20.0
SIZE = (160, 48)
FIXTURE = Path(__file__).parent / "fixtures" / "recording_small.db"
# γ-Ada quick enough to move within a few wall seconds at SPEED (5 replica-s = 0.25 wall-s).
# Its signal the TTLT tail, which keeps moving as the looping trace's mix goes by: the default
# (fcfs_wait) reads 0 at this light load, so γ climbs to gamma_max within ~100 replica s and stays,
# and a test that needs an unpinned γ still adapting would pass only on a machine fast enough
# to get there first.
UNIBOOST = {
    "policy": "uniboost",
    "params": {
        "ada_min_samples": 20,
        "ada_window": 200,
        "ada_interval_s": 5.0,
        "ada_signal": "ttlt",
    },
}


def minute_trace() -> traces.Trace:
    return traces.assign_tenants_zipf(
        traces.time_window(traces.load_bundled(), 0.0, 60.0), 3, seed=3
    )


@pytest.fixture
def twins(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with start_twins(
        3,
        minute_trace(),
        speed=SPEED,
        token=TOKEN,
        rate_scale=2.0,
        settings=Settings.model_validate(UNIBOOST),
    ) as tw:
        yield tw


def spec_of(twins, **kw) -> ClusterSpec:
    # timeout_s: generous, so a loaded CI machine does not turn a slow answer into a failed apply.
    return ClusterSpec(
        name="twins",
        poll_interval_s=0.25,
        timeout_s=5.0,
        window_s=30.0,
        slos={"ttft_p99": 2.0, "ttlt_p99": 30.0},
        replicas=[
            ReplicaSpec(name=t.name, api_url=t.url, control_url=t.control_url, token_env=TOKEN_ENV)
            for t in twins
        ],
        **kw,
    )


def get_settings(twin) -> dict:
    r = httpx.get(f"{twin.url}/tailpilot/v1/settings", trust_env=False, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


async def started(pilot, app):
    """Wait until every replica has been polled and shown."""
    await wait_for(
        pilot,
        lambda: (
            app.snapshot is not None
            and all(
                rs.sample is not None and rs.sample.healthy for rs in app.snapshot.replicas.values()
            )
        ),
        what="first poll",
    )


def cell(app, replica: str, column: str) -> str:
    value = app.query_one("#cluster-table").get_cell(replica, column)
    return getattr(value, "plain", value)


def text_of(widget) -> str:
    """The plain text a Static shows (its rich content rendered without styles)."""
    import io

    from rich.console import Console

    console = Console(width=300, file=io.StringIO(), record=True, color_system=None)
    console.print(widget.content)
    return console.export_text()


def notifications(app) -> list[str]:
    return [n.message for n in app._notifications]


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------------------ live


def test_switch_policy_with_P_changes_the_replica_and_writes_the_audit_row(twins, tmp_path):
    store = Store.open(str(tmp_path / "live.db"))
    v0 = get_settings(twins[1])["version"]

    async def scenario():
        app = build_app(spec_of(twins), store=store, refresh_s=0.25)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)
            # Some recorded traffic of twin-1 for the confirm dialog's what-if to replay.
            await wait_for(
                pilot,
                lambda: len(store.readings.completions("twins", "twin-1")) >= 30,
                what="recorded traffic",
                timeout=30,
            )
            await pilot.press("down")  # cursor: twin-1
            assert app.current_replica == "twin-1"
            await pilot.press("P")
            await wait_for(
                pilot, lambda: type(app.screen).__name__ == "PolicyPickScreen", what="policy picker"
            )
            options = app.screen.query_one("#policy-options")
            # from uniboost (current) to las: up twice (uniboost -> distboost -> las)
            assert options.get_option_at_index(options.highlighted).id == "uniboost"
            await pilot.press("up", "up", "enter")
            await wait_for(
                pilot, lambda: type(app.screen).__name__ == "ConfirmScreen", what="confirmation"
            )
            diff = text_of(app.screen.query_one("#dialog-diff"))
            assert "twin-1" in diff and "policy: uniboost → las" in diff, diff
            # The what-if: each figure's predicted change on twin-1's recorded traffic, with the
            # band.
            preview = app.screen.query_one("#dialog-preview")
            await wait_for(
                pilot, lambda: "P95 TTFT" in text_of(preview), what="what-if", timeout=30
            )
            assert "fidelity not measured here" in text_of(preview) and "twin-1" in text_of(preview)
            assert (
                get_settings(twins[1])["settings"]["policy"] == "uniboost"
            )  # nothing sent before y
            await pilot.press("y")
            await wait_for(
                pilot, lambda: get_settings(twins[1])["settings"]["policy"] == "las", what="PUT"
            )
            # The applied version read back shows in the policy panel and in the table.
            await wait_for(pilot, lambda: app.last_results, what="apply result")
            [res] = app.last_results
            assert res.ok and res.version == v0 + 1 == get_settings(twins[1])["version"]
            await pilot.press("3")
            text = text_of(app.query_one("#last-result"))
            assert f"applied as version {v0 + 1}" in text
            await wait_for(
                pilot, lambda: cell(app, "twin-1", "policy") == "las", what="table shows las"
            )
            assert cell(app, "twin-0", "policy") == "uniboost"  # only the target changed
            await pilot.press("4")
            table = app.query_one("#audit-table")
            await wait_for(pilot, lambda: table.row_count >= 1, what="audit table")
            # The change was applied with a prediction: predicted P95 TTFT, realized once its 10 min
            # pass.
            await wait_for(
                pilot, lambda: "→ due" in str(table.get_row_at(0)[6]), what="verification cell"
            )
            return app
        return app

    run(scenario())
    rows = store.settings_log.settings_changes("twins")
    assert len(rows) == 1
    [row] = rows
    assert (
        row["replica"] == "twin-1" and row["result"] == "applied" and row["who"].startswith("tui:")
    )
    assert (
        row["old"]["policy"] == "uniboost"
        and row["new"]["policy"] == "las"
        and row["version"] == v0 + 1
    )
    assert get_settings(twins[0])["settings"]["policy"] == "uniboost"
    # The prediction is kept with the change it was made for (tailpilot verify reads it).
    [kept] = store.tuner.predictions("twins")
    assert kept["replica"] == "twin-1" and kept["version"] == v0 + 1
    assert kept["summary"]["proposed"]["policy"] == "las" and kept["summary"]["metrics"]["ttft_p95"]
    store.close()


def test_pin_gamma_with_N_stops_gamma_ada_while_unpinned_gamma_moves(twins):
    # twin-1 is pinned and twin-2 watched: their tails keep moving with the looping trace, so
    # γ-Ada keeps changing their γ (twin-0's tail settles, its γ with it: a pin there would
    # have nothing to stop).
    pinned_twin, watched_twin = twins[1], twins[2]

    async def scenario():
        app = build_app(spec_of(twins), refresh_s=0.25)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)

            def adapted(replica: str, since_ms: int = 0) -> list[float]:
                return [
                    r.gamma_live
                    for r in app.source.history(replica)
                    if r.t_ms > since_ms and r.healthy and r.gamma_live not in (None, GAMMA_DEFAULT)
                ]

            # γ-Ada has moved both twins' γ more than once, so the pin freezes an adapted value
            # of a γ that was still moving.
            await wait_for(
                pilot,
                lambda: all(len(set(adapted(t.name))) > 1 for t in (pinned_twin, watched_twin)),
                what="γ-Ada moving",
                timeout=60,
            )
            await pilot.press("down")
            await wait_for(
                pilot, lambda: app.current_replica == pinned_twin.name, what="cursor on twin-1"
            )
            await pilot.press("N")
            await wait_for(
                pilot, lambda: type(app.screen).__name__ == "ConfirmScreen", what="confirmation"
            )
            diff = text_of(app.screen.query_one("#dialog-diff"))
            assert pinned_twin.name in diff, diff
            assert "params.gamma" in diff and 'pinned: [] → ["gamma"]' in diff, diff
            await pilot.press("y")
            await wait_for(
                pilot,
                lambda: "gamma" in get_settings(pinned_twin)["settings"]["pinned"],
                what="pinned",
            )
            pinned = get_settings(pinned_twin)["settings"]["params"]["gamma"]
            await wait_for(
                pilot,
                lambda: cell(app, pinned_twin.name, "gamma").endswith("*"),
                what="pin shown",
            )
            since_ms = app.snapshot.t_ms + 500

            # Until the watched twin's γ-Ada has moved its γ again after the pin: a few of its
            # 5-replica-s intervals (0.25 wall s each) unloaded. A loaded machine's twin may lag
            # its clock, so the test waits on the move itself, not on a guess of the speed.
            await wait_for(
                pilot,
                lambda: (
                    len(adapted(pinned_twin.name, since_ms)) >= 5
                    and len(adapted(watched_twin.name, since_ms)) >= 5
                    and len(set(adapted(watched_twin.name, since_ms))) > 1
                ),
                what="the unpinned twin's γ moving after the pin",
                timeout=60,
            )
            return (
                pinned,
                adapted(pinned_twin.name, since_ms),
                adapted(watched_twin.name, since_ms),
                cell(app, pinned_twin.name, "gamma"),
            )

    pinned, hist_pinned, hist_watched, shown = run(scenario())
    assert all(g == pytest.approx(pinned) for g in hist_pinned), (pinned, hist_pinned)
    assert len(set(hist_watched)) > 1, hist_watched  # the unpinned twin's γ kept adapting
    assert shown == f"{pinned:.3g}*"
    assert pinned_twin.sim.policy.gamma == pytest.approx(pinned)
    assert [get_settings(t)["settings"]["pinned"] for t in twins] == [[], ["gamma"], []]


@pytest.mark.slow
def test_policy_panel_edits_are_validated_inline_then_applied_with_pins(twins):
    async def scenario():
        app = build_app(spec_of(twins), refresh_s=0.25)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)
            await pilot.press("down", "down")  # twin-2
            await pilot.press("E")
            panel = app.query_one("#policy")
            await wait_for(
                pilot,
                lambda: panel.form_policy == "uniboost" and panel.reference == "twin-2",
                what="form",
            )
            gen = panel._gen
            gamma = app.query_one(f"#f{gen}-gamma")
            # An invalid value: the settings model's own message, on the field, and A refuses.
            gamma.value = "-3"
            await pilot.pause(0.1)
            hint = text_of(app.query_one(f"#h{gen}-gamma"))
            assert "greater than or equal to 0.000001" in hint and gamma.has_class("-invalid"), hint
            assert panel.error and "params.gamma" in panel.error
            gamma.focus()
            await pilot.press("enter")  # enter in a field = A
            await pilot.pause(0.1)
            assert type(app.screen).__name__ != "ConfirmScreen"
            assert any("not valid" in m for m in notifications(app))
            # A model-level rule across two fields (gamma_min must not exceed gamma_max).
            gamma.value = "8"
            app.query_one(f"#f{gen}-gamma_min").value = "300"
            await pilot.pause(0.1)
            assert "gamma_min" in (panel.error or "") and "must not exceed" in panel.error
            app.query_one(f"#f{gen}-gamma_min").value = "1"
            app.query_one(f"#p{gen}-gamma").value = True  # pin γ
            await pilot.pause(0.1)
            assert panel.error is None
            await pilot.press("escape")  # leave the form; A is a key again
            preview = text_of(app.query_one("#preview"))
            assert "params.gamma: 0.1 → 8" in preview and "pinned" in preview, preview
            await pilot.press("A")
            await wait_for(
                pilot, lambda: type(app.screen).__name__ == "ConfirmScreen", what="confirmation"
            )
            await pilot.press("y")
            await wait_for(
                pilot,
                lambda: get_settings(twins[2])["settings"]["params"]["gamma"] == 8.0,
                what="PUT",
            )
            doc = get_settings(twins[2])["settings"]
            assert doc["pinned"] == ["gamma"] and doc["params"]["gamma_min"] == 1.0
            await wait_for(
                pilot,
                lambda: (app.snapshot.replicas["twin-2"].settings or {}).get("pinned") == ["gamma"],
                what="new settings polled",
            )
            # The form rebuilds from the applied settings by itself; unpin there: untick, apply.
            await wait_for(
                pilot,
                lambda: (
                    panel._gen > gen
                    and not panel._loading
                    and not panel.building
                    and panel.form_version == get_settings(twins[2])["version"]
                ),
                what="form rebuilt from the new version",
            )
            gen = panel._gen
            assert app.query_one(f"#p{gen}-gamma").value is True
            assert app.query_one(f"#f{gen}-gamma").value == "8"
            assert "no changes staged" in text_of(app.query_one("#preview"))
            app.query_one(f"#p{gen}-gamma").value = False
            await pilot.pause(0.1)
            await pilot.press("A")
            await wait_for(
                pilot, lambda: type(app.screen).__name__ == "ConfirmScreen", what="confirmation"
            )
            await pilot.press("y")
            await wait_for(
                pilot, lambda: get_settings(twins[2])["settings"]["pinned"] == [], what="unpinned"
            )
            assert get_settings(twins[2])["settings"]["params"]["gamma"] == 8.0
            assert (
                get_settings(twins[0])["settings"]["params"]["gamma"] == GAMMA_DEFAULT
            )  # untouched

    run(scenario())


def test_form_rebuilds_that_overlap_run_one_after_another(twins):
    """Opening the panel, E, a new settings version and the policy select each rebuild the form;
    when they overlap, one must never remove the rows another is still mounting (a half-mounted
    Select raised NoMatches in its own on_mount and took the app down)."""

    async def scenario():
        app = build_app(spec_of(twins), refresh_s=0.25)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)
            await pilot.press("E")
            panel = app.query_one("#policy")
            await wait_for(pilot, lambda: panel.form_policy == "uniboost", what="form")
            gen = panel._gen
            # Three rebuilds at once, the middle one of another policy (its own fields).
            select = app.query_one("#policy-select")
            await asyncio.gather(
                panel.load(force=True),
                panel._build_form("tie"),
                panel.load(force=True),
            )
            await pilot.pause(0.1)
            assert app.is_running and not panel.building
            assert panel._gen == gen + 3
            rows = list(app.query("#form .form-row"))
            assert len(rows) == len(panel.fields) > 0  # one form, not two half ones
            for f in panel.fields:  # every field of the last rebuild is there and readable
                app.query_one(f"#f{panel._gen}-{f.name}")
                app.query_one(f"#h{panel._gen}-{f.name}")
            assert panel.form_policy == "uniboost" and select.value == "uniboost"
            assert panel.current_edit().empty and panel.error is None
            assert "no changes staged" in text_of(app.query_one("#preview"))

    run(scenario())


def test_readonly_refuses_every_cluster_change_visibly(twins, tmp_path):
    store = Store.open(str(tmp_path / "ro.db"))
    before = [get_settings(t) for t in twins]

    async def scenario():
        app = build_app(spec_of(twins), store=store, readonly=True, refresh_s=0.25)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)
            assert "READ-ONLY" in text_of(app.query_one("#topbar"))
            # Greyed in the footer (check_action None = shown disabled), not hidden.
            assert (
                app.check_action("switch_policy", ()) is None
                and app.check_action("toggle_pin", ()) is None
            )
            for key in ("P", "N", "E"):
                await pilot.press(key)
                await pilot.pause(0.1)
                assert type(app.screen).__name__ == "Screen", key
            assert app.refused == ["switch_policy", "toggle_pin", "edit_params"]
            assert sum("refused" in m and "--readonly" in m for m in notifications(app)) == 3
            # The command palette runs the same checks.
            await app.invoke_key(next(k for k in K.KEYS if k.action == "switch_policy"))
            assert app.refused[-1] == "switch_policy"
            await pilot.press("3")
            # The form is built by a worker: wait for it, not a fixed pause.
            await wait_for(
                pilot,
                lambda: (
                    bool(app.query("#form Input"))
                    and "READ-ONLY" in text_of(app.query_one("#policy-banner"))
                ),
                what="the policy panel's form, read-only",
            )
            assert all(w.disabled for w in app.query("#form Input, #form Checkbox"))
            assert app.query("#form Input")  # the form is there to read, disabled
            await pilot.press("A")
            await pilot.pause(0.3)
            assert type(app.screen).__name__ == "Screen"
            assert app.refused[-1] == "apply_edits"
            # p pauses the display (the collector keeps polling), p again resumes it.
            await pilot.press("1", "p")
            assert app.paused and "PAUSED" in text_of(app.query_one("#topbar"))
            n, polled = app.snapshots_applied, len(app.source.histories["twin-0"])
            # The collector polls on (three more polls of twin-0) while the display stands still.
            await wait_for(
                pilot,
                lambda: len(app.source.histories["twin-0"]) >= polled + 3,
                what="polls while paused",
            )
            assert app.snapshots_applied == n
            await pilot.press("p")
            await wait_for(pilot, lambda: app.snapshots_applied > n + 1, what="resumed")
            assert not app.paused

    run(scenario())
    assert [get_settings(t) for t in twins] == before
    assert store.settings_log.settings_changes("twins") == []
    store.close()


def test_a_replica_that_goes_down_shows_unhealthy_with_the_reason(twins):
    async def scenario():
        app = build_app(spec_of(twins), refresh_s=0.25)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)
            twins[2].stop()
            # tuner.twins.replica's stop() keeps serving already-open keep-alive connections (a dead
            # process would drop them): drop the collector's pooled connections as the kernel would.
            collector = app.source.collector
            old, collector._client = collector._client, make_client(collector.cluster)
            await old.aclose()
            await wait_for(
                pilot, lambda: cell(app, "twin-2", "health").startswith("DOWN"), what="down"
            )

            def reason_now() -> str:
                return app.snapshot.replicas["twin-2"].health.reason or ""

            # The cell and the snapshot are read together (a refresh may land between two reads).
            def cell_shows_reason() -> bool:
                health = cell(app, "twin-2", "health")
                return health.startswith("DOWN") and health == f"DOWN {reason_now()}"[: len(health)]

            # Wait for the reason "down" itself: a poll in flight when the twin stopped (or on
            # the dropped connections) may first report a lost connection.
            await wait_for(
                pilot,
                lambda: cell_shows_reason() and reason_now().startswith("state: down"),
                what="the health cell shows the snapshot's reason, the replica down",
            )
            n = app.snapshots_applied
            await wait_for(pilot, lambda: app.snapshots_applied >= n + 3, what="refreshes go on")
            assert cell(app, "twin-0", "health") == "ok" and app.is_running
            assert "2/3 healthy" in text_of(app.query_one("#topbar"))
            await pilot.press("down", "down", "2")
            await wait_for(
                pilot,
                lambda: (
                    "UNHEALTHY" in text_of(app.query_one("#down-banner"))
                    and reason_now().split(";")[0] in text_of(app.query_one("#down-banner"))
                ),
                what="the banner shows the current reason",
            )
            # Back up: healthy again.
            twins[2].start()
            await pilot.press("1")
            await wait_for(
                pilot, lambda: cell(app, "twin-2", "health") == "ok", what="healthy again"
            )

    run(scenario())


# ------------------------------------------------------------------------------------------ replay


@pytest.fixture
def recording(tmp_path):
    db = tmp_path / "rec.db"
    shutil.copy(FIXTURE, db)
    return str(db)


def expected_cells(row) -> dict[str, str]:
    lat = row.latency
    if not row.healthy:
        return {"waiting": "—", "running": "—", "ttlt": "—/—/—", "tok_s": "—"}
    return {
        "waiting": fmt_number(row.waiting),
        "running": fmt_number(row.running),
        "policy": row.policy,
        "ttft": "/".join(fmt_seconds(x) for x in (lat.ttft_p50, lat.ttft_p95, lat.ttft_p99)),
        "ttlt": "/".join(fmt_seconds(x) for x in (lat.ttlt_p50, lat.ttlt_p95, lat.ttlt_p99)),
        "tok_s": fmt_number(row.throughput_tok_s),
        "preempt": fmt_number(row.preemptions_per_s, 1),
    }


def assert_table_shows(app, store, at_ms: int) -> None:
    rows = store.readings.latest_samples("fixture", at_ms)
    assert rows and set(rows) == set(app.snapshot.replicas)
    for name, row in rows.items():
        for column, want in expected_cells(row).items():
            assert cell(app, name, column) == want, (name, column, at_ms)
        if not row.healthy:
            assert cell(app, name, "health").startswith("DOWN " + row.reason[:10])


def test_replay_seek_and_step_show_the_values_recorded_at_that_time(recording):
    store = Store.open(recording)
    ticks = [s.t_ms for s in store.readings.samples("fixture", "twin-0")]
    start = ticks[0]

    async def scenario():
        app = build_app(None, replay=recording)
        src: ReplaySource = app.source
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None, what="first snapshot")
            assert app.readonly and app.snapshot.t_ms == start
            # Seek with g: 42 s into the recording.
            await pilot.press("g")
            await wait_for(
                pilot, lambda: type(app.screen).__name__ == "SeekScreen", what="seek dialog"
            )
            await pilot.press(*"@0:42.5", "enter")
            target = start + 42_500
            await wait_for(pilot, lambda: app.snapshot.t_ms == target, what="seek applied")
            await pilot.pause(0.1)
            assert_table_shows(app, store, target)
            assert "22:14:02" in text_of(app.query_one("#topbar"))
            # ] steps to the next recorded sample, [ back one.
            await pilot.press("right_square_bracket")
            nxt = min(t for t in ticks if t > target)
            await wait_for(pilot, lambda: app.snapshot.t_ms == nxt, what="step forward")
            assert_table_shows(app, store, nxt)
            await pilot.press("left_square_bracket", "left_square_bracket")
            prev = max(t for t in ticks if t < nxt - 1)
            prev = max(t for t in ticks if t < prev)
            await wait_for(pilot, lambda: app.snapshot.t_ms == prev, what="step back twice")
            assert_table_shows(app, store, prev)
            # Into twin-2's outage (recorded as down from t=70 s to 79 s).
            src.seek(start + 75_000)
            await wait_for(
                pilot, lambda: app.snapshot.t_ms == start + 75_000, what="seek into outage"
            )
            assert cell(app, "twin-2", "health").startswith("DOWN state: down")
            assert_table_shows(app, store, start + 75_000)
            # The γ pin of t=55 shows from then on (settings from the recorded audit log).
            assert cell(app, "twin-1", "gamma").endswith("*")
            src.seek(start + 50_000)
            await wait_for(
                pilot, lambda: app.snapshot.t_ms == start + 50_000, what="before the pin"
            )
            assert not cell(app, "twin-1", "gamma").endswith("*")
            # A bad time is refused inline, the position stays.
            await pilot.press("g", *"yesterday", "enter")
            await pilot.pause(0.1)
            assert "cannot read" in text_of(app.screen.query_one("#seek-error"))
            await pilot.press("escape")
            assert app.snapshot.t_ms == start + 50_000
            # Replay is read-only by construction.
            await pilot.press("P")
            await pilot.pause(0.1)
            assert app.refused == ["switch_policy"] and type(app.screen).__name__ == "Screen"
            assert not hasattr(src, "apply")

    run(scenario())
    store.close()


def test_filter_and_sort_the_cluster_screen(recording):
    store = Store.open(recording)
    at = 1_700_000_060_000
    rows = store.readings.latest_samples("fixture", at)

    async def scenario():
        app = build_app(None, replay=recording, start_ms=at)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None, what="first snapshot")
            table = app.query_one("#cluster-table")
            assert table.order == ["twin-0", "twin-1", "twin-2"]
            # / filters (by policy here), esc leaves the filter on and the table focused.
            await pilot.press("slash", *"tie")
            await pilot.pause(0.1)
            assert table.order == ["twin-2"]
            assert "showing 1 of 3" in text_of(app.query_one("#totals"))
            await pilot.press("escape")
            assert table.has_focus and "filter “tie”" in text_of(app.query_one("#table-title"))
            await pilot.press("slash", "backspace", "backspace", "backspace", *"down", "enter")
            await pilot.pause(0.1)
            assert table.order == []  # nothing is down at 60 s
            app.query_one("#filter").value = ""
            await pilot.pause(0.1)
            assert table.order == ["twin-0", "twin-1", "twin-2"]
            # s cycles the sort column, r reverses; the cursor stays on its replica.
            table.focus()
            assert (
                app.current_replica == "twin-2"
            )  # the cursor stayed on the replica the filter left
            await pilot.press("home", "down")
            assert app.current_replica == "twin-1"
            panel = app.query_one("#cluster")
            while panel.sort_column != "waiting":
                await pilot.press("s")
            by_waiting = sorted(rows, key=lambda n: (rows[n].waiting, n))
            assert table.order == by_waiting
            await pilot.press("r")
            assert table.order == sorted(rows, key=lambda n: (rows[n].waiting, n), reverse=True)
            assert table.cursor_key == "twin-1"
            # Clicking a header sorts by that column.
            x = sum(c.width + 2 for c in R.COLUMNS[:11]) + 2
            await pilot.click("#cluster-table", offset=(x, 0))
            await pilot.pause(0.1)
            assert panel.sort_column == "tok_s"
            assert table.order == sorted(
                rows, key=lambda n: (rows[n].throughput_tok_s, n), reverse=panel.sort_reverse
            )

    run(scenario())
    store.close()


def test_a_snapshot_arriving_while_the_app_closes_is_dropped_quietly(recording, caplog):
    # The pump waits on the source; a snapshot that comes while Textual is taking the screens
    # down must not be put on panels that are gone (it was: a NoMatches logged as a display
    # error on most exits of a live app).
    app = build_app(None, replay=recording)
    first_snapshot = app.source.next_snapshot
    late = {"delivered": False}

    async def next_snapshot():
        if app.snapshot is None:
            return await first_snapshot()
        table = app.query_one("#cluster-table")
        while table.is_attached:  # until the app's exit has taken the panels down
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                # A source need not stop at once when the app cancels its pump (a network read
                # finishing during shutdown): it delivers anyway. Without this the pump was
                # sometimes cancelled before the panels came down and nothing was tested.
                continue
        late["delivered"] = True
        return app.snapshot

    app.source.next_snapshot = next_snapshot

    async def scenario():
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None, what="first snapshot")
            applied = app.snapshots_applied
        return applied

    with caplog.at_level("ERROR", logger="tui.app"):
        applied = run(scenario())
    assert late["delivered"]
    assert app.snapshots_applied == applied
    assert not [r for r in caplog.records if r.name == "tui.app"], caplog.text


def test_replay_plays_and_pauses(recording):
    async def scenario():
        app = build_app(None, replay=recording)
        src: ReplaySource = app.source
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None, what="first snapshot")
            src.speed = 32.0
            await pilot.press("p")
            assert src.playing
            await wait_for(
                pilot, lambda: app.snapshot.t_ms >= src.start_ms + 10_000, what="playing"
            )
            await pilot.press("p")
            assert not src.playing
            stopped = src.position
            # The last position's snapshot is loaded in a thread: shown once it lands ...
            await wait_for(pilot, lambda: app.snapshot.t_ms == stopped, what="the paused frame")
            await pilot.pause(0.5)
            # ... and nothing moves on while paused.
            assert src.position == stopped and app.snapshot.t_ms == stopped

    run(scenario())


def test_the_live_source_stamps_with_its_injected_clock(twins):
    """No wall clock inside the live source: samples, snapshots and audit rows take the clock
    given."""
    import asyncio

    from tui.sources import LiveSource

    fixed = 1_800_000_000.0  # a moment no machine's clock shows during the test

    async def scenario():
        source = LiveSource(spec_of(twins), clock=lambda: fixed)
        await source.start()
        try:
            snap = await asyncio.wait_for(source.next_snapshot(), timeout=30)
            results = await source.apply(
                {twins.replicas[0].name: SettingsChange(policy="fcfs")}, who="t"
            )
        finally:
            await source.stop()
        return snap, results

    snap, results = asyncio.run(scenario())
    assert snap.t_ms == int(fixed * 1000)
    assert all(
        r.t_ms == int(fixed * 1000) for rs in snap.replicas.values() if (r := rs.sample) is not None
    )
    assert results and results[0].ok


def test_the_replica_panel_shows_the_simulators_error_band_known_at_that_time(recording):
    """A fidelity report stored for twin-0 30 s into the recording: replayed before that moment
    the replica panel says fidelity is not measured; after it, the band and the span."""
    store = Store.open(recording)
    start = store.readings.samples("fixture", "twin-0")[0].t_ms
    report = {"band": 0.125, "requests": 321, "overall": {"decision": {"spearman": 0.97}}}
    store.tuner.store_fidelity(
        "fixture", "twin-0", "db:#recording=x&replicas=twin-0", report, t_ms=start + 30_000
    )
    store.close()

    async def scenario():
        app = build_app(None, replay=recording)
        src: ReplaySource = app.source
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None, what="first snapshot")
            app.current_replica = "twin-0"
            await pilot.press("2")
            line = app.query_one("#fidelity-line")
            await wait_for(pilot, lambda: "not measured" in text_of(line), what="no report yet")
            src.seek(start + 40_000)
            await wait_for(pilot, lambda: "±12%" in text_of(line), what="the band after the report")
            assert "Spearman 0.97" in text_of(
                line
            ) and "321 requests of db:#recording=x" in text_of(line)

    run(scenario())


# ------------------------------------------------------------------------------------ governance


def test_live_alert_bar_and_alerts_panel_show_the_governance(twins):
    """A governed cluster whose tenants cannot meet a 1 ms P99 TTFT: the alert bar (on every
    panel) says SCR is critical; the alerts panel gives JFI beside JFI (seed) and lists each tenant
    against its targets with its ω. ``for_s`` 0: the alert fires on the first window instead of
    pending for 30 s."""
    from controlplane.governance import GovernanceSpec

    spec = spec_of(
        twins,
        governance=GovernanceSpec.model_validate(
            {"default_tenant": {"ttft": {"p99": 0.001}}, "alerts": {"for_s": 0}}
        ),
    )

    async def scenario():
        app = build_app(spec, refresh_s=0.25)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)
            bar = app.query_one("#alertbar")
            await wait_for(pilot, lambda: "ALERT SCR" in text_of(bar), what="the SCR alert")
            assert "(critical)" in text_of(bar) and bar.has_class("-firing")
            await pilot.press("6")
            table = app.query_one("#alerts-tenants")
            await wait_for(pilot, lambda: table.row_count >= 2, what="tenant rows")
            row = [getattr(c, "plain", c) for c in table.get_row_at(0)]
            assert (
                row[0].startswith("t") and "misses ttft_p99" in row[-1] and row[3].endswith("/1ms")
            )

            def shows_the_report() -> (
                bool
            ):  # the panel shows the collector's figures, none of its own
                g, first = (
                    app.snapshot.governance,
                    [getattr(c, "plain", c) for c in table.get_row_at(0)],
                )
                omega = fmt_figure(g["tenants"][first[0]]["omega"], 2)
                return (
                    f"JFI {fmt_figure(g['jfi'], 3)} · JFI (seed) {fmt_figure(g['jfi_seed'], 3)}"
                    in text_of(app.query_one("#alerts-figures"))
                    and first[8] == omega + (" over" if first[0] in g["over_consumers"] else "")
                )

            await wait_for(
                pilot, shows_the_report, what="JFI, JFI (seed) and ω from the governance report"
            )
            await pilot.press("2")
            assert "ALERT SCR" in text_of(bar)  # the bar stays on every panel

            def replica_reads_the_report() -> bool:
                # the replica panel's JFIs: the cluster's report
                g = app.snapshot.governance
                return (
                    f"cluster: JFI {fmt_figure(g['jfi'], 3)} · "
                    f"JFI (seed) {fmt_figure(g['jfi_seed'], 3)}"
                    in text_of(app.query_one("#fairness"))
                )

            await wait_for(
                pilot, replica_reads_the_report, what="the replica panel's JFI and JFI (seed)"
            )

    run(scenario())


def test_replayed_alerts_are_those_firing_at_the_position(recording):
    from storage.rows import AlertRow, Batch, GovernanceRow

    store = Store.open(recording)
    start = store.readings.samples("fixture", "twin-0")[0].t_ms
    figures = {
        "scr": 0.5,
        "jfi": 0.97,
        "type_fairness_min": None,
        "requests": 10,
        "tenants": {
            "acme": {
                "ttft_p50": 0.2,
                "ttft_p90": 0.5,
                "ttft_p99": 3.0,
                "ttlt_p99": 9.0,
                "limits": {"ttft_p99": 2.0},
                "missed": ["ttft_p99"],
                "compliant": False,
                "tok_s": 50.0,
                "normalised": 0.5,
            }
        },
        "types": {},
    }
    store.recordings.write(
        "fixture",
        Batch(
            governance=[GovernanceRow(t_ms=start + 20_000, summary=figures)],
            alerts=[
                AlertRow(
                    t_ms=start + 20_000,
                    name="scr",
                    severity="critical",
                    state="firing",
                    summary={"value": 0.5, "threshold": 0.9, "missed": {"acme": ["ttft_p99"]}},
                ),
                AlertRow(
                    t_ms=start + 50_000,
                    name="scr",
                    severity="critical",
                    state="resolved",
                    summary={"value": 1.0, "threshold": 0.9},
                ),
            ],
        ),
    )
    store.close()

    async def scenario():
        app = build_app(None, replay=recording)
        src: ReplaySource = app.source
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None, what="first snapshot")
            bar = app.query_one("#alertbar")
            src.seek(start + 10_000)
            await wait_for(
                pilot, lambda: app.snapshot.t_ms <= start + 10_000, what="the early position"
            )
            assert not bar.has_class(
                "-shown"
            )  # nothing stored yet: not governed as far as replay knows
            src.seek(start + 30_000)
            await wait_for(
                pilot, lambda: "ALERT SCR 0.5 (critical)" in text_of(bar), what="the firing alert"
            )
            await pilot.press("6")
            history = app.query_one("#alerts-history")
            await wait_for(pilot, lambda: history.row_count == 1, what="one transition so far")
            src.seek(start + 55_000)
            await wait_for(pilot, lambda: "no alerts" in text_of(bar), what="resolved")
            await wait_for(pilot, lambda: history.row_count == 2, what="both transitions")

    run(scenario())


def test_the_operator_pauses_the_governor_from_the_alerts_panel(twins, tmp_path):
    from controlplane.governance import GovernanceSpec

    store = Store.open(str(tmp_path / "gov.db"))
    spec = spec_of(twins, governance=GovernanceSpec())

    async def scenario():
        app = build_app(spec, store=store, refresh_s=0.25)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)
            await pilot.press("6")
            line = app.query_one("#alerts-governor")
            await wait_for(
                pilot, lambda: "governor: dry-run" in text_of(line), what="the governor line"
            )
            await pilot.press("G")
            await wait_for(
                pilot, lambda: app.screen.query("#governor-options"), what="the governor dialog"
            )
            await pilot.press("enter")  # the first choice: pause
            await wait_for(
                pilot,
                lambda: store.governance.control("governor", "twins")["paused"],
                what="paused in the store",
            )
            assert store.governance.control("governor", "twins")["who"].startswith("tui:")
            await wait_for(pilot, lambda: "(paused)" in text_of(line), what="shown paused")

    try:
        run(scenario())
    finally:
        store.close()
