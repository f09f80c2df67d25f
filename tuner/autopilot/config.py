"""The autopilot's own knobs (``AutopilotConfig``, tunable like any setting:
``tuner.autopilot.tune``) and the γ grid its candidates span by default. The decision rule that
reads them is ``tuner.autopilot.controller``, which the rest of the project imports them from."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler.settings import (
    GAMMA_MAX_SAFE,
    GAMMA_MIN_SAFE,
    GAMMA_USEFUL_MAX,
    GAMMA_USEFUL_MIN,
    Settings,
)
from tuner.autopilot.candidates import Candidate, SearchConfig, candidate_space
from tuner.autopilot.promise import Promise


def log_grid(lo: float, hi: float, per_decade: int) -> tuple[float, ...]:
    """``per_decade`` points per decade from ``lo`` to ``hi`` inclusive, rounded to 3 significant
    digits."""
    n = round(math.log10(hi / lo) * per_decade)
    return tuple(float(f"{lo * 10 ** (k / per_decade):.3g}") for k in range(n + 1))


GAMMA_GRID = log_grid(GAMMA_USEFUL_MIN, GAMMA_USEFUL_MAX, 3)  # 0.001, 0.00215, 0.00464, ... 10 /s
# The running choice is judged to break the promise only beyond this much more than a newcomer's
# slack, of the promise's ratios (a window's tail moves by a percent or two from one minute to the
# next, and a switch has a cost); a stress test's verdict is held to the same line
# (``stress_slack``).
GUARD_SLACK = 0.02


class AutopilotConfig(BaseModel):
    """The autopilot's own knobs (tunable like any setting; errors name the field)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gammas: tuple[float, ...] = Field(GAMMA_GRID, min_length=1, max_length=64)
    # The operator's other knobs, chosen too (``tuner.autopilot.candidates``): TIE at these fixed β
    # (its CVaR weight), and MemGuard's quantization base at these values besides the base
    # document's (with the defaults and at one γ a decade). Pinned knobs are never varied.
    betas: tuple[float, ...] = Field((0.1, 0.5), max_length=16)
    quant_bases: tuple[int, ...] = Field((64, 1024), max_length=16)
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
    min_requests: int = Field(3_000, ge=10, le=1_000_000)
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
    # Among tied candidates, those with the most margin on the promise's quantiles first
    # (``tuner.autopilot.promise.margin``: the geometric mean of their ratios to the reference's, in
    # steps of ``margin_step``), then the axis rule above — "slo": with tenants' SLOs declared
    # (their targets are tail quantiles). A P95 tie can hide a P99 gap: on ``tenants`` γ 0.464 and γ
    # 0.001 tied on P95 TTFT (0.538 vs 0.534 s) before a surge, P99 1.011 vs 0.945 s; the axis
    # rule took 0.464 and a tenant lost its P99 TTFT target in the surge. Not "always": without
    # SLOs on ``conv1.1`` it took a small γ whose P99 grew later (closure 0.78 -> -0.31).
    margin_ties: Literal["slo", "always", "never"] = "slo"
    margin_step: float = Field(0.01, gt=0.0, le=1.0)
    # A move down the axis takes a candidate this much better on the objective (0: a tie is
    # enough). A tie while the load is light is no evidence, and a small γ taken on it is in place
    # when the load rises — holding back the long requests the promise's P99 is made of.
    down_margin: float = Field(0.05, ge=0.0, le=1.0)
    # The running choice is judged to break the promise only beyond its estimate's sampling noise:
    # this over the square root of the window's requests beyond each quantile …
    noise: float = Field(0.1, ge=0.0, le=10.0)
    # … and only once the window holds this many requests: a P99 of fewer rests on a handful, and
    # the defaults' γ-Ada fits its slope to its last 2,000 samples — before, its shadow shows its
    # warm-up, not its steady behaviour.
    judge_requests: int = Field(3_000, ge=10, le=1_000_000)
    # A window's P99 TTLT moves by a few percent from one minute to the next; leaving a choice for
    # the guard (often a move up the size-to-age axis, which flushes a held-back backlog) takes a
    # break on this many decisions in a row.
    guard_patience: int = Field(2, ge=1, le=100)
    # How much more slack than a newcomer's the running choice's guard gives it (``GUARD_SLACK``).
    # None (sweep seed 20240): 87 of 100 variants keep every promise against 88 — each leaving
    # flushes a queue (README, "The guard's slack, tried at zero").
    guard_slack: float = Field(GUARD_SLACK, ge=0.0, le=1.0)
    # A running choice the reference beats on every quantile of the window, on ``guard_patience``
    # decisions in a row, is left for the reference without the margin a move up takes: it wins
    # nothing the promise counts, and the margin would keep it while it trails by less than the
    # guard's slack on every quantile (sweep seed 1618: the defaults 2.7-5.2% behind sarathi on
    # every quantile of BWB traffic for a whole run, inside GUARD_SLACK plus the sampling noise).
    leave_dominated: bool = True
    min_dwell_s: float = Field(600.0, ge=0.0, le=86_400.0)  # no switch sooner after the last one
    # What is kept and what is won (tuner.autopilot.promise): every quantile within 2% of sarathi's
    # by default; the tenants' SLOs when declared.
    promise: Promise = Field(default_factory=Promise)
    # A request a shadow has not finished is projected this far ahead (its shadow forked and run on
    # with no further arrival); 0 counts it with its wait so far only.
    project_s: float = Field(600.0, ge=0.0, le=86_400.0)
    # The stress test of a move down the axis (and of a running choice below the defaults): the
    # candidate's and the reference's shadows forked with ``stress_s`` more of arrivals after the
    # clock (persistence: the traffic goes on as it came lately), their
    # window projected under it. A small γ that holds the long requests back while the load rises
    # breaks the promise here minutes before its shadow shows it. 0: no stress test.
    stress_s: float = Field(600.0, ge=0.0, le=86_400.0)
    # … made of the last this-many seconds of arrivals, repeated (the recent rate and mix).
    stress_recent_s: float = Field(120.0, ge=10.0, le=86_400.0)
    # … and judged with this much more slack than the promise's own on every quantile (and off its
    # throughput floor, as the running choice's guard is): the test is a forecast, held to the line
    # the running choice's guard holds it to on what did happen (``GUARD_SLACK``), not a newcomer's.
    # On ``diurnal`` a 2% line kept every move down from the defaults out through the hour's rising
    # peak (γ 1 broke P99 TTFT under the test by 3.5% and kept it in the replay); README, "The
    # autopilot".
    stress_slack: float = Field(GUARD_SLACK, ge=0.0, le=1.0)
    # … and the replica switched now: its mirror (the traffic under what it ran when) spawned
    # with the target's settings, through the same test. The target's own shadow never held the
    # queue the running choice left (``tuner.autopilot.stress.StressTest.switch_breaks``).
    switch_test: bool = True
    # A move up the axis to leave a broken promise goes through the same test, against keeping:
    # taken only if the replica switched now breaks fewer quantiles under it than the replica
    # kept. A window's P99 can break where the run's does not, and the queue a size-first choice
    # left, served in age order, costs the medians: on the sweep's variant 82 a move to sarathi
    # ended P50 TTFT 1.021x sarathi's where keeping the defaults kept every quantile (README,
    # "Leaving a break").
    mend_test: bool = True
    # Overload: the reference would need longer than this to empty its queue with no further
    # arrival (None: never judged overloaded).
    overload_drain_s: float | None = Field(300.0, ge=1.0, le=86_400.0)
    # … or longer than this and growing since the last decision (arrivals above capacity now):
    # then no move goes down the axis, but nothing is flushed either.
    overload_growth_s: float = Field(60.0, ge=1.0, le=86_400.0)
    # Sustained overload is judged again every this-many decisions (held in between).
    overload_recheck: int = Field(5, ge=1, le=1_000)
    # A standing queue: over the arrivals of the last this-many seconds the reference's median
    # first-token wait (a request still waiting: its wait so far) exceeds ``overload_growth_s``
    # — arrivals have kept up with capacity for that long, whether or not the queue grew this
    # minute (None, or ``overload_drain_s`` None: never judged). No move down from the defaults
    # or above, the running choice below them stress-tested as in rising overload — a setting
    # that holds back more builds a backlog served only once the queue empties, however long
    # (sweep seed 20240, variant 82: γ 0.001 taken in such a queue held long prompts back 25
    # minutes, P99 TTFT 1.12× sarathi's; no stress test of 10 minutes sees that far). Over 600 s
    # the queue was seen a minute late there, and that minute of γ 0.001 cost the run 0.03 of
    # P95 TTFT against the defaults; no README workload's sarathi queue stands over 300 s but
    # `overload` and `bursts`, where no fixed setting beats the defaults by 0.05. Barring every
    # move down, as rising overload does, held seed 31337's variant 27 at γ 0.01 (P99 TTFT 1.06×;
    # 0.93× with γ 0.001 taken): a choice already below the defaults may still move down.
    overload_standing_s: float | None = Field(300.0, ge=60.0, le=86_400.0)
    # A change of the traffic's shape (``tuner.autopilot.shape``): the prompt lengths of the last
    # ``shape_recent_s`` of arrivals against those before, by the Kolmogorov–Smirnov statistic;
    # over ``shape_change`` (None: never) the candidates are judged on the requests since the
    # change point once there are ``shape_min_requests`` of them — the old shape's tails are no
    # evidence about the new one.
    shape_change: float | None = Field(0.4, gt=0.0, le=1.0)
    shape_recent_s: float = Field(300.0, ge=30.0, le=86_400.0)
    shape_min_requests: int = Field(1_000, ge=10, le=1_000_000)
    history: int = Field(2_000, ge=10, le=1_000_000)  # completed lengths kept for imputation
    # After a change of shape, a request of the new shape handed to the shadows with a length
    # imputed from an older cohort, shorter than its true one, is given the true one in every
    # shadow that has not finished it (``tuner.autopilot.feed``: a new shape's first requests are
    # imputed from the old shape's lengths).
    revise_lengths: bool = True
    # The search (``tuner.autopilot.candidates.ShadowSearch``): at most this many shadows run (0:
    # all); an explorer behind the best that keeps the promise by ``prune_margin`` on
    # ``prune_patience`` judged decisions in a row is retired (a break alone is not a reason); a
    # forked one is judged but neither chosen nor retired for ``probation_s``; a retired one comes
    # back no sooner than ``retry_s``.
    max_shadows: int = Field(10, ge=0, le=1_000)
    prune_margin: float = Field(0.25, ge=0.0, le=100.0)
    prune_patience: int = Field(3, ge=1, le=1_000)
    probation_s: float = Field(300.0, ge=0.0, le=86_400.0)
    retry_s: float = Field(900.0, ge=0.0, le=86_400.0)

    @model_validator(mode="after")
    def _gammas_in_range(self) -> AutopilotConfig:
        for g in self.gammas:
            if not GAMMA_MIN_SAFE <= g <= GAMMA_MAX_SAFE:
                safe = f"[{GAMMA_MIN_SAFE:g}, {GAMMA_MAX_SAFE:g}]"
                raise ValueError(f"gammas: {g} is outside the safe range {safe}")
        for b in self.betas:
            if not 0.0 <= b <= 1.0:
                raise ValueError(f"betas: {b} is outside [0, 1]")
        for q in self.quant_bases:
            if not 1 <= q <= 1_000_000:
                raise ValueError(f"quant_bases: {q} is outside [1, 1000000]")
        kept_s = self.window_s + self.delay_s
        if "shape_recent_s" in self.model_fields_set and self.shape_recent_s >= kept_s:
            # The watch keeps window_s + delay_s of arrivals: nothing would be left to compare with
            # (left at its default under a short window, the watch just never fires).
            raise ValueError(
                f"shape_recent_s: {self.shape_recent_s:g} s leaves no arrivals before it to "
                f"compare with (the watch keeps window_s + delay_s = {kept_s:g} s); set it "
                "shorter"
            )
        return self

    def candidates(self, base: Settings) -> dict[str, Candidate]:
        """The candidates (``tuner.autopilot.candidates.candidate_space``) this configuration
        spans around the replica's settings ``base``, by name."""
        return candidate_space(
            base,
            gammas=self.gammas,
            betas=self.betas,
            quant_bases=self.quant_bases,
            with_defaults=self.with_defaults,
            with_sarathi=self.with_sarathi,
            slo=self.promise.slo,
        )

    def search(self) -> SearchConfig:
        return SearchConfig(
            self.max_shadows,
            self.prune_margin,
            self.prune_patience,
            self.probation_s,
            self.retry_s,
        )
