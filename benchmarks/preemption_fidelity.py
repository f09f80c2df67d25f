"""The simulator's KV preemption against vLLM's own scheduler, where preemption dominates.

    python benchmarks/preemption_fidelity.py [--requests 400] [--blocks 1200] [--seed 1]
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 python benchmarks/preemption_fidelity.py --variant 1618:3

A deep queue of long outputs (prompts 200-1,200 tokens, outputs 200-1,500, all waiting at once;
128 seats, a 2,048-token budget, a KV cache far smaller than what the seats grow to) is served by
vLLM 0.32's stock scheduler and KV cache manager in this process (``tests/plugin_harness.py``:
no model, one token sampled per decode) — with prefix caching off, then on (vLLM's default) —
and replayed by the simulator under sarathi (vLLM's order) on the same engine limits. Printed for
each: steps, preemptions, and the prompt tokens computed again after preemptions (the tokens
scheduled beyond every request's prompt and output). The simulator models vLLM's recompute
preemption without a prefix cache: a readmitted victim recomputes its whole prefix, where vLLM
with prefix caching keeps a freed block's hash until the block is reused, and a victim readmitted
before its blocks are reused finds its prefix cached (README, "Where the defaults' own breaks on
BWB come from"). Deterministic; ~35 s on one core (vLLM's scheduler in Python: two runs).
``--variant SEED:K`` serves a sweep variant instead (``sweep_variant``; ~7 minutes for one of
BWB; the tiny model's 4,096 positions need vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):  # tests/: plugin_harness, as benchmarks/fidelity.py uses
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from scheduler.settings import Settings  # noqa: E402
from sim.engine import EngineConfig, Simulator  # noqa: E402
from sim.traces.model import TraceRequest  # noqa: E402

BLOCK_SIZE = 16
MAX_NUM_SEQS = 128
BUDGET = 2048
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class Served:
    """What one engine did with the workload."""

    steps: int
    preemptions: int
    recomputed: int  # prompt tokens computed again after preemptions
    trips: int = 0  # the plugin's circuit breaker: times its policy raised and was replaced


def workload(requests: int, seed: int) -> list[tuple[int, int, list[int]]]:
    """(prompt tokens, output tokens, prompt token ids) per request; prompts share no prefix."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        prompt, output = rng.randrange(200, 1200), rng.randrange(200, 1500)
        out.append((prompt, output, [10 + rng.randrange(4000) for _ in range(prompt)]))
    return out


def needed(reqs: list[tuple[int, int, list[int]]]) -> int:
    """The tokens a run without preemption schedules: each prompt, and each output token but the
    first (sampled by the prefill's last step)."""
    return sum(prompt + output - 1 for prompt, output, _ in reqs)


def served_by_vllm(
    reqs: list[tuple[int, int, list[int]]],
    blocks: int,
    prefix_caching: bool,
    *,
    seats: int = MAX_NUM_SEQS,
    max_model_len: int = MAX_MODEL_LEN,
    arrival_steps: list[int] | None = None,
    settings: dict | None = None,
) -> Served:
    """vLLM's stock scheduler over ``blocks`` KV blocks (block 0 is its null block), in-process;
    every request waiting at the start, or each added before step ``arrival_steps[i]``. With
    ``settings``, tailpilot's plugin scheduler under that document instead."""
    import plugin_harness as harness  # lazy: it loads vLLM

    scheduler = harness.make_scheduler(
        harness.PLUGIN if settings is not None else None,
        settings=settings,
        num_blocks=blocks,
        max_num_seqs=seats,
        max_num_batched_tokens=BUDGET,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=prefix_caching,
        max_model_len=max_model_len,
    )
    hasher = harness.block_hasher(BLOCK_SIZE) if prefix_caching else None
    made = [
        harness.make_request(
            f"r{i}", prompt, output, arrival=float(i), prompt_token_ids=ids, block_hasher=hasher
        )
        for i, (prompt, output, ids) in enumerate(reqs)
    ]
    driver = harness.Driver(scheduler)
    arrivals: dict[int, list] = {}
    for i, request in enumerate(made):
        arrivals.setdefault(0 if arrival_steps is None else arrival_steps[i], []).append(request)
    steps = driver.run(arrivals=arrivals, max_steps=10_000_000)
    scheduled = sum(tokens for record in driver.history for _, tokens in record.scheduled)
    preemptions = sum(len(record.preempted) for record in driver.history)
    trips = scheduler.tp_core.breaker.trips_total if settings is not None else 0
    return Served(steps, preemptions, scheduled - needed(reqs), trips)


def as_trace(reqs: list[tuple[int, int, list[int]]]) -> list[TraceRequest]:
    """The workload as the simulator's requests: all waiting at the start, in order."""
    return [
        TraceRequest(
            id=f"r{i}",
            arrival=i * 1e-6,
            prompt_tokens=prompt,
            output_tokens=output,
            max_tokens=MAX_MODEL_LEN,
        )
        for i, (prompt, output, _) in enumerate(reqs)
    ]


def served_by_simulator(
    reqs: list[tuple[int, int, list[int]]], blocks: int, prefix_caching: bool
) -> Served:
    """The simulator under sarathi on the same limits (``blocks`` − 1 usable blocks)."""
    trace = as_trace(reqs)
    settings = Settings.model_validate(
        {
            "policy": "sarathi",
            "engine": {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": BUDGET},
        }
    )
    engine = EngineConfig(
        num_gpu_blocks=blocks - 1, block_size=BLOCK_SIZE, prefix_caching=prefix_caching
    )
    result = Simulator(trace, settings, engine).run()
    recomputed = sum(c.recomputed_tokens for c in result.completions)
    return Served(result.steps, result.preemptions, recomputed)


def _row(name: str, served: Served) -> str:
    return (
        f"  {name:30s} steps {served.steps:7,d}  preemptions {served.preemptions:5,d}  "
        f"recomputed {served.recomputed:9,d}"
    )


def sweep_variant(spec: str, root: Path) -> None:
    """``--variant SEED:K``: the sweep's variant at the A100 defaults (the simulator's engine: 256
    seats, 25,000 blocks), through vLLM's scheduler with prefix caching off and on. vLLM's
    scheduler has no clock here: a request is added at the step the simulator's mean step time
    under sarathi puts its arrival — an approximation of the traffic's timing, so only vLLM's two
    runs are comparable with each other."""
    from benchmarks.autopilot_sweep import build, pools

    seed, k = (int(x) for x in spec.split(":"))
    trace, how = build(k, seed, pools(root))
    ordered = sorted(trace, key=lambda r: (r.arrival, r.id))
    sarathi = Simulator(ordered, Settings.model_validate({"policy": "sarathi"})).run()
    step_s = max(c.finished_at for c in sarathi.completions) / sarathi.steps
    rng = random.Random(seed)
    reqs = [
        (
            r.prompt_tokens,
            r.output_tokens,
            [10 + rng.randrange(4000) for _ in range(r.prompt_tokens)],
        )
        for r in ordered
    ]
    total = needed(reqs)
    recomputed = sum(c.recomputed_tokens for c in sarathi.completions)
    print(
        f"seed {seed} variant {k}: {how} ({len(reqs)} requests, {total:,} tokens without "
        "preemption)"
    )
    print(_row("simulator (sarathi)", Served(sarathi.steps, sarathi.preemptions, recomputed)))
    blocks = EngineConfig().num_gpu_blocks + 1
    longest = max(prompt + output for prompt, output, _ in reqs) + BLOCK_SIZE
    steps = [int(r.arrival / step_s) for r in ordered]
    for caching in (False, True):
        served = served_by_vllm(
            reqs, blocks, caching, seats=256, max_model_len=longest, arrival_steps=steps
        )
        name = f"vLLM, prefix caching {'on' if caching else 'off'}"
        print(_row(name, served))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--blocks", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--variant", help="SEED:K: a sweep variant at the A100 defaults instead")
    ap.add_argument("--traces", type=Path, default=REPO / "traces")
    args = ap.parse_args()
    if args.variant:
        sweep_variant(args.variant, args.traces)
        return
    reqs = workload(args.requests, args.seed)
    total = needed(reqs)
    rows = {
        "vLLM, prefix caching off": served_by_vllm(reqs, args.blocks, prefix_caching=False),
        "simulator, prefix caching off": served_by_simulator(reqs, args.blocks, False),
        "vLLM, prefix caching on": served_by_vllm(reqs, args.blocks, prefix_caching=True),
        "simulator, prefix caching on": served_by_simulator(reqs, args.blocks, True),
    }
    print(
        f"{args.requests} requests, {total:,} tokens without preemption, {args.blocks} blocks of "
        f"{BLOCK_SIZE} tokens, {MAX_NUM_SEQS} seats, a {BUDGET}-token budget"
    )
    for name, served in rows.items():
        share = served.recomputed / (served.recomputed + total)
        print(f"{_row(name, served)} ({share:.1%} of the tokens scheduled)")


if __name__ == "__main__":
    main()
