"""The TUI's tuner panel (key 5) on small seeded studies made here (a few trials on four 60-s
windows of the bundled trace): the study list, the trials table, the plot, the recommendation
(stored, or computed with tuner.studies.recommend), and ``R`` applying it to twin replicas through
the confirmation and the audited apply path, pinned parameters kept; read-only and replay refuse."""

from __future__ import annotations

import asyncio
import math
import shutil

import optuna
import pytest
from optuna.trial import TrialState
from test_tui_functional import (  # noqa: F401  (shared helpers and the twins fixture)
    get_settings,
    notifications,
    spec_of,
    started,
    text_of,
    twins,
    wait_for,
)
from test_tui_snapshots import FIXTURE, SIZE, SPEC, START_MS

from controlplane.steering import apply_settings
from scheduler.settings import Settings
from scheduler.settings_change import SettingsChange
from storage.store import Store
from tui import tuner_render as TR
from tui.main import build_app
from tui.tuner_data import resolve_storage
from tuner.studies import study as st
from tuner.studies.optimize import tune
from tuner.studies.optuna_storage import open_storage, storage_url
from tuner.studies.recommend import jsonable, recommend
from tuner.studies.results import best_trials
from tuner.studies.spec import DEFAULT_STORAGE_FILE, StudySpec

PARETO, SINGLE = "a-pareto", "b-single"


def _spec(objectives: list[str]) -> StudySpec:
    return StudySpec(
        policies=["uniboost"], objectives=objectives, trim=(0.0, 240.0), window_s=60.0, seed=3
    )


@pytest.fixture(scope="module")
def studies(tmp_path_factory) -> str:
    """Two seeded studies in one SQLite storage: two objectives (6 trials) and one (4 trials)."""
    path = tmp_path_factory.mktemp("tuner") / "optuna.db"
    url = storage_url(str(path))
    tune(url, PARETO, 6, spec=_spec(["ttlt_p99", "throughput"]))
    tune(url, SINGLE, 4, spec=_spec(["ttlt_p99"]))
    return str(path)


def load(path: str, name: str):
    return optuna.load_study(study_name=name, storage=open_storage(storage_url(path)))


def fully_evaluated(study) -> list:
    return [
        t
        for t in study.get_trials(states=(TrialState.COMPLETE,))
        if (t.user_attrs.get("tailpilot") or {}).get("pruned_after") is None
    ]


def plain(v) -> str:
    return getattr(v, "plain", str(v))


async def tuner_ready(pilot, app, study: str | None = None):
    panel = app.query_one("#tuner")
    await wait_for(
        pilot,
        lambda: (
            panel.loaded
            and panel.detail is not None
            and panel.detail_pending is None
            and (study is None or panel.detail.info.name == study)
            and panel.current_rec() is not None
        ),
        timeout=60,
        what="tuner panel loaded",
    )
    await pilot.pause(0.1)
    return panel


async def open_tuner_on(pilot, app, study: str):
    """Show the tuner panel and move its cursor down to ``study`` once the study list is in the
    table (a key pressed before the list is read has no row to move to and is lost)."""
    await pilot.press("5")
    panel = await tuner_ready(pilot, app)
    for _ in panel.studies:
        if panel.study == study:
            break
        was = panel.study
        await pilot.press("down")
        await wait_for(pilot, lambda: panel.study != was, what="the cursor moved")  # noqa: B023
    return await tuner_ready(pilot, app, study)


@pytest.fixture
def replay_app(tmp_path, studies):
    db = tmp_path / "rec.db"
    shutil.copy(FIXTURE, db)

    def make(**kw):
        kw.setdefault("optuna_storage", studies)
        return build_app(SPEC, replay=str(db), start_ms=START_MS + 60_000, **kw)

    return make


# ----------------------------------------------------------------------- listing and selecting


def test_panel_lists_studies_with_trial_counts_and_best_value_then_shows_the_trials(
    replay_app, studies
):
    single, pareto = load(studies, SINGLE), load(studies, PARETO)
    best = min(t.value for t in fully_evaluated(single))

    async def scenario():
        app = replay_app()
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.2)
            await pilot.press("5")
            panel = await tuner_ready(pilot, app, PARETO)
            table = app.query_one("#studies-table")
            rows = {
                plain(table.get_row_at(i)[0]): [plain(c) for c in table.get_row_at(i)]
                for i in range(table.row_count)
            }
            assert list(rows) == [PARETO, SINGLE]
            cols = list(TR.STUDY_COLUMNS)
            assert rows[SINGLE][cols.index("complete")] == str(len(fully_evaluated(single))) == "4"
            assert rows[PARETO][cols.index("complete")] == str(len(fully_evaluated(pareto))) == "6"
            assert rows[SINGLE][cols.index("best")] == TR.fmt_num(best)
            assert rows[SINGLE][cols.index("objectives")] == "ttlt_p99 ↓"
            # The first study's trials: one row per trial, its number and both objective values.
            trials = app.query_one("#trials-table")
            got = [[plain(c) for c in trials.get_row_at(i)] for i in range(trials.row_count)]
            assert [g[0].rstrip("★·") for g in got] == [str(t.number) for t in pareto.trials]
            assert [g[2:4] for g in got] == [
                [TR.fmt_num(v) for v in t.values] for t in pareto.trials
            ]
            front = {
                t.number
                for t in best_trials(
                    pareto, st.load_context(open_storage(storage_url(studies)), PARETO)[1]
                )
            }
            assert {int(g[0].rstrip("★·")) for g in got if "★" in g[0]} == front
            # Select the other study: its trials replace them.
            await pilot.press("down")
            panel = await tuner_ready(pilot, app, SINGLE)
            got = [[plain(c) for c in trials.get_row_at(i)] for i in range(trials.row_count)]
            assert [g[0].rstrip("★·") for g in got] == [str(t.number) for t in single.trials]
            assert [g[2] for g in got] == [TR.fmt_num(t.value) for t in single.trials]
            assert panel.detail.info.front == (
                min(fully_evaluated(single), key=lambda t: (t.value, t.number)).number,
            )

    asyncio.run(scenario())


def test_the_computed_recommendation_is_tuner_recommend(replay_app, studies):
    expected = jsonable(recommend(open_storage(storage_url(studies)), SINGLE))

    async def scenario():
        app = replay_app()
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.2)
            panel = await open_tuner_on(pilot, app, SINGLE)
            rec = panel.current_rec()
            assert rec.source == "computed" and rec.summary == expected
            text = text_of(app.query_one("#recommendation"))
            held = expected["holdout"]["metrics"]["ttlt_p99"]["improvement_pct"]
            search = expected["search"]["metrics"]["ttlt_p99"]
            assert f"trial {expected['trial']}" in text and TR.fmt_pct(held) in text
            assert (
                TR.fmt_pct(search["improvement_pct"]) in text
                and TR.fmt_pct(search["ci_pct"][0]) in text
            )
            # Replay is read-only: R is refused, nothing to confirm.
            await pilot.press("R")
            await pilot.pause(0.1)
            assert app.refused == ["apply_recommendation"]
            assert type(app.screen).__name__ != "ConfirmScreen"

    asyncio.run(scenario())


def test_a_stored_recommendation_is_shown_instead_of_computing(tmp_path, studies):
    db = tmp_path / "rec.db"
    shutil.copy(FIXTURE, db)
    store = Store.open(str(db))
    settings = Settings.model_validate({"policy": "uniboost", "params": {"gamma": 7.5}}).to_dict()
    summary = {
        "study": SINGLE,
        "trial": 99,
        "settings": settings,
        "objectives": [{"name": "ttlt_p99"}],
        "search": {
            "windows": [0, 1],
            "metrics": {"ttlt_p99": {"improvement_pct": 12.5, "ci_pct": [3.0, 20.0]}},
        },
        "holdout": {
            "windows": [2],
            "metrics": {"ttlt_p99": {"improvement_pct": 4.25, "ci_pct": [None, None]}},
        },
    }
    rid = store.tuner.store_recommendation(SINGLE, settings, summary, t_ms=START_MS)

    async def scenario():
        app = build_app(
            SPEC, replay=str(db), store=store, start_ms=START_MS + 60_000, optuna_storage=studies
        )
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.2)
            panel = await open_tuner_on(pilot, app, SINGLE)
            rec = panel.current_rec()
            assert (
                rec.source == "stored"
                and rec.stored_id == rid
                and rec.summary["settings"] == settings
            )
            text = text_of(app.query_one("#recommendation"))
            assert (
                "trial 99" in text
                and f"stored #{rid}" in text
                and "+12.5%" in text
                and "+4.2%" in text
            )
            assert "[+3.0%, +20.0%]" in text and "gamma 7.5" in text

    asyncio.run(scenario())
    store.close()


def test_no_storage_says_how_to_create_a_study(replay_app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_storage(None)[0] is None  # ./tailpilot-optuna.db does not exist: not created

    async def scenario():
        app = replay_app(optuna_storage=None)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.2)
            await pilot.press("5")
            panel = app.query_one("#tuner")
            await wait_for(pilot, lambda: panel.loaded, what="panel")
            assert "tailpilot tune --study" in text_of(app.query_one("#tuner-message"))
            await pilot.press("R")  # read-only (replay) first
            assert not (tmp_path / DEFAULT_STORAGE_FILE).exists()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------- applying (live)


def test_R_applies_the_recommendation_to_all_replicas_keeping_pins_with_audit_rows(
    twins, studies, tmp_path
):
    storage = open_storage(storage_url(studies))
    rec = jsonable(recommend(storage, SINGLE))
    assert rec["settings"]["policy"] == "uniboost", (
        "the test needs a recommendation that keeps uniboost"
    )
    store = Store.open(str(tmp_path / "live.db"))
    spec = spec_of(twins)
    # The operator pinned γ on twin-1 at 12.
    [pin] = asyncio.run(
        apply_settings(
            spec,
            ["twin-1"],
            SettingsChange(params={"gamma": 12.0}, pin=frozenset({"gamma"})),
            None,
            "test",
        )
    )
    assert pin.ok, pin.message
    before = [get_settings(t)["version"] for t in twins]

    async def scenario():
        app = build_app(spec, store=store, refresh_s=0.25, optuna_storage=studies)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)
            panel = await open_tuner_on(pilot, app, SINGLE)
            assert panel.current_rec().summary["settings"] == rec["settings"]
            await pilot.press("R")
            await wait_for(
                pilot, lambda: type(app.screen).__name__ == "ConfirmScreen", what="confirmation"
            )
            diff = text_of(app.screen.query_one("#dialog-diff"))
            assert "twin-0" in diff and "twin-1" in diff and "twin-2" in diff
            assert "params.gamma: 12 kept: pinned" in diff, diff
            assert all(
                get_settings(t)["version"] == v for t, v in zip(twins, before)
            )  # nothing sent before y
            await pilot.press("y")
            await wait_for(pilot, lambda: len(app.last_results) == 3, what="apply results")
            assert all(r.ok for r in app.last_results), [r.message for r in app.last_results]
            assert "applied" in text_of(app.query_one("#tuner-result"))

    asyncio.run(scenario())
    want = Settings.model_validate(rec["settings"]).to_dict()
    for t in (twins[0], twins[2]):
        assert get_settings(t)["settings"] == want
    kept = get_settings(twins[1])["settings"]
    assert kept["params"]["gamma"] == 12.0 and kept["pinned"] == ["gamma"]
    assert {
        **kept,
        "params": {**kept["params"], "gamma": want["params"]["gamma"]},
        "pinned": [],
    } == want
    rows = store.settings_log.settings_changes("twins")
    assert sorted(r["replica"] for r in rows) == ["twin-0", "twin-1", "twin-2"]
    assert all(r["result"] == "applied" and r["who"].startswith("tui:") for r in rows)
    assert next(r for r in rows if r["replica"] == "twin-1")["new"]["params"]["gamma"] == 12.0
    store.close()


def test_R_applies_to_the_selection_only_and_refuses_a_policy_switch_over_a_pin(twins, studies):
    """Selected replicas only; a replica whose pin the recommendation cannot keep is not sent."""
    rec = jsonable(recommend(open_storage(storage_url(studies)), SINGLE))
    spec = spec_of(twins)
    [r] = asyncio.run(
        apply_settings(
            spec,
            ["twin-2"],
            {"policy": "tie", "params": {"beta": 0.5}, "pinned": ["beta"]},
            None,
            "test",
        )
    )
    assert r.ok, r.message
    v0 = get_settings(twins[0])["version"]

    async def scenario():
        app = build_app(spec, refresh_s=0.25, optuna_storage=studies)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)
            app.selected = {"twin-1", "twin-2"}
            await open_tuner_on(pilot, app, SINGLE)
            await pilot.press("R")
            await wait_for(
                pilot, lambda: type(app.screen).__name__ == "ConfirmScreen", what="confirmation"
            )
            diff = text_of(app.screen.query_one("#dialog-diff"))
            assert "twin-0" not in diff and "twin-1" in diff
            assert "not sent: pinned beta on tie" in diff, diff
            await pilot.press("y")
            await wait_for(pilot, lambda: len(app.last_results) == 1, what="apply result")

    asyncio.run(scenario())
    assert get_settings(twins[1])["settings"] == Settings.model_validate(rec["settings"]).to_dict()
    assert get_settings(twins[2])["settings"]["policy"] == "tie"
    assert get_settings(twins[0])["version"] == v0


def test_readonly_refuses_R(twins, studies):
    before = [get_settings(t) for t in twins]

    async def scenario():
        app = build_app(spec_of(twins), readonly=True, refresh_s=0.25, optuna_storage=studies)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot, app)
            await pilot.press("5")
            await tuner_ready(pilot, app)
            await pilot.press("R")
            await pilot.pause(0.2)
            assert app.refused == ["apply_recommendation"]
            assert type(app.screen).__name__ != "ConfirmScreen"
            assert any("refused" in m for m in notifications(app))
            await app.run_action("apply_recommendation")  # even called directly: nothing is sent
            await pilot.pause(0.2)
            assert type(app.screen).__name__ != "ConfirmScreen"

    asyncio.run(scenario())
    assert [get_settings(t) for t in twins] == before


# ------------------------------------------------------------------------------------- snapshot


def test_tuner_panel_snapshot(replay_app, snap_compare):
    async def before(pilot):
        app = pilot.app
        for _ in range(400):
            if app.snapshot is not None and app.snapshot.t_ms == app.source.position:
                break
            await asyncio.sleep(0.01)
        await pilot.press("5")
        await tuner_ready(pilot, app, PARETO)
        await pilot.pause(0.2)

    assert snap_compare(replay_app(), terminal_size=SIZE, run_before=before)


def test_render_units():
    assert (
        TR.key_params(
            {
                "policy": "uniboost",
                "uniboost.gamma": 0.5,
                "engine.max_num_seqs": 64,
                "uniboost.memguard": True,
            }
        )
        == "γ=0.5 seqs=64 memguard=on"
    )
    assert TR.fmt_pct(math.nan) == "—" and TR.fmt_pct(1.25) == "+1.2%"
    assert TR.redact("postgresql+psycopg://u:secret@h/db") == "postgresql+psycopg://u:***@h/db"
