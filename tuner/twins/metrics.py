"""A twin replica's vLLM ``/metrics``: vLLM 0.32's metric names, labels (``model_name``,
``engine``) and default buckets, kept by hand per twin (``TwinStats``) and emitted at scrape time
by a custom collector (``TwinCollector``) under the twin's lock, so ``/metrics`` and ``/state``
agree. The inter-token-latency histogram counts each request's ``n − 1`` gaps at the request's
mean gap (the simulator does not keep per-token times).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from scheduler.metrics import Completion
from sim.engine import EngineConfig, Simulator

# vLLM 0.32's default histogram buckets (vllm/v1/metrics/buckets.py), copied so that twins do not
# import vLLM.
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series capped at ``max_model_len``."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_model_len:
                return tuple(out)
            out.append(v)
        exp += 1


class Histogram:
    """A histogram kept by hand: observations with a multiplicity, emitted as a metric family."""

    __slots__ = ("bounds", "counts", "n", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float, count: int = 1) -> None:
        if count <= 0:
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count
        self.n += count

    def family(
        self, name: str, doc: str, labels: Sequence[str], values: Sequence[str]
    ) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=list(labels))
        buckets, acc = [], 0
        for bound, c in zip(self.bounds, self.counts):
            acc += c
            buckets.append((_fmt_le(bound), acc))
        buckets.append(("+Inf", self.n))
        fam.add_metric(list(values), buckets, self.total)
        return fam


def _fmt_le(b: float) -> str:
    return repr(float(b))


HISTOGRAMS = {  # name -> (doc, bucket family)
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", "ttft"),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", "itl"),
    "vllm:request_time_per_output_token_seconds": (
        "Histogram of time_per_output_token_seconds per request.",
        "itl",
    ),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", "latency"),
    "vllm:request_queue_time_seconds": (
        "Histogram of time spent in WAITING phase for request.",
        "latency",
    ),
    "vllm:request_inference_time_seconds": (
        "Histogram of time spent in RUNNING phase for request.",
        "latency",
    ),
    "vllm:request_prefill_time_seconds": (
        "Histogram of time spent in PREFILL phase for request.",
        "latency",
    ),
    "vllm:request_decode_time_seconds": (
        "Histogram of time spent in DECODE phase for request.",
        "latency",
    ),
    "vllm:request_prompt_tokens": ("Number of prefill tokens processed.", "tokens"),
    "vllm:request_generation_tokens": ("Number of generation tokens processed.", "tokens"),
    "vllm:request_params_max_tokens": ("Histogram of the max_tokens request parameter.", "tokens"),
    "vllm:request_num_preemptions": (
        "Histogram of the number of times a request was preempted.",
        "preemptions",
    ),
    "vllm:iteration_tokens_total": ("Histogram of number of tokens per engine_step.", "iteration"),
}


class TwinStats:
    """Counters and histograms of one twin's lifetime (reset by a fresh restart, as vLLM's)."""

    def __init__(self, max_model_len: int) -> None:
        families = {
            "ttft": TIME_TO_FIRST_TOKEN_BUCKETS,
            "itl": INTER_TOKEN_LATENCY_BUCKETS,
            "latency": REQUEST_LATENCY_BUCKETS,
            "tokens": request_tokens_buckets(max_model_len),
            "preemptions": REQUEST_NUM_PREEMPTIONS_BUCKETS,
            "iteration": ITERATION_TOKENS_BUCKETS,
        }
        self.hists = {name: Histogram(families[fam]) for name, (_, fam) in HISTOGRAMS.items()}
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = 0  # prefill tokens computed, recomputation included
        self.finished_output_tokens = 0
        self.rejected = 0

    def observe_step(self, prefill: int, decodes: int, k: int) -> None:
        """An engine step (``k > 1``: a stretch of k identical decode steps, as one)."""
        self.prompt_tokens += prefill
        iteration = self.hists["vllm:iteration_tokens_total"]
        iteration.observe(prefill + decodes)
        if k > 1:
            iteration.observe(decodes, k - 1)

    def observe_completion(self, c: Completion, max_tokens: int | None) -> None:
        """A finished request, as vLLM counts it (``max_tokens``: its cap, None when unknown)."""
        n = c.output_tokens
        arrival, sched, first, fin = c.arrival, c.scheduled_at, c.first_token_at, c.finished_at
        self.success["length" if max_tokens is not None and n >= max_tokens else "stop"] += 1
        self.finished_output_tokens += n
        decode = fin - first
        h = self.hists
        h["vllm:time_to_first_token_seconds"].observe(first - arrival)
        h["vllm:e2e_request_latency_seconds"].observe(fin - arrival)
        h["vllm:request_queue_time_seconds"].observe(sched - arrival)
        h["vllm:request_inference_time_seconds"].observe(fin - sched)
        h["vllm:request_prefill_time_seconds"].observe(first - sched)
        h["vllm:request_decode_time_seconds"].observe(decode)
        h["vllm:request_prompt_tokens"].observe(c.prompt_tokens)
        h["vllm:request_generation_tokens"].observe(n)
        h["vllm:request_num_preemptions"].observe(c.preemptions)
        if max_tokens is not None:
            h["vllm:request_params_max_tokens"].observe(max_tokens)
        if n > 1:
            gap = decode / (n - 1)
            h["vllm:request_time_per_output_token_seconds"].observe(gap)
            h["vllm:inter_token_latency_seconds"].observe(gap, n - 1)


class ScrapedTwin(Protocol):
    """What a scrape reads of a twin (``tuner.twins.replica.TwinReplica``), under its lock."""

    @property
    def model_name(self) -> str: ...
    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def sim(self) -> Simulator: ...
    @property
    def stats(self) -> TwinStats: ...
    @property
    def config(self) -> EngineConfig: ...

    def kv(self) -> dict[str, Any]: ...


class TwinCollector:
    """vLLM 0.32's metric families for one twin, computed at scrape time."""

    def __init__(self, twin: ScrapedTwin) -> None:
        self.twin = twin

    def collect(self) -> Iterator[Metric]:
        twin = self.twin
        labels, values = ["model_name", "engine"], [twin.model_name, "0"]

        def gauge(
            name: str, doc: str, value: float, extra: Mapping[str, str] | None = None
        ) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=labels + list(extra or {}))
            fam.add_metric(values + list((extra or {}).values()), value)
            return fam

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        with twin.lock:
            sim, stats = twin.sim, twin.stats
            running, waiting = len(sim.running), len(sim.waiting)
            kv = twin.kv()
            in_flight = sum(r.generated for r in sim.running) + sum(
                r.generated for r in sim.waiting
            )
            families = [
                gauge(
                    "vllm:num_requests_running",
                    "Number of requests in model execution batches.",
                    running,
                ),
                gauge(
                    "vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.",
                    waiting,
                ),
                gauge(
                    "vllm:kv_cache_usage_perc",
                    "KV-cache usage. 1 means 100 percent usage.",
                    kv["usage"],
                ),
                counter(
                    "vllm:num_preemptions",
                    "Cumulative number of preemption from the engine.",
                    sim.preemptions,
                ),
                counter(
                    "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
                ),
                counter(
                    "vllm:generation_tokens",
                    "Number of generation tokens processed.",
                    stats.finished_output_tokens + in_flight,
                ),
            ]
            by_reason = GaugeMetricFamily(
                "vllm:num_requests_waiting_by_reason",
                "Number of waiting requests by reason.",
                labels=[*labels, "reason"],
            )
            by_reason.add_metric([*values, "capacity"], waiting)
            by_reason.add_metric([*values, "deferred"], 0)
            families.append(by_reason)
            success = CounterMetricFamily(
                "vllm:request_success",
                "Count of successfully processed requests.",
                labels=[*labels, "finished_reason"],
            )
            for reason, n in stats.success.items():
                success.add_metric([*values, reason], n)
            families.append(success)
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=["block_size", "num_gpu_blocks", "engine"],
            )
            info.add_metric(
                [str(twin.config.block_size), str(twin.config.num_gpu_blocks), "0"], 1.0
            )
            families.append(info)
            for name, (doc, _) in HISTOGRAMS.items():
                families.append(stats.hists[name].family(name, doc, labels, values))
        yield from families
