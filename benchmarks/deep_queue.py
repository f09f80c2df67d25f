"""Deep waiting queue: replay a long-prompt trace far above one replica's capacity under every
policy and compare each replay's wall time with fcfs's in the same run.

    python benchmarks/deep_queue.py [--requests 10500] [--load 20] [--prompt-mean 12000]
        [--prompt-spread 4000] [--policies fcfs,uniboost,...] [--repeat 1] [--profile uniboost]
        [--hash] [--hash-bundled] [--check-invariants]
    python benchmarks/deep_queue.py --trace traces/mooncake/conversation_trace.jsonl

``--trace FILE`` replays a public trace at its recorded rate instead (Mooncake's conversation
trace: 12,031 long prompts, a mean of ~12,000 tokens, arriving over an hour far faster than one
replica serves them — thousands wait).

The trace is synthetic and seeded: prompts ~``prompt_mean`` ± ``prompt_spread`` tokens (uniform),
short outputs (log-normal, median 120 tokens, capped at 1,000), four tenants, Poisson arrivals at
``load`` × the replica's capacity. The capacity is the rate at which one replica (the default
``sim.engine.EngineConfig``: A100-80GB / Llama-3-8B step model, 25,000 KV blocks, and the
default engine settings) can prefill the mean prompt in ``max_num_batched_tokens`` chunks: at 20×
nearly every arrival queues, so the waiting queue grows to ~95% of the requests (the ``peak_wait``
column: the most requests waiting at once, sampled at every step).

Rows: fcfs, sarathi, sjf, srpt, las, distboost, uniboost (defaults: MemGuard and γ-Ada on),
uniboost-nomg (MemGuard off), tie and vtc; sjf, srpt and tie use the ``history`` predictor (the one
a live replica has). Each replay runs on one core; ``ratio`` is its wall time over fcfs's from this
same run (the machine is shared: only ratios taken together mean anything). ``uptime`` load is
printed before and after. ``refit_s`` is the part of the wall time spent in the history predictor's
refits (every 10 simulated seconds; ``scheduler.policies.predictors``), which the queue does not
touch. ``us/step`` is the wall time per simulated step and ``step_ratio`` its ratio to fcfs's:
what a policy costs per step, apart from how many steps its schedule makes; ``q_ops/step`` counts
the waiting queue's operations (pushes, removals, ordered reads) per step.

``--hash`` prints a SHA-256 over every completion's id and timestamps (arrival, scheduled,
first token, finished), preemptions and recomputed tokens, per policy: equal hashes before and
after a change mean the replays are bit-identical. ``--hash-bundled`` does the same on the
bundled Azure conv window at its recorded rate (no timing).

Target (issue): every policy ≤ 2× fcfs at any load.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scheduler.compiled import is_compiled  # noqa: E402
from scheduler.policies.predictors import PREDICTORS, HistoryPredictor  # noqa: E402
from scheduler.policies.queue import WaitingQueue  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from sim.engine import EngineConfig, Simulator  # noqa: E402
from sim.traces import TraceRequest, load_bundled, load_trace, scale_rate  # noqa: E402

PREDICTED = {"sjf", "srpt", "tie"}
ROWS = {
    "fcfs": ("fcfs", {}),
    "sarathi": ("sarathi", {}),
    "sjf": ("sjf", {"predictor": "history"}),
    "srpt": ("srpt", {"predictor": "history"}),
    "las": ("las", {}),
    "distboost": ("distboost", {}),
    "uniboost": ("uniboost", {}),
    "uniboost-nomg": ("uniboost", {"memguard": False}),
    "tie": ("tie", {"predictor": "history"}),
    "vtc": ("vtc", {}),
    # Not in the default rows: the oracle (a per-request prediction, no refits) and γ pinned.
    "sjf-oracle": ("sjf", {"predictor": "oracle"}),
    "srpt-oracle": ("srpt", {"predictor": "oracle"}),
    "tie-oracle": ("tie", {"predictor": "oracle"}),
    "uniboost-pinned": ("uniboost", {"gamma_ada": False}),
}
DEFAULT_ROWS = (
    "fcfs",
    "sarathi",
    "sjf",
    "srpt",
    "las",
    "distboost",
    "uniboost",
    "uniboost-nomg",
    "tie",
    "vtc",
)


def settings_for(row: str) -> Settings:
    policy, params = ROWS[row]
    return Settings.model_validate({"policy": policy, "params": params})


def capacity_rps(prompt_tokens: float, config: EngineConfig | None = None) -> float:
    """Requests per second one replica can prefill at ``prompt_tokens`` each (chunked prefill at
    the default token budget, one chunk per step; decode of the short outputs ignored)."""
    model = (config or EngineConfig()).step_model
    budget = Settings.model_validate({"policy": "fcfs"}).engine.max_num_batched_tokens
    left, t = int(prompt_tokens), 0.0
    while left > 0:
        c = min(budget, left)
        t += model.step_time(c, c * c, 0, 0)
        left -= c
    return 1.0 / t


def deep_trace(
    n: int, load: float, prompt_mean: int, prompt_spread: int, seed: int = 0
) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    rate = load * capacity_rps(prompt_mean)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    prompts = rng.integers(max(1, prompt_mean - prompt_spread), prompt_mean + prompt_spread + 1, n)
    outputs = np.clip(np.rint(rng.lognormal(np.log(120.0), 0.8, n)), 1, 1000).astype(int)
    return [
        TraceRequest(
            id=f"d{i:06d}",
            arrival=round(float(a), 6),
            prompt_tokens=int(p),
            output_tokens=int(o),
            max_tokens=1024,
            tenant=f"t{i % 4}",
        )
        for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))
    ]


class _CountingQueue(WaitingQueue):
    """The waiting queue, counting its operations (pushes, removals, ordered reads)."""

    operations = 0

    def push(self, *args, **kw):  # type: ignore[no-untyped-def]
        self.operations += 1
        return super().push(*args, **kw)

    def remove(self, *args, **kw):  # type: ignore[no-untyped-def]
        self.operations += 1
        return super().remove(*args, **kw)

    def ordered(self, *args, **kw):  # type: ignore[no-untyped-def]
        self.operations += 1
        return super().ordered(*args, **kw)


class _TimedHistory(HistoryPredictor):
    """The history predictor, timing its refits (``refit_s``)."""

    refit_s = 0.0

    def refit(self) -> int:
        started = time.perf_counter()
        try:
            return super().refit()
        finally:
            self.refit_s += time.perf_counter() - started


class _Sampled(Simulator):
    """Tracks the deepest waiting queue (one len() per step: noise next to a step's cost) and,
    with ``count_ops``, counts the waiting queue's operations (a queue of its own whose calls go
    through Python: the counting replay is not the timed one). Subclasses, not patched methods:
    the compiled core's methods cannot be replaced on an instance."""

    peak_wait = 0

    def __init__(self, *args, count_ops: bool = False, **kw):
        super().__init__(*args, **kw)
        if count_ops:  # before any arrival: the queue is empty
            self.waiting = _CountingQueue(self.policy)

    def _step(self):
        super()._step()
        if len(self.waiting) > self.peak_wait:
            self.peak_wait = len(self.waiting)


def completion_hash(completions) -> str:
    h = hashlib.sha256()
    for c in sorted(completions, key=lambda c: c.id):
        h.update(
            repr(
                (
                    c.id,
                    c.arrival,
                    c.scheduled_at,
                    c.first_token_at,
                    c.finished_at,
                    c.output_tokens,
                    c.preemptions,
                    c.recomputed_tokens,
                )
            ).encode()
        )
    return h.hexdigest()[:16]


def replay(trace, row: str, *, check_invariants: bool = False, profile: bool = False):
    """One timed replay of ``row``: (wall s, result, peak waiting, profile)."""
    sim = _Sampled(trace, settings_for(row), check_invariants=check_invariants)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    res = sim.run()
    if prof:
        prof.disable()
    return time.perf_counter() - t0, res, sim.peak_wait, prof


def instrumented(trace, row: str) -> tuple[int, float]:
    """An untimed replay of ``row`` counting the waiting queue's operations and timing the
    history predictor's refits (the same refits as the timed replay's: replays are
    deterministic). Kept apart from the timed replay: on the compiled core, a Python subclass's
    methods are called through Python, which would slow the timed replay."""
    PREDICTORS["history"] = _TimedHistory
    try:
        sim = _Sampled(trace, settings_for(row), count_ops=True)
    finally:
        PREDICTORS["history"] = HistoryPredictor
    sim.run()
    assert isinstance(sim.waiting, _CountingQueue)
    refit_s = sim.predictor.refit_s if isinstance(sim.predictor, _TimedHistory) else 0.0
    return sim.waiting.operations, refit_s


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=10500)
    ap.add_argument(
        "--load",
        type=float,
        default=20.0,
        help="arrival rate as a multiple of one replica's capacity",
    )
    ap.add_argument("--prompt-mean", type=int, default=12000)
    ap.add_argument("--prompt-spread", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--trace", default="", help="replay this trace file at its recorded rate instead"
    )
    ap.add_argument(
        "--policies", default=",".join(DEFAULT_ROWS), help=f"rows among {', '.join(ROWS)}"
    )
    ap.add_argument("--repeat", type=int, default=1, help="replays per policy (best is reported)")
    ap.add_argument("--profile", default="", help="row to cProfile (printed after the table)")
    ap.add_argument(
        "--hash", action="store_true", help="print a hash of every replay's completions"
    )
    ap.add_argument(
        "--hash-bundled",
        action="store_true",
        help="also hash every policy's replay of the bundled Azure conv window",
    )
    ap.add_argument(
        "--bundled-rate-scale",
        type=float,
        default=1.0,
        help="--hash-bundled: replay the window at this multiple of its rate",
    )
    ap.add_argument(
        "--check-invariants", action="store_true", help="assert the engine's invariants every step"
    )
    args = ap.parse_args()
    rows = [r for r in args.policies.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    if args.trace:
        loaded = load_trace(args.trace)
        trace = list(loaded)
        mean_prompt = float(np.mean([r.prompt_tokens for r in trace]))
        print(
            f"trace {loaded.name}: {len(trace)} requests at its recorded rate "
            f"({loaded.rate:.2f} req/s over {loaded.duration:.0f} s), mean prompt "
            f"{mean_prompt:.0f} tokens = {loaded.rate / capacity_rps(mean_prompt):.1f}x one "
            "replica's capacity"
        )
    else:
        trace = deep_trace(
            args.requests, args.load, args.prompt_mean, args.prompt_spread, args.seed
        )
        cap = capacity_rps(args.prompt_mean)
        print(
            f"deep-queue trace: {len(trace)} requests, "
            f"prompts {args.prompt_mean}±{args.prompt_spread} tokens, "
            f"{args.load:g}x capacity ({cap:.3f} req/s) = {args.load * cap:.2f} req/s over "
            f"{trace[-1].arrival:.0f} s"
        )
    print(f"core: {'compiled (mypyc)' if is_compiled() else 'pure Python'}")
    print(f"load average before: {load_avg()}")
    print(
        f"{'policy':>14} {'wall_s':>8} {'ratio':>6} {'us/step':>7} {'step_ratio':>10} "
        f"{'q_ops/step':>10} {'refit_s':>7} {'peak_wait':>9} {'steps':>8} {'events':>7} "
        f"{'preempt':>8} {'sim_s':>8}" + ("  hash" if args.hash else ""),
        flush=True,
    )
    walls: dict[str, float] = {}
    per_step: dict[str, float] = {}
    profiled = None
    for row in rows:
        runs = [
            replay(trace, row, check_invariants=args.check_invariants) for _ in range(args.repeat)
        ]
        wall, res, peak, _ = min(runs, key=lambda x: x[0])
        queue_ops, refit_s = instrumented(trace, row)
        walls[row] = wall
        per_step[row] = wall / max(1, res.steps)
        base, base_step = walls.get("fcfs"), per_step.get("fcfs")
        ratio = f"{wall / base:6.2f}" if base else f"{'-':>6}"
        step_ratio = f"{per_step[row] / base_step:10.2f}" if base_step else f"{'-':>10}"
        print(
            f"{row:>14} {wall:8.2f} {ratio} {1e6 * per_step[row]:7.1f} {step_ratio} "
            f"{queue_ops / max(1, res.steps):10.2f} {refit_s:7.2f} {peak:9d} {res.steps:8d} "
            f"{res.iterations:7d} {res.preemptions:8d} {res.sim_time_s:8.0f}"
            + (f"  {completion_hash(res.completions)}" if args.hash else ""),
            flush=True,
        )
    print(f"load average after: {load_avg()}")
    if "fcfs" in walls:
        worst = max(walls, key=lambda r: walls[r])
        print(f"worst: {worst} at {walls[worst] / walls['fcfs']:.2f}x fcfs (target <= 2x)")
    if args.hash_bundled:
        bundled = load_bundled()
        if args.bundled_rate_scale != 1.0:
            bundled = scale_rate(bundled, args.bundled_rate_scale)
        print(f"bundled trace {bundled.name}: {len(bundled)} requests at {bundled.rate:.2f} req/s")
        for row in rows:
            res = Simulator(bundled, settings_for(row)).run()
            print(f"{row:>14} {completion_hash(res.completions)}", flush=True)
    if args.profile:
        profiled = replay(trace, args.profile, profile=True)[3]
        buf = io.StringIO()
        st = pstats.Stats(profiled, stream=buf)
        st.sort_stats("tottime").print_stats(25)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
