"""The autopilot in the TUI: its control row (``GovernanceRepository.control``, written by
``tailpilot record --autopilot``) shown in the alerts panel — state, why it holds, per replica the
candidate it runs and why, its last decisions — and ``O`` steering it through the store; refused
read-only; nothing shown in a replay (its control row is not history).

The live app runs on a store and replicas that answer nothing (a closed loopback port): the block
comes from the store alone, and the refreshes from the collector's (failed) polls."""

from __future__ import annotations

import asyncio
import io
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from tui_support import wait_for  # tests/tui_support.py

from controlplane.cluster import ClusterSpec, ReplicaSpec
from scheduler.settings import Settings
from storage.store import Store
from tui import autopilot_render as AR
from tui import keys as K
from tui.app import TailpilotApp
from tui.main import build_app
from tui.sources import LiveSource

SIZE = (160, 48)
FIXTURE = Path(__file__).parent / "fixtures" / "recording_small.db"
T0 = 1_700_000_000_000  # 2023-11-14 22:13:20 UTC
SPEC = ClusterSpec(
    name="pilots",
    poll_interval_s=0.25,
    timeout_s=1.0,
    window_s=30.0,
    replicas=[
        ReplicaSpec(name=f"r{i}", api_url="http://127.0.0.1:1", control_url="http://127.0.0.1:1")
        for i in range(2)
    ],
)

SWITCH = {
    "t": 1250.0,
    "choice": "gamma=0.01",
    "previous": "defaults",
    "changed": True,
    "reason": "gamma=0.01 beats defaults by 12% on P95 TTFT",
    "requests": 840,
    "cpu_s": 0.31,
    "predicted": {"ttft_p95": -0.123, "ttft_p99": -0.08, "ttlt_p99": 0.01, "throughput_tok_s": 0.0},
}
KEEP = {
    "t": 1310.0,
    "choice": "gamma=0.01",
    "previous": None,
    "changed": False,
    "reason": "no candidate beats gamma=0.01 by 7.5%",
    "requests": 900,
    "cpu_s": 0.2,
    "predicted": {},
}


def status(
    t_ms: int, *, held: str | None = None, note: str = "dry-run: would run gamma=0.01"
) -> dict:
    """A report as ``LiveAutopilot.status`` writes it: r0 steered, r1 not (its policy)."""
    return {
        "t_ms": t_ms,
        "held": held,
        "replicas": {
            "r0": {
                "choice": "gamma=0.01",
                "note": note,
                "late": 0,
                "worse_in_row": 0,
                "pending_verifications": 1,
                "last": [SWITCH, KEEP],
                "verifications": [
                    {
                        "id": 3,
                        "predicted": -0.1,
                        "realized": -0.07,
                        "band": 0.1,
                        "verdict": "as predicted",
                    }
                ],
            },
            "r1": {"note": "runs slofq: the autopilot steers uniboost and sarathi replicas only"},
        },
    }


def plain(renderable) -> str:
    console = Console(width=300, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def text_of(widget) -> str:
    return plain(widget.content)


class Clock:
    """The live source's clock, moved by the test (seconds since the epoch)."""

    def __init__(self, t_ms: int) -> None:
        self.t = t_ms / 1000

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store(tmp_path):
    s = Store.open(str(tmp_path / "live.db"))
    yield s
    s.close()


def live_app(store, clock: Clock, readonly: bool = False) -> TailpilotApp:
    source = LiveSource(SPEC, store, refresh_s=0.25, clock=clock)
    app = TailpilotApp(source, SPEC, store=store, readonly=readonly)
    source.who = app.who
    return app


# ------------------------------------------------------------------------------------- render


def test_the_block_shows_state_held_choice_note_and_decisions():
    row = {
        "cluster": "pilots",
        "state": "armed",
        "paused": True,
        "who": "tui:ana",
        "updated_ms": T0,
        "status": status(T0, held="paused by tui:ana", note="held: paused by tui:ana"),
    }
    text = plain(AR.autopilot_renderable(row, now_ms=T0 + 5_000))
    head = text.splitlines()[0]
    assert head.startswith(
        "autopilot: armed (paused) · set by tui:ana · held: paused by tui:ana"
    ), head
    assert "report 22:13:20 UTC" in head and "ago" not in head
    assert "r0  running gamma=0.01 · held: paused by tui:ana" in text
    assert (
        "1 switch(es) awaiting verification" in text
        and "last verified: as predicted (P95 TTFT -7% realized" in text
    )
    assert "r1  runs slofq: the autopilot steers uniboost and sarathi replicas only" in text
    lines = text.splitlines()
    switch = next(line for line in lines if "switch" in line and "defaults → gamma=0.01" in line)
    assert (
        "1250" in switch
        and "-12%" in switch
        and "840" in switch
        and "beats defaults by 12%" in switch
    )
    keep = next(line for line in lines if " keep " in line)
    # Newest first; a kept choice predicts no change.
    assert lines.index(keep) < lines.index(switch) and "—" in keep and "1310" in keep


def test_the_block_says_when_there_is_no_report_or_an_old_one():
    fresh = {"cluster": "pilots", "state": "dry-run", "paused": False, "who": None, "status": None}
    assert "no report yet (it runs in tailpilot record --autopilot)" in plain(
        AR.autopilot_renderable(fresh, T0)
    )
    old = {**fresh, "status": status(T0)}
    text = plain(AR.autopilot_line(old, T0 + 10 * 60_000))
    assert "10 min ago: is tailpilot record --autopilot still running?" in text
    assert "no report" not in text and "held" not in text
    # Disarmed: the state says it; no "held: disarmed" beside it.
    off = {**fresh, "state": "disarmed", "status": {"t_ms": T0, "held": "disarmed", "replicas": {}}}
    assert "held" not in plain(AR.autopilot_line(off, T0))
    assert "not known here" in plain(AR.autopilot_renderable(None))


def test_O_is_a_cluster_change_of_the_alerts_panel():
    [k] = [k for k in K.KEYS if k.display == "O"]
    assert k.action == "autopilot" and k.changes_cluster and k.screens == ("alerts",)
    assert callable(TailpilotApp.action_autopilot)


# ------------------------------------------------------------------------------------- live


def test_the_alerts_panel_shows_the_autopilot_and_O_arms_it(store):
    clock = Clock(T0)
    store.governance.set_control("autopilot", "pilots", status=status(T0 - 5_000), t_ms=T0 - 5_000)

    async def scenario():
        app = live_app(store, clock)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("6")
            block = app.query_one("#alerts-autopilot")
            body = app.query_one("#autopilot-body")
            await wait_for(
                pilot, lambda: "autopilot: dry-run" in text_of(body), what="the autopilot block"
            )
            assert block.display and block.has_class("-shown")
            shown = text_of(body)
            assert (
                "report 22:13:15 UTC" in shown
                and "running gamma=0.01 · dry-run: would run gamma=0.01" in shown
            )
            assert "defaults → gamma=0.01" in shown and "-12%" in shown
            # A new report of the driver is shown at the next refresh; an old one is flagged.
            clock.t += 600
            store.governance.set_control(
                "autopilot", "pilots", status=status(T0 + 590_000, note="applied: gamma=0.1")
            )
            await wait_for(
                pilot, lambda: "applied: gamma=0.1" in text_of(body), what="the new report"
            )
            assert "ago" not in text_of(body)
            clock.t += 600
            await wait_for(
                pilot, lambda: "still running?" in text_of(body), what="the stale report flagged"
            )

            await pilot.press("O")
            options = await wait_for(
                pilot, lambda: app.screen.query("#autopilot-options"), what="the dialog"
            )
            opts = options.first()
            ids = [opts.get_option_at_index(i).id for i in range(opts.option_count)]
            assert ids == ["arm", "dry-run", "disarm", "pause"]  # not paused: no resume
            assert "(now)" in str(opts.get_option_at_index(1).prompt)
            await pilot.press("enter")  # the first choice: arm
            await wait_for(
                pilot,
                lambda: store.governance.control("autopilot", "pilots")["state"] == "armed",
                what="armed",
            )
            row = store.governance.control("autopilot", "pilots")
            assert row["who"] == app.who and row["who"].startswith("tui:") and not row["paused"]
            assert (
                row["status"]["replicas"]["r0"]["note"] == "applied: gamma=0.1"
            )  # the driver's report kept
            await wait_for(
                pilot, lambda: text_of(body).startswith("autopilot: armed"), what="shown armed"
            )
            assert app.refused == []

            # Pause: the dialog then offers resume instead.
            await pilot.press("O")
            await wait_for(
                pilot, lambda: app.screen.query("#autopilot-options"), what="the dialog again"
            )
            await pilot.press("down", "down", "down", "enter")
            await wait_for(
                pilot,
                lambda: store.governance.control("autopilot", "pilots")["paused"],
                what="paused",
            )
            assert store.governance.control("autopilot", "pilots")["state"] == "armed"
            await wait_for(pilot, lambda: "(paused)" in text_of(body), what="shown paused")
            await pilot.press("O")
            options = await wait_for(
                pilot, lambda: app.screen.query("#autopilot-options"), what="the dialog"
            )
            opts = options.first()
            assert [opts.get_option_at_index(i).id for i in range(opts.option_count)] == [
                "arm",
                "dry-run",
                "disarm",
                "resume",
            ]
            await pilot.press("escape")
            await wait_for(
                pilot, lambda: not app.screen.query("#autopilot-options"), what="dismissed"
            )
            assert store.governance.control("autopilot", "pilots")["paused"]  # escape sends nothing

    asyncio.run(scenario())


def test_readonly_shows_the_autopilot_and_refuses_O(store):
    store.governance.set_control("autopilot", "pilots", status=status(T0), t_ms=T0)
    before = store.governance.control("autopilot", "pilots")

    async def scenario():
        app = live_app(store, Clock(T0), readonly=True)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("6")
            body = app.query_one("#autopilot-body")
            await wait_for(
                pilot, lambda: "autopilot: dry-run" in text_of(body), what="the autopilot block"
            )
            await pilot.press("O")
            await pilot.pause(0.2)
            assert app.refused == ["autopilot"]
            assert not app.screen.query("#autopilot-options")
            assert any("refused: --readonly" in n.message for n in app._notifications)
            assert app.check_action("autopilot", ()) is None  # greyed in the footer, not hidden

    asyncio.run(scenario())
    assert store.governance.control("autopilot", "pilots") == before


def test_a_live_view_without_a_store_has_no_autopilot_to_steer():
    async def scenario():
        app = build_app(SPEC, refresh_s=0.25)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("6")
            await wait_for(pilot, lambda: app.snapshot is not None, what="a snapshot")
            await pilot.press("O")
            await wait_for(
                pilot,
                lambda: any("no autopilot here" in n.message for n in app._notifications),
                what="the notice",
            )
            assert not app.query_one("#alerts-autopilot").has_class("-shown")
            assert not app.screen.query("#autopilot-options")

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------- replay


def test_a_replay_shows_no_autopilot_and_refuses_O(tmp_path):
    db = tmp_path / "rec.db"
    shutil.copy(FIXTURE, db)
    with Store.open(str(db)) as s:  # a row in the recording: still not history, not shown
        s.governance.set_control("autopilot", "fixture", state="armed", status=status(T0), t_ms=T0)

    async def scenario():
        app = build_app(None, replay=str(db))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None, what="the first snapshot")
            assert await app.source.control("autopilot") is None
            await pilot.press("6")
            await wait_for(
                pilot,
                lambda: "governor: not known here" in text_of(app.query_one("#alerts-governor")),
                what="the alerts panel filled",
            )
            block = app.query_one("#alerts-autopilot")
            assert not block.has_class("-shown") and not block.display
            assert app.check_action("autopilot", ()) is False  # hidden in the footer
            await pilot.press("O")
            await pilot.pause(0.1)
            assert app.refused == ["autopilot"] and not app.screen.query("#autopilot-options")

    asyncio.run(scenario())


# ------------------------------------------------------------------------------- the demo


def test_the_demos_first_screen_shows_the_autopilot_its_promise_and_the_tenants(
    tmp_path, monkeypatch
):
    """``tailpilot demo``'s TUI: real twins (sarathi and uniboost side by side, three Zipf
    tenants), the demo's autopilot (armed on the uniboost replica, dry-run on the sarathi one) and
    governor (dry-run) running beside the app's collector. The strip above the cluster table
    shows the autopilot's decisions on data, per replica whether it is armed, the promise its
    report gives, the tenants' SCR and JFI and the governor; the alerts panel (6) the same in full,
    the strip then hidden."""
    from sim import traces
    from tailpilot.cli_twin import DEMO_TOKEN_ENV, demo_controllers, demo_governance
    from tuner.autopilot.controller import AutopilotConfig
    from tuner.autopilot.live import LiveConfig
    from tuner.twins.cluster import start_twins

    monkeypatch.setenv(DEMO_TOKEN_ENV, "demo-tui-token")
    trace = traces.assign_tenants_zipf(
        traces.time_window(traces.load_bundled(), 0.0, 120.0), 3, seed=0
    )
    docs = [Settings.model_validate({"policy": p}) for p in ("sarathi", "uniboost")]
    # The demo's pacing on a smaller grid (two fixed γ besides the defaults and sarathi): the
    # same controllers, less CPU.
    config = AutopilotConfig.model_validate(
        {"gammas": [0.01, 1.0], "interval_s": 10.0, "delay_s": 10.0, "min_requests": 20}
    )
    with start_twins(
        2, trace, speed=10.0, rate_scale=3.0, settings=docs, token="demo-tui-token"
    ) as twins:
        spec = ClusterSpec(
            name="demo",
            poll_interval_s=0.25,
            timeout_s=5.0,
            window_s=30.0,
            governance=demo_governance(trace, 3.0),
            replicas=[
                ReplicaSpec(name=t.name, api_url=t.url, control_url=t.url, token_env=DEMO_TOKEN_ENV)
                for t in twins
            ],
        )
        store = Store.open(str(tmp_path / "demo.db"))
        controllers = demo_controllers(["twin-1"], config=config, live=LiveConfig(tick_s=0.5))

        def decided(text: str) -> bool:  # both steered replicas past "waiting for data"
            lines = [ln for ln in text.splitlines() if "[armed]" in ln or "[dry-run]" in ln]
            return len(lines) == 2 and not any("waiting for data" in ln for ln in lines)

        async def scenario():
            app = build_app(spec, store=store, refresh_s=0.25, controllers=controllers)
            async with app.run_test(size=SIZE) as pilot:
                bar = app.query_one("#controlsbar")
                await wait_for(
                    pilot,
                    lambda: bar.has_class("-shown") and decided(text_of(bar)),
                    timeout=180,
                    what="the autopilot's decisions on data in the strip",
                )
                await wait_for(
                    pilot,
                    lambda: "tenants: SCR " in text_of(bar) and "governor: dry-run" in text_of(bar),
                    timeout=60,
                    what="the tenants' figures and the governor in the strip",
                )

                def promise():
                    return store.governance.control("autopilot", "demo")["status"].get("promise")

                # The autopilot's report says which promise holds: the strip shows it once drawn.
                await wait_for(
                    pilot,
                    lambda: not (p := promise()) or f"keeps: {p}" in text_of(bar),
                    what="the strip showing the stored promise",
                )
                shown = text_of(bar)
                assert bar.display and app.panel == "cluster"
                assert "autopilot: armed on twin-1 only, dry-run on the others" in shown
                assert "twin-1  [armed] running " in shown and "twin-0  [dry-run] chooses " in shown
                assert "a decision every 10 s (replica clock)" in shown
                assert re.search(r"tenants: SCR \d\S* · JFI \d", shown), shown
                # The sarathi replica is never sent anything: the autopilot is dry-run there.
                assert twins[0].core.settings.policy == "sarathi"
                assert all(
                    c["result"] == "dry-run"
                    for c in store.settings_log.settings_changes("demo", "twin-0")
                    if c["who"] == "autopilot"
                )
                # 6: the same in full; the strip steps aside.
                await pilot.press("6")
                body = app.query_one("#autopilot-body")
                await wait_for(
                    pilot,
                    lambda: "[armed] running" in text_of(body) and not bar.has_class("-shown"),
                    what="the alerts panel's autopilot block",
                )
                full = text_of(body)
                assert full.startswith("autopilot: armed on twin-1 only, dry-run on the others")
                assert "twin-0  [dry-run] chooses " in full
                await wait_for(
                    pilot,
                    lambda: "SCR " in text_of(app.query_one("#alerts-figures")),
                    what="the governance figures",
                )
                assert "governor: dry-run" in text_of(app.query_one("#alerts-governor"))
                await pilot.press("1")
                await wait_for(pilot, lambda: bar.has_class("-shown"), what="the strip back")

        try:
            asyncio.run(scenario())
        finally:
            store.close()
