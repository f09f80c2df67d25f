"""A study's samplers and their streams (``tuner.studies.optimize``'s docstring, "Samplers" and
"Sampler streams"): TPE for one objective, NSGA-II for several; a worker's stream, reseeded per
trial from the trial's number as soon as another process shares the study; and a draw of a
policy with one settings document already measured replaced by one not yet measured."""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from tuner.studies.search import POLICY_PARAM, SearchSpace
from tuner.studies.study import TuneContext

__all__ = ["StreamSampler", "make_sampler", "stream_sampler", "trial_seed"]


def make_sampler(ctx: TuneContext, seed: int) -> optuna.samplers.BaseSampler:
    """The study's sampler seeded ``seed``: TPE for one objective, NSGA-II for several."""
    if ctx.spec.multi_objective:
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=ctx.spec.population_size)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True)


def trial_seed(seed: int, number: int) -> int:
    """The sampler seed of trial ``number`` in a study seeded ``seed`` (32 bits of a hash: studies
    with neighbouring seeds do not share streams shifted by one trial)."""
    digest = hashlib.sha256(f"tailpilot-sampler:{seed}:{number}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def stream_sampler(
    ctx: TuneContext, seed: int, process_seed: int, expected: int | None
) -> StreamSampler:
    """A worker's sampler (module docstring, "Sampler streams"): ``make_sampler(ctx,
    process_seed)`` while its trials are numbered ``expected``, ``expected + 1``, …; from the first
    trial that is not (or from the start when ``expected`` is None), before each trial
    ``make_sampler(ctx, trial_seed(seed, number))``. Optuna's samplers keep nothing between
    trials that the storage does not hold, so a fresh one per trial samples as a long-lived one."""
    return StreamSampler(
        functools.partial(make_sampler, ctx), seed, process_seed, expected, space=ctx.space
    )


class StreamSampler(optuna.samplers.BaseSampler):
    """Delegates to the worker's own sampler, or to one rebuilt per trial (``stream_sampler``);
    one trial at a time per process (``study.optimize`` with ``n_jobs=1``).

    With ``space``, a candidate policy that has nothing to search (no parameter of its own and no
    engine field: ``--no-engine`` with the production policy, say) gives one settings document
    only; once a trial measured it — trial 0 measures the production policy's — drawing it again
    would replay the same settings (an 8-trial ``--policy uniboost --no-engine`` study spent
    trials 4–7 on the sarathi baseline). Such a draw is replaced by a candidate not yet measured
    (seeded by the trial's number); when none is left, the draw stands."""

    def __init__(
        self,
        factory: Callable[[int], optuna.samplers.BaseSampler],
        seed: int,
        process_seed: int,
        expected: int | None,
        *,
        space: SearchSpace | None = None,
    ) -> None:
        self.factory, self.seed, self.expected = factory, seed, expected
        self.inner = factory(process_seed)
        self.single = _single_settings_policies(space) if space is not None else {}
        self.candidates = space.policies if space is not None else ()

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self.expected is not None and trial.number == self.expected:
            self.expected += 1  # still alone: today's stream, reproducible
        else:
            self.expected = None  # another process took a number: never share a stream
            self.inner = self.factory(trial_seed(self.seed, trial.number))
        self.inner.before_trial(study, trial)

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return self.inner.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        params = self.inner.sample_relative(study, trial, search_space)
        if POLICY_PARAM in params:
            params[POLICY_PARAM] = self._unmeasured_policy(study, trial, params[POLICY_PARAM])
        return params

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        value = self.inner.sample_independent(study, trial, param_name, param_distribution)
        if param_name == POLICY_PARAM:
            return self._unmeasured_policy(study, trial, value)
        return value

    def _unmeasured_policy(self, study: optuna.Study, trial: FrozenTrial, chosen: Any) -> Any:
        """``chosen``, unless it is a policy whose one settings document a trial has measured
        already (class docstring): then a candidate not yet measured, if any is left."""
        if chosen not in self.single:
            return chosen
        measured = {p for p, is_production in self.single.items() if is_production}
        for t in study.get_trials(
            deepcopy=False,
            states=(TrialState.COMPLETE, TrialState.RUNNING, TrialState.PRUNED),
        ):
            if t.number != trial.number and t.params.get(POLICY_PARAM) in self.single:
                measured.add(t.params[POLICY_PARAM])
        if chosen not in measured:
            return chosen
        fresh = [p for p in self.candidates if p not in measured]
        if not fresh:
            return chosen  # every candidate measured: nothing new is left to draw
        return random.Random(trial_seed(self.seed, trial.number)).choice(fresh)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self.inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()


def _single_settings_policies(space: SearchSpace) -> dict[str, bool]:
    """The candidate policies of ``space`` with nothing to search (each gives one settings
    document), and whether that document is the production settings (trial 0's)."""
    if len(space.policies) < 2 or space.engine_dims:
        return {}  # no policy choice to steer, or every policy has engine fields to search
    production = space.production_settings.to_dict()
    single = {}
    for policy in space.policies:
        if space.policy_dims.get(policy):
            continue
        try:
            single[policy] = space.build(policy, {}, {}).to_dict() == production
        except ValueError:  # settings the model refuses: a trial of it fails on its own
            continue
    return single
