"""The autopilot: choose the scheduler's γ online, for the traffic being served, from the past only.

How it decides (README, "The autopilot"). Each candidate setting — uniboost at a fixed γ on a
log grid, the defaults (γ-Ada), and sarathi (vLLM's own order, the guard's reference) — has a
*shadow*: a simulator that replays the replica's own traffic under that setting, continuously,
from the moment the autopilot started. A shadow never starts from an empty engine and never
judges a setting over a few minutes: it answers "how would this setting have served everything
so far", which is what a fixed setting chosen with hindsight is scored on. Every ``interval_s``
the autopilot compares the shadows on the same requests — those that arrived in the last
``window_s`` before the shadows' clock — among the candidates whose P99 TTLT is within
``ttlt_guard`` and whose throughput is within ``throughput_guard`` of sarathi's (and, when
``ttft_p99_guard`` is set, whose P99 TTFT is within it of sarathi's).

The candidates lie on one axis, from size-first (a small γ) to age-first (a large γ, γ-Ada,
sarathi), and a move along it is not symmetric: a move down promotes short requests and costs
nothing, a move up flushes the long requests a small γ held back onto everyone — a cost the
shadows, each running one setting all along, do not see. So among the candidates within ``tie``
of the lowest P95 TTFT the autopilot targets the lowest on the axis, and moves down to it as soon
as it is tied or better (while the load is light every order ties, and the size-first one is then
already in place when a burst comes: the shadows see a burst late and diluted in their window);
it moves up only for the ``hysteresis`` margin, after ``min_dwell_s``, or when the running choice
breaks the guard on ``guard_patience`` decisions in a row.

What it sees (``Observation``) is what a live replica knows: arrivals (prompt length, the client's
cap, tenant, type — never the output length), completions (with their output lengths), and how
many tokens each request in flight has generated so far. The shadows run ``delay_s`` behind
"now", so most requests they replay have completed and their lengths are known; a request still
in flight gets an imputed length — the median of recently completed lengths longer than what it
has generated so far — never its true one.

One implementation serves the simulator (``replay_with_autopilot``: ``tailpilot sim
--autopilot`` and ``compare``) and a live cluster (the recorder feeds it observations).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler.metrics import Completion
from scheduler.settings import Settings
from sim.engine import EngineConfig, SimResult, Simulator
from sim.traces import Trace, TraceRequest


def log_grid(lo: float, hi: float, per_decade: int) -> tuple[float, ...]:
    """``per_decade`` points per decade from ``lo`` to ``hi`` inclusive, rounded to 3 significant
    digits."""
    n = round(math.log10(hi / lo) * per_decade)
    return tuple(float(f"{lo * 10 ** (k / per_decade):.3g}") for k in range(n + 1))


GAMMA_GRID = log_grid(0.001, 10.0, 3)  # 0.001, 0.00215, 0.00464, 0.01, ... 10 /s


class AutopilotConfig(BaseModel):
    """The autopilot's own knobs (tunable like any setting; errors name the field)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gammas: tuple[float, ...] = Field(GAMMA_GRID, min_length=1, max_length=64)
    with_defaults: bool = True  # γ-Ada (the defaults) as a candidate
    with_sarathi: bool = (
        True  # vLLM's own order as a candidate (it is always the guard's reference)
    )
    interval_s: float = Field(60.0, ge=1.0, le=3_600.0)
    delay_s: float = Field(60.0, ge=0.0, le=3_600.0)
    window_s: float = Field(3_600.0, ge=60.0, le=86_400.0)
    # Requests are compared only once they arrived this long before the shadows' clock: a request
    # a small γ holds back shows its wait only later, and counted early (censored at its wait so
    # far) it would flatter exactly the settings that starve.
    settle_s: float = Field(0.0, ge=0.0, le=86_400.0)
    min_requests: int = Field(100, ge=10, le=1_000_000)
    # A move up the size-to-age axis (``Autopilot._rank``) takes a candidate this much better on
    # P95 TTFT: ``leave_defaults`` from the defaults (only sarathi lies above them), ``hysteresis``
    # from anything else. It flushes a small γ's held-back backlog onto everyone — a cost the
    # shadows, each running one setting all along, do not see. Moves down take a tie (``tie``).
    leave_defaults: float = Field(0.15, ge=0.0, le=1.0)
    hysteresis: float = Field(0.15, ge=0.0, le=1.0)
    # Candidates within this fraction of the lowest P95 TTFT are tied; with ``prefer_small`` the one
    # that promotes short requests most is chosen among them (``Autopilot._choose``), else the
    # lowest. Off by default: it sat a held-out trace of bursty long prompts on γ 0.001 while the
    # candidates tied, and that trace is where a small γ loses (README, "The autopilot").
    tie: float = Field(0.03, ge=0.0, le=1.0)
    prefer_small: bool = False
    # A window's P99 TTLT moves by a few percent from one minute to the next; leaving a choice for
    # the guard (often a move up the size-to-age axis, which flushes a held-back backlog) takes a
    # break on this many decisions in a row.
    guard_patience: int = Field(2, ge=1, le=100)
    min_dwell_s: float = Field(600.0, ge=0.0, le=86_400.0)  # no switch sooner after the last one
    ttlt_guard: float = Field(1.02, ge=1.0, le=10.0)
    throughput_guard: float = Field(0.99, ge=0.0, le=1.0)
    # Off by default: the objective is P95 TTFT, and the small γ that wins it holds the longest
    # prompts back (README, "The autopilot": P99 TTFT up to 4× sarathi's). Set, a candidate must
    # also keep its P99 TTFT within this factor of sarathi's — the operator's price for the tail.
    ttft_p99_guard: float | None = Field(None, ge=1.0, le=100.0)
    history: int = Field(2_000, ge=10, le=1_000_000)  # completed lengths kept for imputation

    @model_validator(mode="after")
    def _gammas_in_range(self) -> AutopilotConfig:
        for g in self.gammas:
            if not 1e-6 <= g <= 1e6:
                raise ValueError(f"gammas: {g} is outside the safe range [1e-6, 1e6]")
        return self


# --- what the controller sees ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Arrival:
    """A request as the replica knows it on arrival: no output length."""

    id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    tenant: str = "default"
    type: str = "chat"


@dataclass(frozen=True, slots=True)
class Observation:
    """What happened since the previous observation, up to ``now``."""

    now: float
    arrivals: Sequence[Arrival] = ()
    completions: Sequence[Completion] = ()
    generated: Mapping[str, int] = field(
        default_factory=dict
    )  # tokens so far, per request in flight


def _arrival_order(a: Arrival) -> tuple[float, str]:
    return a.arrival, a.id


@dataclass(frozen=True, slots=True)
class CandidateFigures:
    ttft_p95: float
    ttft_p99: float
    ttlt_p99: float
    throughput_tok_s: float
    feasible: bool


@dataclass(slots=True)
class Decision:
    """One decision: what was chosen, why, and what it was predicted to do."""

    at: float
    choice: str
    settings: dict[str, Any]
    changed: bool
    reason: str
    figures: dict[str, CandidateFigures]
    requests: int  # in the comparison window
    cpu_s: float  # the controller's CPU time for this interval (shadows included)
    previous: str = ""  # what ran before this decision ("" when the same as ``choice``)

    def predicted(self) -> dict[str, float | None]:
        """The predicted change of a switch: the chosen candidate's figures over the previous
        one's, minus one, on the window's requests (empty when nothing changed)."""
        new, old = self.figures.get(self.choice), self.figures.get(self.previous)
        if not self.changed or new is None or old is None:
            return {}
        pairs = {
            "ttft_p95": (new.ttft_p95, old.ttft_p95),
            "ttft_p99": (new.ttft_p99, old.ttft_p99),
            "ttlt_p99": (new.ttlt_p99, old.ttlt_p99),
            "throughput_tok_s": (new.throughput_tok_s, old.throughput_tok_s),
        }
        return {k: (a / b - 1.0 if b > 0 else None) for k, (a, b) in pairs.items()}


GUARD_SLACK = 0.02  # of the guard's ratios, for the running choice only


# --- candidates and their shadows ---------------------------------------------------------------
def candidates(base: Settings, config: AutopilotConfig) -> dict[str, Settings]:
    """The settings the autopilot chooses among, by name: ``gamma=<g>`` for each grid point
    (uniboost with γ-Ada off; the base document's other uniboost parameters kept), ``defaults``
    (uniboost with γ-Ada), ``sarathi``. Engine limits are the base document's."""
    engine = base.engine.model_dump()
    params = base.params.model_dump() if base.policy == "uniboost" else {}
    out: dict[str, Settings] = {}
    if config.with_sarathi:
        out["sarathi"] = Settings.model_validate({"policy": "sarathi", "engine": engine})
    if config.with_defaults:
        out["defaults"] = Settings.model_validate({"policy": "uniboost", "engine": engine})
    for g in config.gammas:
        p = {**params, "gamma": g, "gamma_ada": False}
        p["gamma_min"], p["gamma_max"] = (
            min(p.get("gamma_min", g), g),
            max(p.get("gamma_max", g), g),
        )
        out[f"gamma={g:g}"] = Settings.model_validate(
            {"policy": "uniboost", "params": p, "engine": engine}
        )
    return out


class _Shadow:
    """One candidate's continuous replay of the observed traffic, with the per-request latencies
    the comparison reads (completed ones by id; unfinished ones are censored at the clock)."""

    def __init__(self, settings: Settings, engine: EngineConfig) -> None:
        self.sim = Simulator([], settings, engine)
        self.done: dict[
            str, tuple[float, float, float, int]
        ] = {}  # id -> (ttft, ttlt, finished_at, tokens)

    def advance(self, requests: Sequence[TraceRequest], t: float) -> None:
        if requests:
            self.sim.extend_arrivals(requests)
        self.sim.advance_to(t)
        done, _ = self.sim.drain()
        for c in done:
            self.done[c.id] = (
                c.first_token_at - c.arrival,
                c.finished_at - c.arrival,
                c.finished_at,
                c.output_tokens,
            )

    def first_tokens(self) -> dict[str, float]:
        """First-token times of requests in flight that have one."""
        return {r.id: r.first_token_at for r in self.sim.running if r.first_token_at is not None}

    def forget(self, ids: Iterable[str]) -> None:
        for rid in ids:
            self.done.pop(rid, None)


class Autopilot:
    """The controller: feed it ``Observation``s (``observe``); every ``interval_s`` it returns a
    ``Decision``. Deterministic: the same observations give the same decisions."""

    def __init__(
        self,
        base: Settings,
        config: AutopilotConfig | None = None,
        engine: EngineConfig | None = None,
    ) -> None:
        self.config = config or AutopilotConfig()
        self.engine = engine or EngineConfig()
        self.base = base
        self.options = candidates(base, self.config)
        self.shadows = {name: _Shadow(s, self.engine) for name, s in self.options.items()}
        self.reference = "sarathi" if "sarathi" in self.shadows else next(iter(self.shadows))
        self.current = "defaults" if "defaults" in self.options else next(iter(self.options))
        self.decisions: list[Decision] = []
        # Arrived, not yet handed to the shadows, in (arrival, id) order: a live replica reports a
        # request when it first sees it in flight or finished, not always in arrival order.
        self._pending: list[Arrival] = []
        self.late = (
            0  # requests first seen after the shadows had passed their arrival (not replayed)
        )
        self._lengths: dict[str, int] = {}  # output lengths of completed requests not yet replayed
        self._recent: deque[int] = deque(maxlen=self.config.history)  # completed lengths
        self._window: deque[tuple[float, str]] = deque()  # (arrival, id) replayed, in the window
        self._shadow_clock: float | None = None
        self._next_decision: float | None = None
        self._last_switch = -math.inf
        self._breaks = 0  # consecutive decisions on which the running choice broke the guard
        self._hold_until = -math.inf  # step_back: no switch before this but to keep the guard
        self._cpu = 0.0

    # --- feeding ---------------------------------------------------------------------------
    def observe(self, obs: Observation) -> Decision | None:
        started = time.process_time()
        for a in obs.arrivals:
            if self._shadow_clock is not None and a.arrival <= self._shadow_clock:
                self.late += 1  # the shadows are past it: replaying it would rewrite their past
                continue
            bisect.insort(self._pending, a, key=_arrival_order)
        for c in obs.completions:
            self._lengths[c.id] = c.output_tokens
            self._recent.append(c.output_tokens)
        self._replay_until(obs.now - self.config.delay_s, obs.generated)
        self._cpu += time.process_time() - started
        if self._next_decision is None:
            self._next_decision = obs.now + self.config.interval_s
        if obs.now < self._next_decision:
            return None
        self._next_decision = obs.now + self.config.interval_s
        started = time.process_time()
        decision = self._decide(obs.now)
        self._cpu += time.process_time() - started
        decision.cpu_s, self._cpu = self._cpu, 0.0
        self.decisions.append(decision)
        return decision

    def _imputed(self, a: Arrival, generated: int) -> int:
        """A length for a request still in flight: the median of recently completed lengths
        above what it has generated, within its cap (never its true length: it is unknown)."""
        recent = sorted(self._recent)
        i = bisect.bisect_right(recent, generated)
        guess = recent[(i + len(recent)) // 2] if i < len(recent) else generated + 1
        return max(1, min(a.max_tokens, max(guess, generated + 1)))

    def _replay_until(self, t: float, generated: Mapping[str, int]) -> None:
        if self._shadow_clock is not None and t <= self._shadow_clock:
            return
        batch: list[TraceRequest] = []
        due = bisect.bisect_right(self._pending, t, key=lambda a: a.arrival)
        taken, self._pending = self._pending[:due], self._pending[due:]
        for a in taken:
            out = self._lengths.pop(a.id, None)
            if out is None:
                out = self._imputed(a, generated.get(a.id, 0))
            batch.append(
                TraceRequest(
                    id=a.id,
                    arrival=a.arrival,
                    prompt_tokens=a.prompt_tokens,
                    output_tokens=out,
                    max_tokens=max(a.max_tokens, 1),
                    tenant=a.tenant,
                    type=a.type,
                )
            )
            self._window.append((a.arrival, a.id))
        for shadow in self.shadows.values():
            shadow.advance(batch, t)
        self._shadow_clock = t
        horizon = t - self.config.window_s - self.config.settle_s
        gone = []
        while self._window and self._window[0][0] < horizon:
            gone.append(self._window.popleft()[1])
        if gone:
            for shadow in self.shadows.values():
                shadow.forget(gone)

    # --- deciding ----------------------------------------------------------------------------
    def _figures(
        self, shadow: _Shadow, clock: float, ids: list[str], arrivals: np.ndarray
    ) -> tuple[float, ...]:
        """P95/P99 TTFT, P99 TTLT and throughput of one shadow over the window's requests; a
        request not served yet counts with its wait so far (a lower bound of its latency)."""
        censored = clock - arrivals
        ttft, ttlt = censored.copy(), censored.copy()
        first = shadow.first_tokens()
        tokens = 0
        lo = clock - self.config.window_s
        for i, rid in enumerate(ids):
            done = shadow.done.get(rid)
            if done is not None:
                ttft[i], ttlt[i] = done[0], done[1]
                if done[2] >= lo:
                    tokens += done[3]
            elif rid in first:
                ttft[i] = first[rid] - arrivals[i]
        p95, p99 = np.percentile(ttft, [95.0, 99.0])
        return (
            float(p95),
            float(p99),
            float(np.percentile(ttlt, 99.0)),
            tokens / self.config.window_s,
        )

    def _decide(self, now: float) -> Decision:
        cfg = self.config
        clock = self._shadow_clock if self._shadow_clock is not None else now
        settled = [(a, rid) for a, rid in self._window if a <= clock - cfg.settle_s]
        ids = [rid for _, rid in settled]
        if len(ids) < cfg.min_requests:
            return Decision(
                now,
                self.current,
                self.options[self.current].to_dict(),
                False,
                f"waiting for data: {len(ids)} of {cfg.min_requests} requests in the window",
                {},
                len(ids),
                0.0,
            )
        arrivals = np.fromiter((a for a, _ in settled), float, len(ids))
        raw = {name: self._figures(s, clock, ids, arrivals) for name, s in self.shadows.items()}
        ref = raw[self.reference]
        figures = {
            name: CandidateFigures(
                p95, p99, ttlt, tput, feasible=self._keeps_guard(p99, ttlt, tput, ref, slack=0.0)
            )
            for name, (p95, p99, ttlt, tput) in raw.items()
        }
        previous = self.current
        best, changed, reason = self._choose(figures, now, ref)
        if changed:
            self.current = best
            self._last_switch = now
        return Decision(
            now,
            self.current,
            self.options[self.current].to_dict(),
            changed,
            reason,
            figures,
            len(ids),
            0.0,
            previous if changed else "",
        )

    def _keeps_guard(
        self,
        ttft_p99: float,
        ttlt_p99: float,
        throughput: float,
        ref: tuple[float, ...],
        slack: float,
    ) -> bool:
        """Whether figures keep the guard against sarathi's (``ref``: P95/P99 TTFT, P99 TTLT,
        throughput), each ratio loosened by ``slack``."""
        cfg = self.config
        keeps = (
            ttlt_p99 <= (cfg.ttlt_guard + slack) * ref[2]
            and throughput >= (cfg.throughput_guard - slack) * ref[3]
        )
        if cfg.ttft_p99_guard is not None:
            keeps = keeps and ttft_p99 <= (cfg.ttft_p99_guard + slack) * ref[1]
        return keeps

    def step_back(self, now: float, to: str = "defaults", hold_s: float = 3_600.0) -> None:
        """The live driver stepped the replica back to ``to`` (its realized changes were worse than
        predicted): run on it, and switch away only to keep the guard until ``now + hold_s``."""
        if to not in self.options:
            raise KeyError(f"no candidate named {to!r}")
        self.current, self._last_switch, self._hold_until = to, now, now + hold_s

    def _rank(self, name: str) -> float:
        """A candidate's place on the size-to-age axis: its γ for a fixed γ; the defaults (γ-Ada)
        above the grid; sarathi (vLLM's order, by age) last. Moving down the axis promotes short
        requests — cheap; moving up flushes what a small γ held back onto everyone — costly."""
        s = self.options[name]
        if s.policy != "uniboost":
            return math.inf
        return s.params.gamma if not s.params.gamma_ada else 1e9

    def _choose(
        self, figures: dict[str, CandidateFigures], now: float, ref: tuple[float, ...]
    ) -> tuple[str, bool, str]:
        """The candidate to run next, whether that is a switch, and why.

        Among the feasible candidates within ``tie`` of the lowest P95 TTFT, the one lowest on the
        size-to-age axis (``_rank``) is the target: while the load is light every order serves the
        same, and the one that promotes short requests is already in place when a burst comes
        (the shadows see a burst only ``delay_s`` late, and diluted in their window). A move down
        the axis is cheap and is taken whenever the target is tied or better; a move up — or a
        move off a tied current choice — takes the ``hysteresis`` margin and ``min_dwell_s``."""
        cfg = self.config
        feasible = [n for n, f in figures.items() if f.feasible]
        if not feasible:
            return self.current, False, "no candidate keeps the guard on this window: kept"
        low = min(figures[n].ttft_p95 for n in feasible)
        tied = [n for n in feasible if figures[n].ttft_p95 <= (1.0 + cfg.tie) * low]
        target = (
            min(tied, key=lambda n: (self._rank(n), n))
            if cfg.prefer_small
            else min(feasible, key=lambda n: (figures[n].ttft_p95, n != self.current, n))
        )
        current, best = figures[self.current], figures[target]
        if target == self.current:
            return (
                target,
                False,
                f"{target} is still the choice ({current.ttft_p95:.3g} s P95 TTFT)",
            )
        # The running choice keeps a little slack on the guard: a window's P99 TTLT moves by a
        # percent or two from one minute to the next, and a switch has a cost.
        current_ok = self._keeps_guard(
            current.ttft_p99, current.ttlt_p99, current.throughput_tok_s, ref, slack=GUARD_SLACK
        )
        against = f"P99 TTLT {current.ttlt_p99:.3g} s vs sarathi's {ref[2]:.3g} s" + (
            f", P99 TTFT {current.ttft_p99:.3g} s vs {ref[1]:.3g} s" if cfg.ttft_p99_guard else ""
        )
        self._breaks = 0 if current_ok else self._breaks + 1
        if not current_ok and self._breaks >= cfg.guard_patience:
            return target, True, f"{self.current} breaks the guard ({against}); {target} keeps it"
        if now < self._hold_until:
            return (
                self.current,
                False,
                f"{self.current} held after a step back until t={self._hold_until:.0f}",
            )
        if not current_ok:
            return (
                self.current,
                False,
                (
                    f"{self.current} breaks the guard ({against}): kept until it does so "
                    f"{cfg.guard_patience} decisions in a row"
                ),
            )
        down = self._rank(target) < self._rank(self.current)
        margin = cfg.leave_defaults if self.current == "defaults" else cfg.hysteresis
        if down and best.ttft_p95 <= (1.0 + cfg.tie) * current.ttft_p95:
            return (
                target,
                True,
                (
                    f"{target} ({best.ttft_p95:.3g} s P95 TTFT) is at least as good as "
                    f"{self.current} ({current.ttft_p95:.3g} s) and promotes short requests more"
                ),
            )
        if now - self._last_switch < cfg.min_dwell_s:
            return (
                self.current,
                False,
                f"{self.current} kept: switched {now - self._last_switch:.0f} s ago",
            )
        if best.ttft_p95 < (1.0 - margin) * current.ttft_p95:
            return (
                target,
                True,
                (
                    f"{target} beats {self.current} on P95 TTFT: {best.ttft_p95:.3g} s vs "
                    f"{current.ttft_p95:.3g} s over the window's requests"
                ),
            )
        return (
            self.current,
            False,
            (
                f"no candidate beats {self.current} by the {margin:.0%} margin "
                f"(target {target}: {best.ttft_p95:.3g} s vs {current.ttft_p95:.3g} s)"
            ),
        )


# --- the simulator's driver -------------------------------------------------------------------
def replay_with_autopilot(
    trace: Trace | Sequence[TraceRequest],
    base: Settings | None = None,
    config: AutopilotConfig | None = None,
    engine: EngineConfig | None = None,
) -> tuple[SimResult, list[Decision]]:
    """Replay ``trace`` with the autopilot choosing the settings every ``interval_s``: the
    replica starts on ``base`` (default: uniboost's defaults); at each decision the controller
    is shown only what a live replica would know by then. Returns the replay's result (its
    settings: the last applied) and the decisions."""
    base = base or Settings.model_validate({"policy": "uniboost"})
    config = config or AutopilotConfig()
    engine = engine or EngineConfig()
    requests = sorted(trace, key=lambda r: (r.arrival, r.id))
    sim = Simulator(requests, base, engine)
    pilot = Autopilot(base, config, engine)
    pilot.current = _name_of(pilot, base)
    t_start = time.perf_counter()
    completions: list[Completion] = []
    rejected_ids: list[str] = []
    next_arrival = 0
    t = requests[0].arrival if requests else 0.0
    end = requests[-1].arrival if requests else 0.0
    while True:
        t += config.interval_s
        sim.advance_to(t)
        new: list[Arrival] = []
        while next_arrival < len(requests) and requests[next_arrival].arrival <= t:
            r = requests[next_arrival]
            new.append(Arrival(r.id, r.arrival, r.prompt_tokens, r.max_tokens, r.tenant, r.type))
            next_arrival += 1
        done, rejected = sim.drain()
        completions += done
        rejected_ids += rejected
        generated = {s.id: s.generated for s in [*sim.running, *sim.waiting] if s.generated}
        decision = pilot.observe(Observation(t, new, done, generated))
        if decision is not None and decision.changed:
            sim.apply_settings(pilot.options[decision.choice])
        if t > end and not sim.running and not len(sim.waiting):
            break
    result = SimResult(
        settings=sim.settings,
        completions=completions,
        rejected=rejected_ids,
        steps=sim.steps,
        iterations=sim.iterations,
        sim_time_s=sim.now,
        wall_s=time.perf_counter() - t_start,
        preemptions=sim.preemptions,
        policy_preemptions=sim.policy_preemptions,
        recomputed_tokens=sim.recomputed_tokens,
        gamma_timeline=sim.gamma_timeline,
    )
    return result, pilot.decisions


def _name_of(pilot: Autopilot, settings: Settings) -> str:
    for name, s in pilot.options.items():
        if s == settings:
            return name
    return pilot.current
