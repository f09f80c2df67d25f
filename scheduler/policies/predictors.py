"""Output-length predictors for the sjf / srpt / tie policies (docs/policies.md).

A predictor maps a request to a log-t output-length distribution ``X = exp(mu + sigma*T)``,
``T ~ Student-t(nu)``: ``predict_dist`` gives ``(mu, sigma)``, ``predict_total`` the point
estimate used by sjf/srpt, i.e. the median ``exp(mu)`` (capped at ``max_tokens``, which makes it
the median of the truncated length ``min(X, max_tokens)`` that the engine can actually produce).

Requests are duck-typed (``PredictedRequest``): ``id``, and, read with defaults when missing,
``tenant``, ``type``, ``prompt_tokens``, ``max_tokens`` and ``output_tokens`` (true length,
simulator only).

``version`` is bumped whenever the predictions a predictor gives may have changed (a refit);
policies cache per-request predictions keyed on it.

Nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from abc import abstractmethod
from collections.abc import Hashable
from statistics import NormalDist
from typing import Any, ClassVar, Protocol

import numpy as np
from mypy_extensions import mypyc_attr
from numpy.typing import ArrayLike
from scipy import special

from scheduler.names import DEFAULT_TENANT, DEFAULT_TYPE
from scheduler.policies.recent import RecentValues

__all__ = [
    "PREDICTORS",
    "SIGMA_FLOOR",
    "HistoryPredictor",
    "LengthPredictor",
    "OraclePredictor",
    "PredictedRequest",
    "fit_logt_mle",
    "fit_logt_mle_many",
    "make_predictor",
    "prompt_bucket",
]

#: Smallest log-scale sigma a predictor reports (a point mass would make TIE degenerate).
SIGMA_FLOOR = 0.05

_STD_NORMAL = NormalDist()
_TWO_53 = 1 << 53
_HALF_2_53 = 1 << 52
_INV_2_53 = 1.0 / _TWO_53


class PredictedRequest(Protocol):
    """What a predictor needs of a request: its id. The rest (``tenant``, ``type``,
    ``prompt_tokens``, ``max_tokens``, ``output_tokens``) is read when present, with defaults:
    the engines pass ``RequestState``, tests and benchmarks lighter objects."""

    @property
    def id(self) -> str: ...


def _tenant(req: PredictedRequest) -> str:
    t = getattr(req, "tenant", None)
    return DEFAULT_TENANT if t is None else str(t)


def _rtype(req: PredictedRequest) -> str:
    t = getattr(req, "type", None)
    return DEFAULT_TYPE if t is None else str(t)


def _cap(value: float, req: PredictedRequest) -> float:
    """Cap a length prediction at the request's ``max_tokens`` (when it has a positive one)."""
    mt = getattr(req, "max_tokens", None)
    if mt is not None and mt > 0 and value > mt:
        return float(mt)
    return value


def prompt_bucket(prompt_tokens: int) -> int:
    """``floor(log2(prompt_tokens))`` computed exactly on integers; ``prompt_tokens <= 1`` -> 0."""
    p = int(prompt_tokens)
    return p.bit_length() - 1 if p >= 1 else 0


# Not an ABC, and marked for the compiled core: see scheduler.policies.base.Policy.
@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class LengthPredictor:
    """Abstract output-length predictor."""

    name: str = "base"
    # The constructor's keyword parameters, named for make_predictor's check (a compiled class's
    # signature reads as ``*args, **kwargs``; a test keeps the two equal).
    PARAMETERS: ClassVar[tuple[str, ...]] = ()
    nu: float = 3.5
    version: int = 0

    @abstractmethod
    def predict_total(self, req: PredictedRequest) -> float | None:
        """Point estimate (median) of the request's total output tokens; None if unknown."""

    @abstractmethod
    def predict_dist(self, req: PredictedRequest) -> tuple[float, float] | None:
        """``(mu, sigma)`` of the log-t output-length distribution; None if unknown."""

    def observe(self, req: PredictedRequest, output_tokens: int) -> None:
        """Record a finished request and its true output length (cheap; never refits)."""

    def refit(self) -> int:
        """Re-estimate from the observations (may be expensive: run it on a timer, never inside a
        scheduling step). Returns the number of fitted keys."""
        return 0


# ----------------------------------------------------------------------------- oracle


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class OraclePredictor(LengthPredictor):
    """A calibrated distributional oracle (simulator only): reads the true length ``L`` and gives
    each request its own log-t distribution of which ``L`` is exactly a draw.

    For request ``i`` (``L_i`` = its true length, capped at ``max_tokens``, at least 1)::

        sigma_i = sigma_noise * exp(sigma_spread * z_i - sigma_spread**2 / 2)    (mean sigma_noise)
        mu_i    = ln(L_i) - sigma_i * t_i

    with ``z_i ~ N(0, 1)`` and ``t_i ~ Student-t(nu)`` independent.  So ``ln L_i = mu_i + sigma_i
    t_i``: the true length is a draw from the predicted ``X = exp(mu_i + sigma_i T)`` (the PIT
    ``F_nu((ln L_i - mu_i)/sigma_i) = F_nu(t_i)`` is uniform), and requests differ in how uncertain
    their prediction is, which is what TIE's CVaR term ranks on.  ``predict_dist`` gives
    ``(mu_i, max(sigma_i, SIGMA_FLOOR))``, ``predict_total`` the median ``exp(mu_i)`` capped at
    ``max_tokens``.  ``sigma_spread = 0`` gives every request ``sigma_noise``; ``sigma_noise = 0``
    is the perfect oracle (``mu_i = ln L_i``, point = true length; ``SIGMA_FLOOR`` reported).
    (A ``sigma_i`` below the floor is reported as the floor but ``mu_i`` uses the raw draw: such a
    prediction is slightly wider than its error, never narrower.)

    ``z_i`` and ``t_i`` are deterministic functions of ``(seed, request id)``, never of call order:
    a 128-bit BLAKE2b hash of the pair gives two 53-bit uniforms, mapped through the inverse
    normal and inverse Student-t CDFs.  So the same request always gets the same prediction, in
    any process and whatever was asked before.  (A hash rather than CRC32 seeding a numpy
    Generator: no collisions in practice among millions of ids, and ~2 us per call instead of
    ~30 us.)  Nothing is cached per request: a call is cheap, and the policies already cache
    predictions on the request.
    """

    name = "oracle"
    PARAMETERS = ("sigma_noise", "seed", "nu", "sigma_spread")

    def __init__(
        self, sigma_noise: float = 0.0, seed: int = 0, nu: float = 3.5, sigma_spread: float = 0.0
    ) -> None:
        if not (sigma_noise >= 0) or not math.isfinite(sigma_noise):
            raise ValueError(f"sigma_noise must be a finite number >= 0, got {sigma_noise!r}")
        if not (sigma_spread >= 0) or not math.isfinite(sigma_spread):
            raise ValueError(f"sigma_spread must be a finite number >= 0, got {sigma_spread!r}")
        if not (nu > 0):
            raise ValueError(f"nu must be > 0, got {nu!r}")
        self.sigma_noise = float(sigma_noise)
        self.sigma_spread = float(sigma_spread)
        self.seed = int(seed)
        self.nu = float(nu)
        self.version = 0
        self._half_spread2 = self.sigma_spread**2 / 2.0

    def _uniforms(self, req_id: str) -> tuple[int, int]:
        """Two independent 53-bit integers ``k``; the uniforms are ``(k + 0.5) / 2**53``."""
        h = hashlib.blake2b(f"{self.seed}\x1f{req_id}".encode(), digest_size=16).digest()
        return int.from_bytes(h[:8], "big") >> 11, int.from_bytes(h[8:], "big") >> 11

    def noise_z(self, req_id: str) -> float:
        """The request's standard-normal draw ``z_i`` (deterministic in ``(seed, req_id)``)."""
        k = self._uniforms(str(req_id))[0]
        return _STD_NORMAL.inv_cdf((k + 0.5) * _INV_2_53)

    def noise_t(self, req_id: str) -> float:
        """The request's Student-t(nu) draw ``t_i`` (deterministic in ``(seed, req_id)``)."""
        return self._t_of(self._uniforms(str(req_id))[1])

    def _t_of(self, k: int) -> float:
        # Inverse CDF from the nearer tail, so both tails keep full precision (1 - u is exact).
        if k < _HALF_2_53:
            return float(special.stdtrit(self.nu, (k + 0.5) * _INV_2_53))
        return -float(special.stdtrit(self.nu, (_TWO_53 - k - 0.5) * _INV_2_53))

    def sigma_for(self, req_id: str) -> float:
        """The request's ``sigma_i`` before the ``SIGMA_FLOOR`` (0 for the perfect oracle)."""
        if self.sigma_noise == 0.0:
            return 0.0
        if self.sigma_spread == 0.0:
            return self.sigma_noise
        return self.sigma_noise * math.exp(
            self.sigma_spread * self.noise_z(req_id) - self._half_spread2
        )

    def _true(self, req: PredictedRequest) -> float:
        true = getattr(req, "output_tokens", None)
        if true is None:
            raise ValueError(
                "oracle predictor needs true lengths; only the simulator has them "
                f"(request {getattr(req, 'id', '?')!r} has output_tokens=None)"
            )
        return _cap(float(true), req)

    def _mu_sigma(self, req: PredictedRequest) -> tuple[float, float]:
        """``(mu_i, sigma_i)``, sigma not floored; requires ``sigma_noise > 0``."""
        true = self._true(req)
        kz, kt = self._uniforms(str(req.id))
        sigma = self.sigma_noise
        if self.sigma_spread > 0.0:
            sigma *= math.exp(
                self.sigma_spread * _STD_NORMAL.inv_cdf((kz + 0.5) * _INV_2_53) - self._half_spread2
            )
        return math.log(max(true, 1.0)) - sigma * self._t_of(kt), sigma

    def predict_total(self, req: PredictedRequest) -> float:
        if self.sigma_noise == 0.0:
            return self._true(req)
        return _cap(math.exp(self._mu_sigma(req)[0]), req)

    def predict_dist(self, req: PredictedRequest) -> tuple[float, float]:
        if self.sigma_noise == 0.0:
            return math.log(max(self._true(req), 1.0)), SIGMA_FLOOR
        mu, sigma = self._mu_sigma(req)
        return mu, max(sigma, SIGMA_FLOOR)


# ----------------------------------------------------------------------------- log-t MLE


def fit_logt_mle_many(
    samples: list[np.ndarray],
    nu: float = 3.5,
    tol: float = 1e-9,
    max_iter: int = 1000,
    start: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Maximum-likelihood ``(mu, sigma)`` of a location-scale Student-t (``nu`` fixed), for many
    independent samples at once.

    Algorithm: the EM / iteratively-reweighted fixed point for the t distribution in its
    accelerated form (Kent, Tyler & Vardi 1994; the PX-EM of Liu, Rubin & Wu 1998)::

        w_i   = (nu + 1) / (nu + (x_i - mu)^2 / sigma^2)
        mu    <- sum(w x) / sum(w)
        sigma^2 <- sum(w (x - mu)^2) / sum(w)

    Every iteration increases the likelihood and its fixed points are exactly the ML score
    equations (at a fixed point ``sum(w) = n``, so dividing by ``sum(w)`` instead of ``n`` changes
    the speed, not the answer).  Started from the median and the MAD it converges in a few dozen
    iterations; ``start`` (per-sample ``mu`` and ``sigma``, e.g. the previous fit of a sample
    that only grew a little) starts closer and converges in a few.  All groups are iterated
    together with ``np.bincount`` on the concatenated data, so 100 keys x 2000 samples take a few
    tens of ms, where ``scipy.stats.t.fit(x, fix_df=nu)`` (a generic Nelder-Mead on the same
    likelihood) takes tens of ms *per key*; the tests check that both reach the same optimum.
    ``sigma`` is floored at 1e-6 during the iteration (all-equal samples); callers apply their own
    reporting floor.
    """
    nu = float(nu)
    g = len(samples)
    if g == 0:
        return np.empty(0), np.empty(0)
    arrs = [np.asarray(s, dtype=float).ravel() for s in samples]
    sizes = np.array([a.size for a in arrs])
    if np.any(sizes == 0):
        raise ValueError("every sample must be non-empty")
    if g == 1:  # a refit's most common case (one key grew): the same arithmetic on scalars
        first = None if start is None else (float(start[0][0]), float(start[1][0]))
        try:
            mu1, sigma1 = _fit_one(arrs[0], nu, tol, max_iter, first)
            return np.array([mu1]), np.array([sigma1])
        except (OverflowError, ZeroDivisionError):
            pass  # values past a double's range: numpy's answer (inf, nan), not an exception
    return _fit_groups(arrs, sizes, nu, tol, max_iter, start)


def _fit_groups(
    arrs: list[np.ndarray],
    sizes: np.ndarray,
    nu: float,
    tol: float,
    max_iter: int,
    start: tuple[np.ndarray, np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """``fit_logt_mle_many``'s iteration over every group at once (``np.add.reduceat`` over the
    concatenated samples)."""
    x = np.concatenate(arrs)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    if start is None:
        mu = np.array([np.median(a) for a in arrs])
        mad = np.array([np.median(np.abs(a - m)) for a, m in zip(arrs, mu)])
        sig2 = np.maximum(1.4826 * mad, 1e-3) ** 2
    else:
        mu = np.array(start[0], dtype=float)
        sig2 = np.maximum(np.asarray(start[1], dtype=float), 1e-3) ** 2
    # Preallocated work buffers: fresh multi-MB temporaries per operation cost ~10x more than the
    # arithmetic itself (page faults), so every element-wise step writes into these.
    r = np.empty_like(x)
    w = np.empty_like(x)
    tmp = np.empty_like(x)
    for _ in range(max_iter):
        np.subtract(x, np.repeat(mu, sizes), out=r)
        np.multiply(r, r, out=tmp)
        np.multiply(tmp, np.repeat(1.0 / sig2, sizes), out=tmp)
        tmp += nu
        np.divide(nu + 1.0, tmp, out=w)  # w_i = (nu+1) / (nu + r_i^2 / sigma^2)
        sw = np.add.reduceat(w, starts)
        np.multiply(w, x, out=tmp)
        mu_new = np.add.reduceat(tmp, starts) / sw
        np.subtract(x, np.repeat(mu_new, sizes), out=r)
        np.multiply(r, r, out=tmp)
        tmp *= w
        sig2_new = np.maximum(np.add.reduceat(tmp, starts) / sw, 1e-12)
        sig_old = np.sqrt(sig2)
        done = (np.abs(mu_new - mu) <= tol * sig_old) & (
            np.abs(np.sqrt(sig2_new) - sig_old) <= tol * sig_old
        )
        mu, sig2 = mu_new, sig2_new
        if np.all(done):
            break
    return mu, np.sqrt(sig2)


def _fit_one(
    x: np.ndarray, nu: float, tol: float, max_iter: int, start: tuple[float, float] | None
) -> tuple[float, float]:
    """``fit_logt_mle_many`` for one sample, bit for bit: the group's ``mu`` and ``sigma`` are
    scalars instead of arrays repeated over the sample (3 ``np.repeat`` and 6 small-array
    operations an iteration; a refit's single-key fit takes half the time, ~30 iterations of
    ~20 numpy calls each). Every element-wise operation and every sum is the array path's own
    (a scalar broadcast gives each element what the repeated array gave it; the sums stay
    ``np.add.reduceat`` over one segment; a square is a product, as numpy's; ``math.sqrt`` is
    correctly rounded, as numpy's), ``tests/test_predictors.py`` compares the two to the last
    bit. Python's float arithmetic raises where numpy's overflows to inf or nan: the caller
    falls back to the group iteration then."""
    if start is None:
        mu = float(np.median(x))
        mad = float(np.median(np.abs(x - mu)))
        sig = max(1.4826 * mad, 1e-3)
    else:
        mu, sig = start[0], max(start[1], 1e-3)
    # A product, as numpy squares an array: Python's ``** 2`` is the C library's ``pow``, which
    # differs from it in the last bit for ~0.1% of doubles (found by review; tested).
    sig2 = sig * sig
    r = np.empty_like(x)
    w = np.empty_like(x)
    tmp = np.empty_like(x)
    whole = np.zeros(1, dtype=np.intp)  # one segment: reduceat sums as the array path does
    for _ in range(max_iter):
        np.subtract(x, mu, out=r)
        np.multiply(r, r, out=tmp)
        np.multiply(tmp, 1.0 / sig2, out=tmp)
        tmp += nu
        np.divide(nu + 1.0, tmp, out=w)  # w_i = (nu+1) / (nu + r_i^2 / sigma^2)
        sw = float(np.add.reduceat(w, whole)[0])
        np.multiply(w, x, out=tmp)
        mu_new = float(np.add.reduceat(tmp, whole)[0]) / sw
        np.subtract(x, mu_new, out=r)
        np.multiply(r, r, out=tmp)
        tmp *= w
        sig2_new = max(float(np.add.reduceat(tmp, whole)[0]) / sw, 1e-12)
        sig_old = math.sqrt(sig2)
        done = abs(mu_new - mu) <= tol * sig_old and abs(math.sqrt(sig2_new) - sig_old) <= (
            tol * sig_old
        )
        mu, sig2 = mu_new, sig2_new
        if done:
            break
    return mu, math.sqrt(sig2)


def fit_logt_mle(x: ArrayLike, nu: float = 3.5) -> tuple[float, float]:
    """ML ``(mu, sigma)`` of one sample (see :func:`fit_logt_mle_many`)."""
    mu, sigma = fit_logt_mle_many([np.asarray(x, dtype=float)], nu)
    return float(mu[0]), float(sigma[0])


# ----------------------------------------------------------------------------- history


Key = tuple[Hashable, ...]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class HistoryPredictor(LengthPredictor):
    """Fits a log-t (``nu`` fixed) to the observed output lengths per key
    (docs/policies.md#predictors).

    Keys, finest to coarsest: ``(tenant, type, prompt_bucket)``, ``(tenant, type)``,
    ``(tenant,)``, ``()`` (global); ``prompt_bucket = floor(log2(prompt_tokens))``.  Each key
    keeps its own last ``window`` observations (``RecentValues``).  ``refit()`` fits every key with
    at least ``min_samples`` observations; a prediction uses the finest fitted key of the request,
    falling back to coarser ones.  Nothing is predicted before the first ``refit()``.
    ``observe()`` only appends (O(1)); it never refits.  Thread-safe: ``observe``/``predict`` may
    run in the scheduler thread while ``refit`` runs on a timer thread (fits are swapped in
    atomically).

    Observed lengths below 1 token are counted as 1 (the model is on ``ln(tokens)``).  Lengths cut
    at ``max_tokens`` are treated as exact (no censoring correction), as the policy library
    documents (docs/policies.md#predictors).
    """

    name = "history"
    PARAMETERS = ("nu", "window", "min_samples", "refit_fraction")

    def __init__(
        self,
        nu: float = 3.5,
        window: int = 5000,
        min_samples: int = 20,
        refit_fraction: float = 0.02,
    ) -> None:
        if not (nu > 0) or not math.isfinite(nu):
            raise ValueError(f"nu must be a finite number > 0, got {nu!r}")
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        if int(min_samples) < 2:
            raise ValueError(f"min_samples must be >= 2, got {min_samples!r}")
        if not (0.0 <= refit_fraction <= 1.0):
            raise ValueError(f"refit_fraction must be in [0, 1], got {refit_fraction!r}")
        self.nu = float(nu)
        self.window = int(window)
        self.min_samples = int(min_samples)
        self.refit_fraction = float(refit_fraction)
        self.version = 0
        self.last_refit_s: float | None = None  # wall time the last refit took
        self._pools: dict[Key, RecentValues] = {}
        self._fits: dict[Key, tuple[float, float, int]] = {}
        self._new: dict[Key, int] = {}  # observations per key since its last fit
        self._lock = threading.Lock()

    @staticmethod
    def keys_for(req: PredictedRequest) -> tuple[Key, Key, Key, Key]:
        """The request's keys, finest first."""
        tenant, rtype = _tenant(req), _rtype(req)
        bucket = prompt_bucket(getattr(req, "prompt_tokens", 0) or 0)
        return (tenant, rtype, bucket), (tenant, rtype), (tenant,), ()

    def observe(self, req: PredictedRequest, output_tokens: int) -> None:
        v = math.log(max(float(output_tokens), 1.0))
        with self._lock:
            for key in self.keys_for(req):
                pool = self._pools.get(key)
                if pool is None:
                    pool = self._pools[key] = RecentValues(self.window)
                pool.append(v)
                self._new[key] = self._new.get(key, 0) + 1

    # A copy (the autopilot forks a shadow's engine, predictor included) takes the pools and fits
    # and a lock of its own. Its state is named (a compiled predictor has no ``__dict__``; a test
    # holds the list to every attribute ``__init__`` sets).
    STATE: ClassVar[tuple[str, ...]] = (
        "nu",
        "window",
        "min_samples",
        "refit_fraction",
        "version",
        "last_refit_s",
        "_pools",
        "_fits",
        "_new",
    )

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            return {name: getattr(self, name) for name in self.STATE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._lock = threading.Lock()

    def n_observations(self, key: Key) -> int:
        with self._lock:
            pool = self._pools.get(key)
            return 0 if pool is None else len(pool)

    def refit(self) -> int:
        """Fit every key with at least ``min_samples`` observations that has none yet, or whose
        observations since its last fit reach ``refit_fraction`` of its pool (a fit moves by about
        that much: refitting a 5,000-sample key for 10 new lengths would cost a full fit for
        nothing); returns the number of fitted keys. Nothing to fit: nothing changes, ``version``
        included (a new version makes the policies re-derive every prediction)."""
        t0 = time.perf_counter()
        fitted, frac = self._fits, self.refit_fraction
        with self._lock:  # snapshot only; the fit itself runs without the lock
            snap = {
                k: p.ordered()
                for k, n in self._new.items()
                if len(p := self._pools[k]) >= self.min_samples
                and (k not in fitted or n >= frac * len(p))
            }
            for k in snap:
                del self._new[k]
        if not snap:
            return len(self._fits)
        old = self._fits
        fits = dict(old)
        # A key fitted before starts from its last fit (a few iterations, not a few dozen).
        warm = [k for k in snap if k in old]
        cold = [k for k in snap if k not in old]
        for keys, start in (
            (warm, (np.array([old[k][0] for k in warm]), np.array([old[k][1] for k in warm]))),
            (cold, None),
        ):
            if keys:
                mu, sigma = fit_logt_mle_many([snap[k] for k in keys], self.nu, start=start)
                fits.update(
                    {
                        k: (float(m), max(float(s), SIGMA_FLOOR), len(snap[k]))
                        for k, m, s in zip(keys, mu, sigma)
                    }
                )
        self._fits = fits  # atomic swap
        self.version += 1
        self.last_refit_s = time.perf_counter() - t0
        return len(fits)

    @property
    def fits(self) -> dict[Key, tuple[float, float, int]]:
        """Copy of the current fits: key -> (mu, sigma, n_samples)."""
        return dict(self._fits)

    def fit_for(self, req: PredictedRequest) -> tuple[Key, float, float] | None:
        """``(key used, mu, sigma)`` for the request, or None when no key is fitted yet."""
        fits = self._fits
        for key in self.keys_for(req):
            f = fits.get(key)
            if f is not None:
                return key, f[0], f[1]
        return None

    def predict_dist(self, req: PredictedRequest) -> tuple[float, float] | None:
        f = self.fit_for(req)
        return None if f is None else (f[1], f[2])

    def predict_total(self, req: PredictedRequest) -> float | None:
        f = self.fit_for(req)
        return None if f is None else _cap(math.exp(f[1]), req)


# ----------------------------------------------------------------------------- factory

PREDICTORS: dict[str, type[LengthPredictor]] = {
    "history": HistoryPredictor,
    "oracle": OraclePredictor,
}


def make_predictor(name: str, **params: float) -> LengthPredictor:
    """Build a predictor by name (``"history"`` or ``"oracle"``) with its keyword parameters."""
    cls = PREDICTORS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown predictor {name!r}; valid names: {', '.join(sorted(PREDICTORS))}"
        )
    allowed = list(cls.PARAMETERS)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"predictor {name!r} got unknown parameter(s) {unknown}; valid: {allowed}")
    return cls(**params)
