"""End-to-end check of the vLLM test harness (tests/vllm_support.py) with the stock scheduler.

Launches a real vLLM CPU server on the tiny random Llama with a KV cache far too small for the
offered load, so the stock scheduler has to preempt, and checks every request still completes
with exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("httpx")

from vllm_support import (
    KV_BLOCK_SIZE_CPU,
    CompletionRequest,
    VllmServer,
    fetch_metrics,
    kv_bytes_for_tokens,
    run_completions,
    skip_without_vllm,
)

skip_without_vllm()

MAX_MODEL_LEN = 1024
# 1,024 usable KV slots (9 blocks of 128, one the null block): about 1/13 of the ~13k tokens
# the 40 requests below need at once, so the stock scheduler preempts.
KV_TOKENS = 1024
NUM_REQUESTS = 40


def _requests(seed: int = 7) -> list[CompletionRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(NUM_REQUESTS):
        prompt_len = rng.choice([8, 32, 100, 250, 400, 600])
        max_tokens = rng.randint(16, 64)
        if i % 5 == 0:  # some text prompts (the tiny BPE splits these into ~5 tokens/word)
            prompt: str | list[int] = f"Request {i}: " + "hello world " * (prompt_len // 16)
        else:
            prompt = [rng.randrange(4, 4096) for _ in range(prompt_len)]
        reqs.append(
            CompletionRequest(
                prompt=prompt,
                max_tokens=max_tokens,
                tenant=f"tenant-{i % 3}",
                type=rng.choice(["chat", "batch"]),
            )
        )
    return reqs


@pytest.mark.slow
def test_stock_scheduler_completes_under_kv_pressure(tiny_model_dir, tmp_path):
    reqs = _requests()
    with VllmServer(
        tiny_model_dir,
        kv_cache_bytes=kv_bytes_for_tokens(KV_TOKENS),
        max_model_len=MAX_MODEL_LEN,
        workdir=tmp_path / "server",
    ) as server:
        print(f"\nvLLM healthy after {server.startup_seconds:.1f} s; log: {server.log_path}")
        kv_tokens = server.kv_cache_tokens()
        assert kv_tokens == (KV_TOKENS // KV_BLOCK_SIZE_CPU + 1) * KV_BLOCK_SIZE_CPU, (
            server.log_tail()
        )

        results = run_completions(server.base_url, reqs)
        metrics = fetch_metrics(server.base_url)

    assert len(results) == len(reqs)
    for req, res in zip(reqs, results):
        assert res.completion_tokens == req.max_tokens, (req, res)
        assert res.finish_reason == "length", res
        assert res.text, res
        if isinstance(req.prompt, list):
            assert res.prompt_tokens == len(req.prompt), res

    assert "vllm:num_preemptions_total" in metrics, sorted(metrics)
    preemptions = metrics["vllm:num_preemptions_total"]
    print(
        f"KV cache {kv_tokens} tokens, {len(reqs)} requests, "
        f"{sum(r.completion_tokens for r in results)} completion tokens, "
        f"{preemptions:.0f} preemptions"
    )
    assert preemptions > 0, "KV cache was expected to be small enough to force preemptions"
