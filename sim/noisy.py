"""Seed 003's noisy-neighbour scenario: three tenants with equal commitments, one bursting to 10×.

    trace, params = noisy_neighbour(capacity_req_s=40.0)
    simulate(trace, Settings.model_validate({"policy": "slofq", "params": params}))

Lengths come from the bundled Azure conv window (drawn with a seeded generator). Tenants ``a``,
``b`` and ``noisy`` each send Poisson arrivals at ``share`` × capacity; from ``burst_from_s`` for
``burst_s`` seconds ``noisy`` sends ``burst`` × its rate. A ``batch_fraction`` of each tenant's
requests are of type ``batch``, the rest ``chat``. The slofq parameters give every tenant a
commitment of its base token rate and the same TTFT targets (``ttft``).
"""

from __future__ import annotations

import random
from typing import Any

from scheduler.settings import Settings
from sim import traces as tr
from sim.engine import EngineConfig, simulate

TENANTS = ("a", "b", "noisy")


def noisy_neighbour(
    *,
    capacity_req_s: float,
    share: float = 0.2,
    burst: float = 10.0,
    duration_s: float = 240.0,
    burst_from_s: float = 60.0,
    burst_s: float = 60.0,
    seed: int = 3,
    ttft: dict[str, float] | None = None,
    prompt_scale: float = 1.0,
    output_scale: float = 1.0,
    batch_fraction: float = 0.1,
) -> tuple[tr.Trace, dict[str, Any]]:
    """(trace, slofq params) of the scenario (module docstring)."""
    rng = random.Random(seed)
    pool = [(r.prompt_tokens, r.output_tokens) for r in tr.load_bundled()]
    rate = share * capacity_req_s
    arrivals: list[tuple[float, str]] = []
    for tenant in TENANTS:
        t = 0.0
        while True:
            bursting = tenant == "noisy" and burst_from_s <= t < burst_from_s + burst_s
            t += rng.expovariate(rate * (burst if bursting else 1.0))
            if t >= duration_s:
                break
            arrivals.append((t, tenant))
    arrivals.sort()
    requests = []
    mean_tokens = 0.0
    for i, (t, tenant) in enumerate(arrivals):
        p, o = pool[rng.randrange(len(pool))]
        p, o = max(1, int(p * prompt_scale)), max(1, int(o * output_scale))
        mean_tokens += p + o
        rtype = "batch" if rng.random() < batch_fraction else "chat"
        requests.append(
            tr.TraceRequest(
                id=f"{tenant}-{i:05d}",
                arrival=round(t, 6),
                prompt_tokens=p,
                output_tokens=o,
                max_tokens=tr.DEFAULT_MAX_TOKENS,
                tenant=tenant,
                type=rtype,
            )
        )
    mean_tokens /= max(1, len(requests))
    commit = rate * mean_tokens  # each tenant's base rate in tokens/s
    slo = ttft or {"p50": 0.5, "p90": 1.0, "p99": 2.0}
    params = {"tenants": {t: {"commit_tok_s": round(commit, 1), "ttft": slo} for t in TENANTS}}
    return tr.Trace("noisy-neighbour", tuple(requests)), params


def capacity(
    config: EngineConfig | None,
    settings: Settings,
    *,
    n: int = 2000,
    seed: int = 3,
    prompt_scale: float = 1.0,
    output_scale: float = 1.0,
) -> float:
    """Completions per second of about ``n`` requests of the scenario's lengths sent at once."""
    trace, _ = noisy_neighbour(
        capacity_req_s=n / 30.0,
        seed=seed,
        duration_s=10.0,
        share=1.0,
        burst=1.0,
        prompt_scale=prompt_scale,
        output_scale=output_scale,
    )
    burst = tr.Trace(
        "burst",
        tuple(
            tr.TraceRequest(
                id=r.id,
                arrival=0.0,
                prompt_tokens=r.prompt_tokens,
                output_tokens=r.output_tokens,
                max_tokens=r.max_tokens,
            )
            for r in trace.requests
        ),
    )
    res = simulate(burst, settings, config)
    return len(burst) / max(c.finished_at for c in res.completions)
