"""The autopilot's candidate settings and the search that keeps only some of them running.

**The space** (``candidate_space``): sarathi (vLLM's order, the promise's reference), the defaults
(uniboost with γ-Ada), uniboost at each fixed γ of a log grid, TIE at fixed values of β (its CVaR
weight; ``beta_min = beta_max`` holds it), MemGuard's quantization base at other values than the
base document's (with the defaults and at one γ a decade: the threshold matters under KV
pressure, whatever γ), and slofq with the declared tenants when the promise declares SLOs. The
operator's pins bound it: a pinned parameter is never varied, and a replica with any pin never
changes policy (the live path would drop the pins), so other policies are shadowed for reference
only — not *selectable*.

**The axis** (``axis_rank``): every candidate has a place from size-first to age-first — its aging
rate in 1/s. A fixed γ is its own; TIE's wait decay ``decay^(t/τ)`` ages at ``−ln(decay)/τ``; the
defaults (γ-Ada) sit above the grid; sarathi and slofq (by arrival, by tenant) last. Moving down
promotes short requests; moving up flushes what was held back (``tuner.autopilot.controller``).

**The switch** (``target_change``): what makes a replica run a chosen candidate — within the
policy only ``OWN_KNOBS`` change (the operator's other parameters kept), a policy switch takes the
candidate's parameters; engine limits and pins are kept, and a pin blocks a change (``blocked``).

**The search** (``ShadowSearch``): a shadow costs a simulator's replay of the replica's traffic;
running every candidate all the time is what cost 4.4% of a core under overload last round. At
most ``max_shadows`` run: the reference, the defaults, the running choice and explorers, spread
along the γ grid at first. An explorer behind the best candidate that keeps the promise by
``prune_margin`` on ``prune_patience`` judged decisions in a row is retired (its shadow dropped; a
break alone is no reason — the small γ that breaks P99 in a burst is the winner after it). A free
place goes first to the γ either side of the running choice and of the target (the defaults placed
where γ-Ada's γ is), their variants (another MemGuard base, another β), then to the γ farthest from
every running one. A new shadow is *forked* from the running shadow nearest on the axis: its queue,
batch and the window's past are that neighbour's, and from then on it runs its own setting. It is
on probation (``probation_s``): judged, never chosen, never retired, until what it did itself
weighs in its window. A retired candidate comes back no sooner than ``retry_s`` later.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.settings import Settings, SloFqParams
from scheduler.settings_change import SettingsChange
from tuner.autopilot.promise import Figures, Promise, rank_key
from tuner.autopilot.shadows import Shadow

DEFAULTS_RANK = 1e9  # γ-Ada: above every fixed γ on the axis

# The parameters the autopilot chooses, per policy: a switch within the policy changes these and
# nothing else, so an operator's change to any other parameter (decode_first, preemption, ...) is
# the base it works on, never reverted; and a replica runs a candidate when these match.
OWN_KNOBS: dict[str, tuple[str, ...]] = {
    "uniboost": ("gamma", "gamma_ada", "gamma_min", "gamma_max", "quant_base_tokens"),
    "tie": ("beta", "beta_min", "beta_max"),
}


def blocked(current: Settings, target: Settings) -> str | None:
    """Why ``target`` may not replace ``current`` (a pin), else None."""
    if current.pinned and target.policy != current.policy:
        return (
            f"{', '.join(current.pinned)} pinned: the autopilot does not change the policy of a "
            "replica with pins (it would drop them)"
        )
    for name in current.pinned:
        if getattr(target.params, name, None) != current.param(name):
            return f"{name} is pinned by the operator"
    return None


def target_change(current: Settings, target: Settings) -> SettingsChange | None:
    """The settings change that makes ``current`` run ``target``'s choice: within the same policy
    only the autopilot's own knobs (``OWN_KNOBS``) change, the replica's other parameters kept;
    a policy change takes ``target``'s parameters. Engine limits and pins are kept (a change of
    policy is blocked where there are pins). None where a pin forbids it."""
    if blocked(current, target) is not None:
        return None
    own = OWN_KNOBS.get(target.policy)
    if own is not None and current.policy == target.policy:
        return SettingsChange(params={k: getattr(target.params, k) for k in own})
    return SettingsChange(policy=target.policy, params=target.params.model_dump())


def _choice(settings: Settings) -> tuple[object, ...]:
    """What a candidate's choice is of ``settings``: its policy and, for a policy with
    ``OWN_KNOBS``, those (the operator's other parameters, engine limits and pins aside), else
    its parameters."""
    own = OWN_KNOBS.get(settings.policy)
    if own is None:
        return (settings.policy, settings.params)
    return (settings.policy, *(getattr(settings.params, k) for k in own))


def runs_choice(current: Settings, target: Settings) -> bool:
    """Whether ``current`` already runs ``target``'s choice — what ``target_change`` would leave
    as it is. Compared, not validated: the document is built once, when it is sent."""
    return _choice(current) == _choice(target)


def target_document(current: Settings, target: Settings) -> Settings | None:
    """``target_change`` applied to ``current``; None when it already runs ``target``'s choice
    (``runs_choice``) or a pin forbids it."""
    if runs_choice(current, target):
        return None
    change = target_change(current, target)
    return None if change is None else change.apply(current)


@dataclass(frozen=True, slots=True)
class TargetChange:
    """The autopilot's switch as ``apply_settings`` carries it: ``target``'s choice made of the
    settings the replica runs when the change is sent (``target_document``)."""

    target: Settings

    def apply(self, current: Settings) -> Settings | None:
        return target_document(current, self.target)


def running_candidate(options: Mapping[str, Settings], running: Settings) -> str | None:
    """The candidate whose choice ``running`` runs (``_choice``), None when none."""
    runs = _choice(running)
    return next((name for name, s in options.items() if _choice(s) == runs), None)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One setting the autopilot may run (or, not ``selectable``, only compare against)."""

    name: str
    settings: Settings
    rank: float  # place on the size-to-age axis (``axis_rank``)
    selectable: bool = True
    primary: bool = True  # on the axis itself (not a variant of another's other knobs)
    variant_of: str | None = None  # the primary candidate it varies


def axis_rank(settings: Settings) -> float:
    """A setting's place on the size-to-age axis: its aging rate in 1/s (module docstring)."""
    p = settings.params
    if settings.policy == "uniboost":
        return DEFAULTS_RANK if p.gamma_ada else float(p.gamma)
    if settings.policy == "tie":
        return float(-math.log(p.decay) / p.tau_s)
    return math.inf


def candidate_space(
    base: Settings,
    *,
    gammas: Sequence[float],
    betas: Sequence[float] = (),
    quant_bases: Sequence[int] = (),
    with_defaults: bool = True,
    with_sarathi: bool = True,
    slo: SloFqParams | None = None,
) -> dict[str, Candidate]:
    """Every candidate by name (module docstring). Names: ``sarathi``, ``defaults``, ``slofq``,
    ``gamma=<g>``, ``tie:beta=<b>``, and a MemGuard variant ``<primary>,quant=<n>``. Engine limits
    and the base document's other uniboost (or TIE) parameters are kept."""
    engine = base.engine.model_dump()
    pinned = set(base.pinned)
    may_switch = not pinned  # a pin forbids a change of policy (it would drop the pin)
    boost = base.params.model_dump() if base.policy == "uniboost" else {}
    tie = base.params.model_dump() if base.policy == "tie" else {}
    out: dict[str, Candidate] = {}

    def add(name: str, doc: dict[str, object], variant_of: str | None = None) -> None:
        settings = Settings.model_validate({**doc, "engine": engine})
        selectable = may_switch or settings.policy == base.policy
        primary = variant_of is None
        rank = axis_rank(settings)
        out[name] = Candidate(name, settings, rank, selectable, primary, variant_of)

    if with_sarathi:
        add("sarathi", {"policy": "sarathi"})
    boost_fixed = base.policy == "uniboost" and "gamma" in pinned
    if with_defaults and not boost_fixed:
        add("defaults", {"policy": "uniboost", "params": {**boost, "gamma_ada": True}})
    if slo is not None:  # token-level fair queueing with the declared tenants (seed 003)
        add("slofq", {"policy": "slofq", "params": slo.model_dump()})
    grid = [float(base.params.gamma)] if boost_fixed else list(gammas)
    for g in grid:
        p = {**boost, "gamma": g, "gamma_ada": False}
        p["gamma_min"] = min(float(p.get("gamma_min", g)), g)
        p["gamma_max"] = max(float(p.get("gamma_max", g)), g)
        add(f"gamma={g:g}", {"policy": "uniboost", "params": p})
    tie_fixed = base.policy == "tie" and "beta" in pinned
    for b in [float(base.params.beta)] if tie_fixed else betas:
        add(
            f"tie:beta={b:g}",
            {"policy": "tie", "params": {**tie, "beta": b, "beta_min": b, "beta_max": b}},
        )
    if "quant_base_tokens" in pinned or (boost and not boost.get("memguard", True)):
        return out  # pinned, or MemGuard off: its thresholds change nothing
    own_base = int(boost.get("quant_base_tokens", 256))
    varied = [n for n in ("defaults", *(f"gamma={g:g}" for g in grid[::3])) if n in out]
    for name in varied:
        primary = out[name]
        for q in quant_bases:
            if q == own_base:
                continue
            params = {**primary.settings.params.model_dump(), "quant_base_tokens": q}
            add(
                f"{name},quant={q}",
                {"policy": "uniboost", "params": params},
                variant_of=name,
            )
    return out


@dataclass(frozen=True, slots=True)
class SearchConfig:
    max_shadows: int  # 0: every candidate runs (no search)
    prune_margin: float
    prune_patience: int
    probation_s: float
    retry_s: float


class ShadowSearch:
    """Which candidates run a shadow now (module docstring). Pure bookkeeping: the autopilot asks
    it whom to retire and whom to start, and starts and drops the shadows itself."""

    def __init__(
        self,
        space: Mapping[str, Candidate],
        always: Iterable[str],
        config: SearchConfig,
    ) -> None:
        self.space = space
        self.config = config
        self.always = [n for n in dict.fromkeys(always) if n in space]
        # The axis in order (ties by name): the primary candidates a neighbour is taken from.
        self.axis = sorted((c for c in space.values() if c.primary), key=lambda c: (c.rank, c.name))
        self.behind: dict[str, int] = {}  # explorer -> judged decisions in a row it lagged
        self.born: dict[str, float] = {}  # forked candidate -> the shadows' clock at its fork
        self.retired: dict[str, float] = {}  # candidate -> the shadows' clock it was retired at
        self.started = 0
        self.dropped = 0

    @property
    def limit(self) -> int:
        n = self.config.max_shadows
        return len(self.space) if n <= 0 else max(n, len(self.always))

    def initial(self, current: str) -> list[str]:
        """The first running set: the fixed ones, the running choice, and explorers spread
        evenly along the γ grid (the axis's own points; TIE and the variants come in later as
        the target's neighbours)."""
        chosen = list(dict.fromkeys([*self.always, current]))
        free = [
            c.name
            for c in self.axis
            if c.name not in chosen
            and c.selectable
            and c.settings.policy == "uniboost"
            and c.rank < DEFAULTS_RANK
        ]
        slots = self.limit - len(chosen)
        if slots >= len(free):
            rest = [
                c.name
                for c in (*self.axis, *self.space.values())
                if c.name not in chosen and c.name not in free and c.selectable
            ]
            rest = list(dict.fromkeys(rest))
            return chosen + free + rest[: slots - len(free)]
        if slots > 0:
            step = (len(free) - 1) / max(slots - 1, 1)
            picks = sorted({round(k * step) for k in range(slots)})
            chosen += [free[i] for i in picks]
        return chosen

    def on_probation(self, name: str, clock: float) -> bool:
        born = self.born.get(name)
        return born is not None and clock - born < self.config.probation_s

    def eligible(self, name: str, current: str, clock: float) -> bool:
        """Whether a candidate may be chosen now (``current``, the running choice, always): a pin
        may forbid it, and a forked one is on probation until what it did itself weighs in its
        window."""
        return name == current or (
            self.space[name].selectable and not self.on_probation(name, clock)
        )

    def place(self, name: str, shadows: Mapping[str, Shadow]) -> float:
        """Where a candidate sits on the axis now: its rank, but the defaults where γ-Ada's γ is
        in its shadow (their neighbours are the fixed γ around it)."""
        shadow = shadows.get(name)
        if name == "defaults" and shadow is not None:
            live = shadow.sim.policy.live_state().get("gamma")
            if isinstance(live, float) and math.isfinite(live):
                return live
        return self.space[name].rank

    def lagging(self, figures: Mapping[str, Figures], promise: Promise) -> dict[str, bool]:
        """Per candidate judged: whether it trails the best candidate that keeps ``promise`` by
        ``prune_margin`` on the objective (with SLOs, on SCR or JFI first) — ``retire``'s
        verdict. A break alone is no reason: a small γ breaks P99 in a burst and is the winner
        again after it — it is the shadow a switch needs then, warm."""
        feasible = [rank_key(promise, f) for f in figures.values() if f.feasible]
        best = min(feasible, default=None)
        out = {}
        for name, f in figures.items():
            if best is None:
                out[name] = False  # nobody keeps it on this window: no evidence against anyone
            elif promise.slo is not None and rank_key(promise, f)[:-1] != best[:-1]:
                out[name] = rank_key(promise, f)[:-1] > best[:-1]
            else:
                out[name] = f.value(promise.objective) > (1 + self.config.prune_margin) * best[-1]
        return out

    def retire(self, lagging: Mapping[str, bool], keep: Iterable[str], clock: float) -> list[str]:
        """The explorers to retire after a judged decision: those ``lagging`` (the autopilot's
        verdict: behind the best that keeps the promise by ``prune_margin``) on
        ``prune_patience`` decisions in a row, ``keep`` and those on probation aside."""
        if self.limit >= len(self.space):
            return []
        kept = {*self.always, *keep}
        out = []
        for name, lags in lagging.items():
            if name in kept or self.on_probation(name, clock):
                continue
            self.behind[name] = self.behind.get(name, 0) + 1 if lags else 0
            if self.behind[name] >= self.config.prune_patience:
                out.append(name)
        for name in out:
            self.behind.pop(name, None)
            self.born.pop(name, None)
            self.retired[name] = clock
            self.dropped += 1
        return out

    def next_up(
        self, anchors: Mapping[str, float], running: Iterable[str], clock: float
    ) -> list[str]:
        """The candidates to start in the free places. Around each anchor (the running choice and
        the target, each at its place on the axis — the defaults where γ-Ada's γ is now): the
        nearest γ below and above, its own primary (for a variant) and its variants; then, to
        keep the whole axis in view, the γ farthest from every running one (a candidate far from
        both may be the next phase's winner). One retired less than ``retry_s`` ago waits."""
        running = set(running)
        slots = self.limit - len(running)
        if slots <= 0:
            return []
        grid = [c for c in self.axis if c.settings.policy == "uniboost" and c.rank < DEFAULTS_RANK]

        def ready(name: str, taken: set[str]) -> bool:
            c = self.space[name]
            recent = clock - self.retired.get(name, -math.inf) < self.config.retry_s
            return name not in taken and c.selectable and not recent

        wanted: list[str] = []
        for name, rank in anchors.items():
            primary = self.space[name].variant_of or name
            below = [c.name for c in grid if c.rank < rank]
            above = [c.name for c in grid if c.rank > rank]
            wanted += below[-1:] + above[:1] + [primary]
            wanted += [c.name for c in self.space.values() if c.variant_of == primary]
        out: list[str] = []
        taken = set(running)
        for name in wanted:
            if len(out) < slots and ready(name, taken):
                out.append(name)
                taken.add(name)
        while len(out) < slots:
            shown = [_log_rank(self.space[n].rank) for n in taken if n in self.space]
            free = [c for c in grid if ready(c.name, taken)]
            if not free:
                break
            # the grid point farthest from every running candidate (ties: the smaller γ)
            far = max(
                free,
                key=lambda c: (
                    min((abs(_log_rank(c.rank) - x) for x in shown), default=0.0),
                    -c.rank,
                ),
            )
            out.append(far.name)
            taken.add(far.name)
        return out

    def bracket(self, anchors: Mapping[str, float], running: Iterable[str]) -> set[str]:
        """The anchors and, for each, the nearest running candidate below and above its place on
        the axis: a move either way from the running choice, or from the target, always has a
        warm shadow to go to (the next phase's winner is most often a neighbour)."""
        running = [n for n in running if self.space[n].rank < DEFAULTS_RANK]
        out = set(anchors)
        for rank in anchors.values():
            below = sorted((n for n in running if self.space[n].rank < rank), key=self._rank_of)
            above = sorted((n for n in running if self.space[n].rank > rank), key=self._rank_of)
            out.update(below[-1:] + above[:1])
        return out

    def _rank_of(self, name: str) -> tuple[float, str]:
        return self.space[name].rank, name

    def nearest(self, name: str, running: Iterable[str]) -> str:
        """The running candidate a new shadow for ``name`` is forked from: its own primary
        when running, else the same policy's nearest on the axis, else any nearest."""
        c = self.space[name]
        running = list(running)
        if c.variant_of in running:
            return c.variant_of

        def distance(other: str) -> tuple[bool, float, str]:
            o = self.space[other]
            gap = abs(_log_rank(o.rank) - _log_rank(c.rank))
            return (o.settings.policy != c.settings.policy, gap, other)

        return min(running, key=distance)

    def started_fork(self, name: str, clock: float) -> None:
        self.born[name] = clock
        self.behind.pop(name, None)
        self.started += 1


def _log_rank(rank: float) -> float:
    return math.log10(min(rank, 1e12)) if rank > 0 else -12.0
