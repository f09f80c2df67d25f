"""The TUI's pieces without twins: the key table (bindings, help, palette, read-only), settings
edits through the settings model, seeking, render functions, the replay source, the cluster
table's row cache and the panels' contract (reactive data down, messages up)."""

from __future__ import annotations

import ast
import asyncio
import shutil
from pathlib import Path

import pytest
from rich.text import Text
from textual.command import CommandList, CommandPalette
from textual.widgets import SelectionList
from tui_support import wait_for  # tests/tui_support.py

from scheduler.metrics import jain_index, slo_compliance_ratio
from scheduler.settings import ADAPTIVE_PARAMS, PARAM_MODELS, Settings
from scheduler.settings_change import SettingsChange
from storage.rows import GroupSampleRow, LatencyPercentiles, SampleRow
from storage.store import Store
from tui import keys as K
from tui import render as R
from tui.app import TailpilotApp
from tui.cluster_panel import ClusterPanel
from tui.dialogs import ConfirmScreen
from tui.edits import (
    edit_targets,
    field_errors,
    parse_field,
    pin_edit,
    policy_fields,
    settings_diff,
    try_apply,
)
from tui.main import build_app
from tui.policy_panel import PolicyPanel
from tui.replay import ReplaySource, parse_seek
from tui.widgets import ClusterTable

FIXTURE = Path(__file__).parent / "fixtures" / "recording_small.db"
T0 = 1_700_000_000_000


# ------------------------------------------------------------------------------------------ keys


def test_bindings_help_and_palette_come_from_the_one_key_table():
    app_bindings = {(b.key, b.action) for b in TailpilotApp.BINDINGS}
    table = {(k.key, k.action) for k in K.KEYS if k.bind and k.scope == "app"}
    assert app_bindings == table
    assert {(b.key, b.action) for b in ConfirmScreen.BINDINGS} == {
        (k.key, k.action) for k in K.KEYS if k.scope == "confirm"
    }
    # Every action of the table exists where it is bound.
    for k in K.KEYS:
        if k.bind:
            owner = ConfirmScreen if k.scope == "confirm" else TailpilotApp
            assert callable(getattr(owner, f"action_{k.action_name}", None)), k
    # Help lists every key, in its group.
    listed = {
        (group, key)
        for group, rows in K.help_rows(readonly=False, mode="live")
        for key, _d, _n in rows
    }
    assert listed == {(k.group, k.display) for k in K.KEYS}


def test_operator_conventions():
    by_display = {k.display: k for k in K.KEYS}
    assert by_display["?"].action == "help" and by_display["q"].action == "quit"
    assert by_display["p"].action == "toggle_pause" and by_display["/"].action == "filter"
    assert [by_display[str(i)].action for i in range(1, len(K.PANELS) + 1)] == [
        f"panel('{p}')" for p in K.PANELS
    ]
    changing = [k for k in K.KEYS if k.changes_cluster]
    assert changing and all(len(k.display) == 1 and k.display.isupper() for k in changing)
    assert all(
        k.display.isupper() is False
        for k in K.KEYS
        if not k.changes_cluster and len(k.display) == 1 and k.display.isalpha()
    )


def test_help_marks_cluster_changes_refused_when_read_only():
    rows = {
        key: note for _g, rs in K.help_rows(readonly=True, mode="replay") for key, _d, note in rs
    }
    assert all(rows[k.display].startswith("REFUSED") for k in K.KEYS if k.changes_cluster)
    live = {
        key: note for _g, rs in K.help_rows(readonly=False, mode="live") for key, _d, note in rs
    }
    assert live["P"] == "asks for confirmation" and "replay only" in live["["]


def test_command_palette_runs_key_actions_and_refuses_when_read_only(tmp_path):
    db = tmp_path / "rec.db"
    shutil.copy(FIXTURE, db)

    async def scenario():
        app = build_app(None, replay=str(db))
        async with app.run_test(size=(160, 48)) as pilot:
            while app.snapshot is None:
                await pilot.pause(0.02)
            provider = K.KeyCommands(app.screen)
            labels = [hit.text async for hit in provider.discover()]
            assert "Replica panel (the replica under the cursor)" in labels
            assert any(t.startswith("Switch the policy") and "read-only" in t for t in labels)
            assert not any(
                "Apply the change shown" in t for t in labels
            )  # dialog keys stay in the dialog
            await pilot.press("ctrl+p")
            await wait_for(
                pilot, lambda: isinstance(app.screen, CommandPalette), what="the palette"
            )
            await pilot.press(*"audit log")
            # The hits arrive from a background search: enter once the first is highlighted.
            await wait_for(
                pilot,
                lambda: app.screen.query_one(CommandList).highlighted is not None,
                what="a highlighted hit",
            )
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.panel == "audit", what="the audit panel")
            hits = [h async for h in provider.search("switch policy")]
            await hits[0].command()
            assert app.refused == ["switch_policy"]

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------ edits


def test_settings_edit_semantics():
    uni = Settings.model_validate(
        {
            "policy": "uniboost",
            "params": {"gamma": 7.0, "quant_ratio": 3.0},
            "pinned": ["gamma"],
            "engine": {"max_num_seqs": 32},
        }
    )
    # Same policy: parameters merge, pins add/remove, the engine stays.
    s = SettingsChange(
        params={"quant_ratio": 4.0},
        pin=frozenset({"quant_base_tokens"}),
        unpin=frozenset({"gamma"}),
    ).apply(uni)
    assert (
        s.param("gamma") == 7.0
        and s.param("quant_ratio") == 4.0
        and s.pinned == ("quant_base_tokens",)
    )
    assert s.engine.max_num_seqs == 32
    # A switch starts from the new policy's defaults (as Settings.replace does).
    t = SettingsChange(policy="tie", params={"beta": 0.3}).apply(uni)
    assert (
        t.policy == "tie"
        and t.param("beta") == 0.3
        and t.pinned == ()
        and t.engine.max_num_seqs == 32
    )
    assert t.to_dict()["params"] == {
        **Settings.model_validate({"policy": "tie"}).to_dict()["params"],
        "beta": 0.3,
    }
    # Invalid: the settings model's message, naming the field.
    new, err = try_apply(SettingsChange(params={"gamma": 0}), uni)
    assert new is None and "params.gamma" in err and "greater than or equal to 0.000001" in err
    new, err = try_apply(SettingsChange(pin=frozenset({"nope"})), uni)
    assert new is None and "nope" in err


def test_policy_fields_cover_every_parameter_of_every_policy():
    for policy, model in PARAM_MODELS.items():
        fields = policy_fields(policy)
        assert [f.name for f in fields] == list(model.model_fields), policy
        assert {f.name for f in fields if f.adaptive} == set(ADAPTIVE_PARAMS.get(policy, ()))
    kinds = {f.name: f.kind for f in policy_fields("uniboost")}
    assert (
        kinds["memguard"] == "bool"
        and kinds["quant_base_tokens"] == "int"
        and kinds["gamma"] == "float"
    )
    assert {f.name: f.kind for f in policy_fields("tie")}["predictor"] == "choice"
    assert {f.name: f.kind for f in policy_fields("vtc")}["weights"] == "json"
    gamma = next(f for f in policy_fields("uniboost") if f.name == "gamma")
    assert "≥ 1e-06" in gamma.hint and "default 0.1" in gamma.hint


def test_field_parsing_and_error_placement():
    gamma = next(f for f in policy_fields("uniboost") if f.name == "gamma")
    weights = next(f for f in policy_fields("vtc") if f.name == "weights")
    assert parse_field(gamma, "8") == 8 and parse_field(gamma, "abc") == "abc"
    assert parse_field(weights, '{"acme": 2}') == {"acme": 2}
    _, err = try_apply(
        SettingsChange(params={"gamma": "abc", "quant_ratio": 0.5}),
        Settings.model_validate({"policy": "uniboost"}),
    )
    where = field_errors(err, ["gamma", "quant_ratio", "memguard"])
    assert (
        set(where) == {"gamma", "quant_ratio"}
        and "number" in where["gamma"]
        and "greater than 1" in where["quant_ratio"]
    )


def test_pin_edit():
    uni = Settings.model_validate({"policy": "uniboost"})
    edit, what = pin_edit(uni, "uniboost", {"gamma": 12.34567, "beta": None})
    assert (
        edit == SettingsChange(params={"gamma": 12.35}, pin=frozenset({"gamma"}))
        and "12.35" in what
    )
    pinned = edit.apply(uni)
    assert pinned.is_pinned("gamma")
    assert pin_edit(pinned, "uniboost", {"gamma": 50.0})[0] == SettingsChange(
        unpin=frozenset({"gamma"})
    )
    assert pin_edit(Settings.model_validate({"policy": "tie"}), "tie", {"beta": 0.25})[
        0
    ].params == {"beta": 0.25}
    edit, why = pin_edit(Settings.model_validate({"policy": "fcfs"}), "fcfs", {})
    assert edit is None and "no adaptive parameter" in why


def test_settings_diff():
    old = Settings.model_validate({"policy": "sarathi", "engine": {"max_num_seqs": 32}}).to_dict()
    new = (
        SettingsChange(policy="uniboost", params={"quant_ratio": 4.0})
        .apply(Settings.model_validate(old))
        .to_dict()
    )
    assert settings_diff(old, new) == [
        ("policy", "sarathi", "uniboost"),
        ("params.quant_ratio", "default", "4"),
    ]
    pinned = SettingsChange(params={"gamma": 8.0}, pin=frozenset({"gamma"})).apply(
        Settings.model_validate(new)
    )
    assert settings_diff(new, pinned.to_dict()) == [
        ("params.gamma", "0.1", "8"),
        ("pinned", "[]", '["gamma"]'),
    ]


# ------------------------------------------------------------------------------------------ seeking


def test_parse_seek():
    kw = {"position_ms": T0 + 30_000, "start_ms": T0, "end_ms": T0 + 100_000}
    assert parse_seek("+10s", **kw) == T0 + 40_000 and parse_seek("-1m", **kw) == T0 - 30_000
    assert parse_seek("@1:30", **kw) == T0 + 90_000 and parse_seek("@42.5", **kw) == T0 + 42_500
    assert parse_seek("start", **kw) == T0 and parse_seek("end", **kw) == T0 + 100_000
    assert parse_seek("22:14:00", **kw) == T0 + 40_000  # UTC wall clock on the recording's day
    assert parse_seek("2023-11-14T22:13:50", **kw) == T0 + 30_000
    assert parse_seek("2023-11-14T23:13:50+01:00", **kw) == T0 + 30_000
    assert parse_seek(str(T0 + 5), **kw) == T0 + 5
    with pytest.raises(ValueError, match="cannot read"):
        parse_seek("soon", **kw)


# ------------------------------------------------------------------------------------------ render


def test_sparkline_is_on_a_fixed_scale():
    assert R.sparkline([0.0, 0.5, 1.0], width=3) == "▁▅█"
    assert R.sparkline([], width=4) == "    " and R.sparkline([1.0], width=3) == "  █"
    assert R.sparkline([0.1] * 20, width=5) == "▁" * 5


def group(
    tenant: str, tok_s: float, ttft_p99: float, ttlt_p99: float, kind: str = "tenant"
) -> GroupSampleRow:
    return GroupSampleRow(
        "r", 0, kind, tenant, 10, tok_s, LatencyPercentiles(ttft_p99=ttft_p99, ttlt_p99=ttlt_p99)
    )


def test_tenant_table_gives_the_replicas_scr_and_the_clusters_jfis():
    groups = [
        group("a", 100.0, 0.5, 10.0),
        group("b", 300.0, 3.0, 10.0),
        group("c", 200.0, 0.4, 50.0),
        group("chat", 600.0, 1.0, 20.0, kind="type"),
    ]
    slos = {"ttft_p99": 1.0, "ttlt_p99": 20.0}
    rows, summary = R.tenant_table(groups, slos, {"jfi": 0.9, "jfi_seed": 0.64})
    assert [r[0] for r in rows] == ["a", "b", "c"]
    assert [r[-1].plain for r in rows] == ["meets", "MISSES", "MISSES"]
    per = {
        g.group: {"ttft_p99": g.latency.ttft_p99, "ttlt_p99": g.latency.ttlt_p99}
        for g in groups[:3]
    }
    scr = slo_compliance_ratio(per, slos)
    assert f"SCR {scr:.2f}" in summary.plain
    # JFI is the governance report's (one implementation): not Jain's index of these throughputs
    assert "cluster: JFI 0.9 · JFI (seed) 0.64" in summary.plain
    assert f"{jain_index([100.0, 300.0, 200.0]):.3f}" not in summary.plain
    _, none = R.tenant_table(groups, {})
    assert "no slos" in none.plain and "JFI — (not governed)" in none.plain


def test_type_shares_and_change_markers():
    groups = [group("chat", 300.0, 1, 1, kind="type"), group("batch", 100.0, 1, 1, kind="type")]
    assert [(r[0], r[3]) for r in R.type_share_rows(groups)] == [("batch", "25%"), ("chat", "75%")]
    hist = [
        SampleRow("r", t, True, policy=p, settings_version=v)
        for t, p, v in (
            (0, "sarathi", 1),
            (1000, "sarathi", 1),
            (2000, "uniboost", 2),
            (3000, "uniboost", 2),
            (4000, "uniboost", 3),
        )
    ]
    assert R.change_markers(hist) == [2000, 4000]
    audit = [
        {"t_ms": 1900, "replica": "r", "result": "applied"},
        {"t_ms": 2500, "replica": "x", "result": "applied"},
        {"t_ms": 500, "replica": "r", "result": "rejected"},
    ]
    assert R.change_markers(hist, audit, "r") == [2000, 4000]  # 1900 is the same change as 2000


def test_sort_key_puts_missing_values_last():
    from controlplane.snapshot import Health, ReplicaSnapshot

    def rs(name, ttlt):
        row = SampleRow(name, 0, True, latency=LatencyPercentiles(ttlt_p99=ttlt))
        return ReplicaSnapshot(name, Health(True, None), row, [], None, None, None, {}, 0, 0)

    reps = [rs("a", 2.0), rs("b", None), rs("c", 5.0)]
    assert [r.name for r in sorted(reps, key=R.sort_key("ttlt"))] == ["a", "c", "b"]


def test_replica_header_shows_a_staged_settings_version():
    from controlplane.snapshot import Health, ReplicaSnapshot
    from scheduler import contract

    row = SampleRow("r", 0, True, policy="fcfs", settings_version=3)
    settings = {"policy": "fcfs", "params": {}}

    def header(pending):
        state = contract.State(completions=[], next_cursor=0, pending_version=pending)
        return R.replica_header(
            ReplicaSnapshot("r", Health(True, None), row, [], settings, 3, state, {}, 0, 0)
        ).plain

    assert "(settings v3)" in header(None) and "staged" not in header(None)
    assert "(settings v3) v4 staged" in header(4)


# ------------------------------------------------------------------------------------------ replay


@pytest.fixture
def store(tmp_path):
    db = tmp_path / "rec.db"
    shutil.copy(FIXTURE, db)
    s = Store.open(str(db))
    yield s
    s.close()


def test_replay_source_seek_step_and_settings(store):
    src = ReplaySource(store)
    ticks = [s.t_ms for s in store.readings.samples("fixture", "twin-0")]
    assert src.cluster_name == "fixture" and src.ticks == ticks and src.position == ticks[0]
    assert src.seek(0) == ticks[0] and src.seek(10**15) == ticks[-1]
    src.seek(T0 + 42_500)
    p1 = src.step(1)
    assert p1 == min(t for t in ticks if t > T0 + 42_500)
    assert src.step(-2) == ticks[ticks.index(p1) - 2]
    assert src.step(-1000) == ticks[0] and src.step(1000) == ticks[-1]
    for at in (T0 + 10_000, T0 + 75_000, T0 + 99_999):
        snap = src.snapshot_at(at)
        assert {n: rs.sample for n, rs in snap.replicas.items()} == store.readings.latest_samples(
            "fixture", at
        )
        for rs in snap.replicas.values():
            assert [g for g in rs.groups] == store.readings.group_samples(
                "fixture", rs.name, rs.sample.t_ms, rs.sample.t_ms + 1
            )
    assert src.settings_at("twin-1", T0 + 29_000) is None
    assert src.settings_at("twin-1", T0 + 40_000)["policy"] == "uniboost"
    assert src.settings_at("twin-1", T0 + 60_000)["pinned"] == ["gamma"]
    assert src.settings_at("twin-0", T0 + 99_000) is None  # bob's change was rejected
    hist = src.history("twin-1", T0 + 60_000)
    assert hist == store.readings.samples("fixture", "twin-1", T0 + 60_000 - 600_000, T0 + 60_001)
    assert asyncio.run(src.audit()) == store.settings_log.settings_changes("fixture")[:4]


def test_replay_settings_come_from_what_the_replicas_ran(store):
    """Settings the collector saw win over the audit log from the first one on; before it, the
    audit log is all a recording has."""
    from storage.rows import Batch, SettingsSeenRow

    seen = [
        SettingsSeenRow("twin-1", T0 + 50_000, 7, "i1", {"policy": "las", "params": {}}),
        SettingsSeenRow("twin-1", T0 + 70_000, 8, "i1", {"policy": "vtc", "params": {}}),
    ]
    store.recordings.write("fixture", Batch(settings_seen=seen))
    src = ReplaySource(store)
    assert (
        src.settings_at("twin-1", T0 + 40_000)["policy"] == "uniboost"
    )  # the audit log, before any seen row
    assert src.settings_at("twin-1", T0 + 50_000)["policy"] == "las"
    assert (
        src.settings_at("twin-1", T0 + 69_999)["policy"] == "las"
    )  # not the audit log's later pin
    assert src.settings_at("twin-1", T0 + 99_000)["policy"] == "vtc"
    assert src.snapshot_at(T0 + 75_000).replicas["twin-1"].settings["policy"] == "vtc"
    assert src.settings_at("twin-0", T0 + 99_000) is None


def test_replay_refuses_a_store_without_the_cluster(store):
    from tui.sources import ReplayError

    with pytest.raises(ReplayError, match="no cluster 'prod'"):
        ReplaySource(store, "prod")


# ------------------------------------------------------------------------------------------ table


def test_cluster_table_re_renders_only_changed_rows():
    from textual.app import App

    cols = [("name", "name", 6, False), ("v", "v", 4, True)]

    class T(App):
        def compose(self):
            yield ClusterTable(cols, id="t")

    async def scenario():
        app = T()
        async with app.run_test(size=(40, 12)) as pilot:
            t = app.query_one(ClusterTable)
            names = [f"r{i}" for i in range(8)]
            t.set_rows(names, {n: (n, str(i)) for i, n in enumerate(names)})
            await pilot.pause()
            first = t.renders
            assert first == 8
            cells = {n: (n, str(i)) for i, n in enumerate(names)}
            cells["r3"] = ("r3", Text("99", style="red"))
            t.set_rows(names, cells)
            await pilot.pause()
            assert t.renders == first + 1  # only r3
            assert t.get_cell("r3", "v").plain == "99"
            await pilot.press("down")  # cursor moves from r0 to r1: two rows
            await pilot.pause()
            assert t.renders == first + 3 and t.cursor_key == "r1"
            t.set_rows(list(reversed(names)), cells)  # reordered: the cursor stays on r1
            await pilot.pause()
            assert t.cursor_key == "r1" and t.cursor_row == 6

    asyncio.run(scenario())


def test_triplets_show_missing_values_as_dashes():
    assert R.fmt_triplet(None, float("nan"), 0.5) == "—/—/500ms"


# ------------------------------------------------------------------ panels: data down, messages up


def test_panels_read_no_app_state():
    """A panel shows the reactive data the app sets on it and posts messages for what the operator
    asks: none reaches into the app (``self.app``)."""
    for path in sorted((Path(__file__).parent.parent / "tui").glob("*_panel.py")):
        uses = [
            n.lineno
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute)
            and n.attr == "app"
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
        ]
        assert not uses, (path.name, uses)


def test_edit_targets_are_the_known_selected_replicas_else_the_cursors():
    assert edit_targets(frozenset({"b", "a", "gone"}), "c", {"a": 1, "b": 2}) == ["a", "b"]
    assert edit_targets(frozenset({"b", "gone"}), "c", None) == ["b", "gone"]  # no snapshot yet
    assert edit_targets(frozenset(), "c", {"a": 1}) == ["c"]
    assert edit_targets(frozenset(), None, None) == []


def test_the_policy_panels_targets_list_selects_through_the_app(tmp_path):
    """Toggling a replica in the policy panel's targets list is a message to the app: the app's
    selection follows, the panels bound to it follow the app's, and the form its first target."""
    db = tmp_path / "rec.db"
    shutil.copy(FIXTURE, db)

    async def wait(pilot, cond) -> None:
        for _ in range(200):
            if cond():
                return
            await pilot.pause(0.05)
        assert cond()

    async def scenario():
        app = build_app(None, replay=str(db), start_ms=T0 + 60_000)
        async with app.run_test(size=(160, 48)) as pilot:
            await wait(pilot, lambda: app.snapshot is not None)
            await pilot.press("3")
            panel = app.query_one(PolicyPanel)
            await wait(pilot, lambda: panel.form_policy is not None)
            assert (
                panel.targets == (app.current_replica,) and panel.reference == app.current_replica
            )
            panel.query_one("#targets", SelectionList).select("twin-2")
            banner = panel.query_one("#policy-banner")
            await wait(pilot, lambda: app.selected and "twin-2's settings" in str(banner.content))
            assert (
                app.selected == {"twin-2"}
                and app.targets() == ["twin-2"]
                and panel.reference == "twin-2"
            )
            assert app.query_one(ClusterPanel).selected == {"twin-2"} and panel.targets == (
                "twin-2",
            )
            assert "1 selected" in str(app.query_one("#topbar").content)

    asyncio.run(scenario())
