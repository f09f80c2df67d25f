"""``tailpilot fidelity`` (tuner/closed_loop/fidelity.py): a twin — the simulator itself behind the
real control API — recorded by the real recorder and replayed: the report says ≈ 0 error and the
same order; the decision diff and the windows' errors are computed right on known inputs; a settings
change inside the span is replayed; errors name what is missing."""

from __future__ import annotations

import json
import random
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner
from twin_support import serve_all

from storage.store import Store
from tailpilot.cli import main
from tuner.closed_loop.fidelity import (
    FidelityError,
    compare,
    decision_diff,
    figures,
    settings_timeline,
)

TOKEN = "fid-token"


def fidelity_cli(db, replica: str, *flags: str):
    """``tailpilot fidelity --db DB --replica REPLICA FLAGS…`` through click's runner."""
    return CliRunner().invoke(main, ["fidelity", "--db", str(db), "--replica", replica, *flags])


def fidelity_json(db, replica: str, *flags: str) -> dict:
    """The ``--json`` report of a run that must succeed."""
    res = fidelity_cli(db, replica, *flags, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def small_trace(n: int = 400, duration: float = 100.0, seed: int = 2):
    from sim.traces import Trace, TraceRequest

    rng = random.Random(seed)
    return Trace(
        "fid",
        tuple(
            TraceRequest(
                id=f"r{i:04d}",
                arrival=round(i * duration / n + rng.random() * 0.1, 4),
                prompt_tokens=int(rng.lognormvariate(6.5, 1)) + 8,
                output_tokens=rng.randint(10, 300),
                max_tokens=512,
            )
            for i in range(n)
        ),
    )


def record_all(twins, db, n: int, recording: str = "lab") -> None:
    """Run the real recorder on ``twins`` until ``n`` completions are stored."""
    import yaml

    from controlplane.cluster import load_cluster_file
    from controlplane.recorder import run_recorder
    from storage.retention import RetentionSettings

    doc = twins.cluster_doc("twins")
    doc["clusters"][0].update(poll_interval_s=0.1, timeout_s=2.0, window_s=30.0)
    path = db.parent / "twins.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    stop = threading.Event()

    def watch():
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                with Store.open(str(db)) as store:
                    if len(store.readings.completions("twins")) >= n:
                        break
            except Exception:
                pass
            stop.wait(0.1)
        stop.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    run_recorder(
        load_cluster_file(path).cluster(),
        str(db),
        stop=stop,
        recording_name=recording,
        retention=RetentionSettings(),
        install_signals=False,
    )
    watcher.join()


@pytest.fixture
def recorded_twin(tmp_path):
    """A twin that served the whole trace under uniboost (γ-Ada on), recorded; yields the db path,
    the twin (still answering) and the trace."""
    from scheduler.settings import Settings
    from sim.engine import EngineConfig
    from tuner.twins.cluster import start_twins
    from tuner.twins.replica import ManualClock

    trace = small_trace()
    clock = ManualClock()
    db = tmp_path / "fid.db"
    settings = Settings.model_validate(
        {"policy": "uniboost", "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 512}}
    )
    with start_twins(
        1,
        trace,
        clock=clock,
        config=EngineConfig(num_gpu_blocks=3000),
        loop=False,
        settings=settings,
        token=TOKEN,
    ) as twins:
        twin = twins[0]
        serve_all(twins, clock, step=5.0)
        assert twin.core.finished_total == len(trace)
        record_all(twins, db, len(trace))
        yield db, twin, trace


def test_a_twin_replayed_has_no_error_and_the_same_order(recorded_twin):
    db, twin, trace = recorded_twin
    report = fidelity_json(db, twin.name, "--recording", "lab", "--window-s", "25")
    assert report["requests"] == len(trace) and report["unmatched"] == 0
    assert report["settings"][0]["policy"] == "uniboost"
    # The twin's engine, read from its /state: limits and KV (not the simulator's defaults).
    assert report["engine"]["max_num_seqs"] == 16 and report["engine"]["num_gpu_blocks"] == 3000
    for key, err in report["overall"]["errors"].items():
        assert err is None or abs(err) < 1e-6, (key, err)
    assert report["band"] < 1e-6
    d = report["overall"]["decision"]
    assert d["spearman"] == pytest.approx(1.0) and d["overtaken_real"] == d["overtaken_sim"]
    assert d["preemptions_differ"] == 0
    assert len(report["windows"]) == 4 and all(w["requests"] > 0 for w in report["windows"])
    # Stored, newest per replica; the human report names the band.
    with Store.open(str(db)) as store:
        [kept] = store.tuner.latest_fidelity("twins", twin.name)
    assert kept["summary"]["band"] == report["band"] and "recording=lab" in kept["span"]
    text = fidelity_cli(db, twin.name, "--no-store").stdout
    assert "error band on this replica: ±0%" in text and "decision diff: Spearman 1" in text


def test_a_different_step_model_shows_up_as_error_and_reordering(recorded_twin):
    """Replayed with a step model 40% too fast, the simulator under-predicts the latencies —
    which the report shows per window and in its band."""
    from sim.stepmodel import StepTimeModel, get_model, save_user_model

    db, twin, _trace = recorded_twin
    true = get_model()
    fast = StepTimeModel(
        **{k: getattr(true, k) * 0.6 for k in "abcde"}, name="fid/fast", source="test"
    )
    save_user_model(fast)
    report = fidelity_json(db, twin.name, "--step-model", "fid/fast", "--no-store")
    assert report["step_model"] == "fid/fast"
    assert report["overall"]["errors"]["ttlt_p50"] < -0.2 and report["band"] > 0.2
    assert report["divergent_windows"]


def test_errors_name_what_is_missing(recorded_twin, tmp_path):
    db, twin, _ = recorded_twin
    res = fidelity_cli(db, "nope")
    assert res.exit_code == 2 and "'nope'" in res.output
    res = fidelity_cli(db, twin.name, "--recording", "nope")
    assert res.exit_code == 2 and "no recording 'nope'" in res.output
    res = fidelity_cli(tmp_path / "none.db", twin.name)
    assert res.exit_code == 2 and "no tailpilot store" in res.output
    with pytest.raises(FidelityError, match="no settings document"):
        settings_timeline([], None)


def test_figures_errors_and_decision_diff_on_known_rows():
    real = [(0.0, 1.0, 3.0, 10, 0), (1.0, 2.0, 5.0, 20, 1), (2.0, 4.0, 6.0, 30, 0)]
    sim = [(0.0, 1.0, 3.0, 10, 0), (1.0, 3.0, 6.0, 20, 0), (2.0, 2.5, 6.0, 30, 0)]
    fr, fs = figures(real, 10.0), figures(sim, 10.0)
    assert fr["ttft_p50"] == 1.0 and fr["throughput_tok_s"] == 6.0 and fr["preemptions"] == 1.0
    c = compare(fr, fs)
    assert c["errors"]["ttft_p50"] == 0.0 and c["errors"]["ttlt_p99"] == pytest.approx(4.98 / 4 - 1)
    assert c["errors"]["preemptions"] == -1.0 and c["real"]["ttlt_p99"] == 4.0
    d = decision_diff(
        np.array([1.0, 2.0, 4.0]),
        np.array([1.0, 3.0, 2.5]),
        np.array([0.0, 1.0, 2.0]),
        np.array([0, 1, 0]),
        np.array([0, 0, 0]),
    )
    # real: served in arrival order; sim: the third arrival got its first token before the second
    assert d["overtaken_real"] == 0 and d["overtaken_sim"] == 1
    assert d["spearman"] == pytest.approx(0.5) and d["preemptions_differ"] == 1


def test_a_settings_change_inside_the_span_is_replayed_from_when_it_was_seen():
    from scheduler.settings import Settings

    seen = [
        {"t_ms": 1000, "settings": {"policy": "fcfs"}},
        {"t_ms": 5000, "settings": {"policy": "sarathi"}},
        {"t_ms": 9000, "settings": {"policy": "uniboost"}},
    ]
    timeline = settings_timeline(seen, 6000)
    assert [(t, s.policy) for t, s in timeline] == [(None, "sarathi"), (9000, "uniboost")]
    assert isinstance(timeline[0][1], Settings)
    assert [s.policy for _, s in settings_timeline(seen, None)] == ["fcfs", "sarathi", "uniboost"]


def test_the_replay_switches_settings_at_the_given_time_without_losing_a_request():
    from scheduler.settings import Settings
    from tuner.closed_loop.fidelity import Replay

    trace = small_trace(200, 50.0)
    switch = Settings.model_validate({"policy": "sarathi"})
    sim = Replay(trace, Settings.model_validate({"policy": "uniboost"}), None, [(20.0, switch)])
    res = sim.run()
    assert sim.policy.name == "sarathi" and len(res.completions) == 200


def test_the_front_end_hop_is_replayed_from_the_engine_core_and_added_back(recorded_twin):
    """The API server's arrival precedes the engine core's receipt (tokenising, the hop): the
    replay starts each request where the core got it and adds the gap back, so a recorded hop
    is not mistaken for queueing — and without ``received_s`` the same rows show as error."""
    from sqlalchemy import text

    db, twin, trace = recorded_twin

    def overall() -> dict:
        return fidelity_json(db, twin.name, "--recording", "lab", "--no-store")["overall"]

    with Store.open(str(db)) as store, store.database.engine.begin() as conn:
        assert conn.execute(
            text("SELECT COUNT(*) FROM completions WHERE received_s = arrival_s")
        ).scalar_one() == len(trace)  # a twin's core gets each request when it arrives
        conn.execute(
            text("UPDATE completions SET arrival_s = received_s - 0.2 * (id % 5)")
        )  # hops 0–0.8 s
    hopped = overall()
    for key, err in hopped["errors"].items():
        assert err is None or abs(err) < 1e-6, (key, err)
    assert hopped["real"]["ttft_p99"] > 0.8  # the real figures include the hop
    with Store.open(str(db)) as store, store.database.engine.begin() as conn:
        conn.execute(
            text("UPDATE completions SET received_s = NULL")
        )  # an older replica: API arrival only
    assert abs(overall()["errors"]["ttft_p50"]) > 0.01
