"""What-if before apply and verify after (tuner/closed_loop/whatif.py, ``set --preview``,
``verify``): on a twin whose clock the test drives, the prediction's sign and size are what the twin
then shows, and verify closes the loop against the counterfactual of the traffic that came."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from click.testing import CliRunner

from scheduler.settings import Settings
from storage.store import Store

TOKEN = "whatif-token"
SARATHI = Settings.model_validate({"policy": "sarathi"})
SIZE_FIRST = Settings.model_validate(
    {"policy": "uniboost", "params": {"gamma": 0.01, "gamma_ada": False}}
)


@pytest.mark.slow
def test_predict_apply_verify_on_a_twin(tmp_path, monkeypatch):
    """Bundled Azure conv at 1.5× its rate, sarathi → uniboost at γ 0.01: on the last 2 minutes of
    traffic the what-if predicts P95 TTFT down by a fifth or more; applied for real (HTTP PUT), the
    twin then shows it — verify's realized change (the real figures over the same traffic replayed
    under sarathi) has the predicted sign and size."""
    from controlplane.collector import Collector
    from controlplane.replica_http import PollingClient
    from controlplane.steering import apply_settings
    from sim.traces import load_bundled
    from tuner.closed_loop.whatif import predict, verify
    from tuner.twins.cluster import start_twins
    from tuner.twins.replica import ManualClock

    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    clock = ManualClock()
    store = Store.open(str(tmp_path / "w.db"), clock=clock.now)
    with start_twins(
        1, load_bundled(), rate_scale=1.5, clock=clock, loop=False, settings=SARATHI, token=TOKEN
    ) as twins:
        twin = twins[0]
        import yaml

        from controlplane.cluster import parse_cluster_file

        cluster = parse_cluster_file(yaml.safe_dump(twins.cluster_doc("twins"))).cluster()

        async def run_until(t_end: float, collector: Collector) -> None:
            t = clock.t
            while t < t_end:
                t = min(t + 2.0, t_end)
                clock.set(t)
                twin.advance(t)
                await collector.poll(twin.name)
                await collector.flush()

        async def scenario():
            client = PollingClient(cluster.timeout_s)
            collector = Collector(cluster, store, client=client, clock=clock.now)
            try:
                await run_until(240.0, collector)
                now_ms = int(clock.now() * 1000)
                p = predict(
                    store,
                    cluster.name,
                    twin.name,
                    SARATHI,
                    SIZE_FIRST,
                    now_ms=now_ms,
                    minutes=2.0,
                    warmup_s=240.0,
                )
                [applied] = await apply_settings(
                    cluster,
                    [twin.name],
                    SIZE_FIRST.to_dict(),
                    store,
                    "test",
                    client=client,
                    wait_s=0.0,
                )
                assert applied.ok, applied.message
                pid = store.tuner.store_prediction(
                    cluster.name, twin.name, p, t_ms=now_ms, version=applied.version
                )
                await run_until(250.0, collector)
                [early] = store.tuner.predictions(cluster.name)
                assert not verify(store, early, now_ms=int(clock.now() * 1000))["ready"]
                await run_until(600.0, collector)  # the span's requests have all finished
                return p, pid
            finally:
                await client.aclose()

        p, pid = asyncio.run(scenario())
        assert twin.core.settings.policy == "uniboost"
    predicted = p["metrics"]["ttft_p95"]["change"]
    assert p["requests"] > 100 and predicted < -0.2
    [kept] = store.tuner.predictions("twins")
    assert kept["id"] == pid and kept["summary"]["metrics"]["ttft_p95"]["change"] == predicted
    v = verify(store, kept, now_ms=int(clock.now() * 1000))
    assert v["ready"] and v["requests"] > 100
    m = v["metrics"]["ttft_p95"]
    # The twin is the simulator: what the model says happened (warm-up under sarathi, uniboost from
    # the change on, the same requests) is what the twin did.
    assert m["real"] == pytest.approx(m["simulated_new"], rel=1e-4)
    # Realized on the traffic that came (−17%) has the predicted sign and size (−29% predicted on
    # the two minutes before): the windows' traffic differs, which is why verify replays the new
    # one.
    assert m["predicted"] == predicted and -0.5 < m["realized"] < -0.1
    assert v["metrics"]["throughput_tok_s"]["realized"] == pytest.approx(0.0, abs=1e-9)
    store.close()


def test_set_preview_shows_the_prediction_and_keeps_it_when_applied(tmp_path, monkeypatch):
    """The CLI on live twins (real clock, speed 20): --preview prints the predicted changes with the
    band, applies with --yes, keeps the prediction with the new version; verify says when it is due;
    without --yes off a terminal nothing is applied."""
    import yaml

    from controlplane.cluster import load_cluster_file
    from controlplane.recorder import run_recorder
    from sim.traces import load_bundled
    from storage.retention import RetentionSettings
    from tuner.twins.cluster import start_twins

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    with start_twins(
        1, load_bundled(), speed=20, rate_scale=1.5, settings=SARATHI, token=TOKEN
    ) as twins:
        doc = twins.cluster_doc("twins")
        doc["clusters"][0].update(poll_interval_s=0.1, timeout_s=2.0)
        Store.open("tp.db").close()
        with open("c.yaml", "w") as f:
            yaml.safe_dump(doc, f)
        stop = threading.Event()
        rec = threading.Thread(
            target=run_recorder,
            args=(load_cluster_file("c.yaml").cluster(), "tp.db"),
            kwargs={"stop": stop, "retention": RetentionSettings(), "install_signals": False},
        )
        rec.start()
        try:
            deadline = time.monotonic() + 60
            while (
                time.monotonic() < deadline
            ):  # wait for traffic to predict on (an event, not a sleep)
                with Store.open("tp.db") as s:
                    if len(s.readings.completions("twins")) >= 200:
                        break
                time.sleep(0.2)
            runner = CliRunner()
            base = [
                "set",
                "--cluster",
                "c.yaml",
                "--replica",
                twins[0].name,
                "--db",
                "tp.db",
                "--policy",
                "uniboost",
                "--set",
                "gamma=0.01",
                "--set",
                "gamma_ada=false",
                "--preview",
                "--minutes",
                "1",
            ]
            res = runner.invoke(main_cli(), base)  # not a terminal, no --yes: shown, not applied
            assert res.exit_code == 1, res.output  # nothing was applied: not what was asked
            assert (
                "P95 TTFT" in res.output and "fidelity not measured on this replica" in res.output
            )
            assert "not applied" in res.output and twins[0].core.settings.policy == "sarathi"
            res = runner.invoke(main_cli(), [*base, "--yes", "--json"])
            assert res.exit_code in (0, 3), res.output
            [out] = json.loads(res.stdout)
            assert out["prediction"]["metrics"]["ttft_p95"]["change"] is not None
            with Store.open("tp.db") as s:
                [kept] = s.tuner.predictions("twins")
            assert (
                kept["id"] == out["prediction"]["prediction_id"]
                and kept["version"] == out["version"]
            )
            res = runner.invoke(main_cli(), ["verify", "--cluster", "c.yaml", "--db", "tp.db"])
            assert res.exit_code == 0 and "not ready to verify" in res.output
        finally:
            stop.set()
            rec.join()


def main_cli():
    from tailpilot.cli import main

    return main
