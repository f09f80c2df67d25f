"""TIE (tail-inflated expectation) math, docs/policies.md#tie

A request's output length is modelled as ``X = exp(mu + sigma*T)``, ``T ~ Student-t(nu)``,
truncated at ``x_max = max_tokens``: ``X~ = min(X, x_max)``.  With the quantile function
``Q(u) = exp(mu + sigma*F_nu^{-1}(u))`` and ``u_c = F_nu((ln x_max - mu)/sigma)``::

    E[X~]       = int_0^{u_c} Q(u) du + x_max (1 - u_c)
    CVaR_a[X~]  = (int_a^{u_c} Q(u) du + x_max (1 - u_c)) / (1 - a)     if u_c > a
                = x_max                                                 otherwise

Quadrature (deterministic; never Monte Carlo)
---------------------------------------------
The u-axis is split at fixed breakpoints: decades ``1e-10 .. 0.1`` in the lower tail, ``0.5``,
and ``1 - 0.1, 1 - 0.01, 1 - 0.001, 1 - 0.0001`` (the TIE write-up's splits) continued by decades
down to ``1 - 1e-16``; the integral is additionally cut at ``u_c`` and at ``alpha``.  Each segment
``[u_k, u_{k+1}]`` is integrated with 16-point Gauss-Legendre after the substitution
``u = F_nu(t)`` (``du = f_nu(t) dt``), i.e. over ``[t_k, t_{k+1}] = F_nu^{-1}([u_k, u_{k+1}])``
with integrand ``exp(mu + sigma t) f_nu(t)``.  In ``t`` every tail segment spans a fixed ratio
(``t_{k+1}/t_k ~ 10^{1/nu}``), where the integrand is analytic far from the singularities of
``f_nu`` (at ``+-i sqrt(nu)``), so Gauss-Legendre converges geometrically; in ``u`` the integrand
has an essential singularity at ``u = 1`` and a ``u^{-1/nu}``-type one at ``u = 0``.  The
substitution also means the partial segments that end at ``u_c`` or ``alpha`` need only the
closed-form density, not the inverse CDF: the node positions and weights of every full segment
are precomputed once per ``nu`` (cached), so a call costs one ``stdtr`` (for ``1 - u_c``, computed
as a survival function so it keeps its precision near 1), one cached ``stdtrit`` (for ``alpha``)
and a few hundred ``exp``.

Mass below ``u = 1e-10`` is dropped: it is at most ``1e-10 * min(e^mu, x_max)`` while
``E[X~] >= 0.5 * min(e^mu, x_max)``, a relative error <= 2e-10.  Above ``u = 1 - 1e-16`` (reached
only when ``sigma`` is tiny, ``~< 1e-3``) one more open segment is integrated in ``ln t``.
Accuracy is checked against ``scipy.integrate.quad`` in tests/test_tie_math.py (<= 1e-3 relative,
observed ~1e-9 or better).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.typing import ArrayLike
from scipy import special

__all__ = [
    "adaptive_beta",
    "tie_moments",
    "tie_moments_many",
    "tie_score",
    "wait_decay",
]

_N_NODES = 16
_GL_X, _GL_W = np.polynomial.legendre.leggauss(_N_NODES)
_X01 = (_GL_X + 1.0) / 2.0  # nodes on [0, 1]
_W01 = _GL_W / 2.0  # weights on [0, 1]

# u-breakpoints: lower tail by decades, the median, upper tail by decades (survival probabilities).
_LOWER_U = 10.0 ** -np.arange(10, 0, -1, dtype=float)  # 1e-10 ... 1e-1
_UPPER_SF = 10.0 ** -np.arange(1, 17, dtype=float)  # 1e-1 ... 1e-16 (u = 1 - sf)


@dataclass(frozen=True)
class _NuTable:
    nu: float
    half_nu1: float  # (nu + 1) / 2
    log_c: float  # log of the Student-t density's normalising constant
    t_bp: tuple[float, ...]  # breakpoints in t (ascending), len n_seg + 1
    t_bp_arr: np.ndarray
    nodes: np.ndarray  # (n_seg, N) node positions in t
    weights: np.ndarray  # (n_seg, N) GL weight * segment half-width * f_nu(node)


def _log_pdf(t: np.ndarray, tab: _NuTable) -> np.ndarray:
    return _log_pdf_nu(t, tab.nu, tab.half_nu1, tab.log_c)


def _log_pdf_nu(t: np.ndarray, nu: float, half_nu1: float, log_c: float) -> np.ndarray:
    log_pdf: np.ndarray = log_c - half_nu1 * np.log1p(t * t / nu)
    return log_pdf


@lru_cache(maxsize=64)
def _table(nu: float) -> _NuTable:
    half_nu1 = (nu + 1) / 2
    log_c = float(
        special.gammaln(half_nu1) - special.gammaln(nu / 2) - 0.5 * math.log(nu * math.pi)
    )
    lower = special.stdtrit(nu, _LOWER_U)
    upper = -special.stdtrit(nu, _UPPER_SF)  # F^{-1}(1 - p) = -F^{-1}(p): exact near u = 1
    t_bp = np.concatenate([lower, [0.0], upper]).astype(float)
    if not np.all(np.diff(t_bp) > 0):  # pragma: no cover - stdtrit is monotone for nu > 0
        raise ValueError(f"nu={nu}: quadrature breakpoints are not increasing")
    a, b = t_bp[:-1, None], t_bp[1:, None]
    nodes = a + (b - a) * _X01[None, :]
    weights = (b - a) * _W01[None, :] * np.exp(_log_pdf_nu(nodes, nu, half_nu1, log_c))
    for arr in (t_bp, nodes, weights):
        arr.setflags(write=False)
    return _NuTable(nu, half_nu1, log_c, tuple(float(x) for x in t_bp), t_bp, nodes, weights)


@lru_cache(maxsize=256)
def _t_alpha(nu: float, alpha: float) -> float:
    return float(special.stdtrit(nu, alpha))


# ----------------------------------------------------------------------------- validation


def _check_scalar(mu: float, sigma: float, x_max: float, alpha: float, nu: float) -> None:
    if not math.isfinite(mu):
        raise ValueError(f"mu must be finite, got {mu!r}")
    if not (sigma > 0) or not math.isfinite(sigma):
        raise ValueError(f"sigma must be a finite number > 0, got {sigma!r}")
    if not (x_max >= 1) or not math.isfinite(x_max):
        raise ValueError(f"x_max must be a finite number >= 1, got {x_max!r}")
    if not (0 < alpha < 1):
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if not (nu > 0) or not math.isfinite(nu):
        raise ValueError(f"nu must be a finite number > 0, got {nu!r}")


def _check_array(name: str, a: np.ndarray, ok: np.ndarray, rule: str) -> None:
    if not np.all(ok):
        bad = a[~ok].ravel()[0]
        raise ValueError(f"{name} must be {rule}, got {bad!r} (at least one element)")


# ----------------------------------------------------------------------------- scalar path


def _partial_scalar(
    a: float, z: float, mu: float, sigma: float, tab: _NuTable, open_seg: bool
) -> np.ndarray:
    """Gauss-Legendre integrand values*weights of exp(mu+sigma t) f(t) on [a, z]."""
    values: np.ndarray
    if open_seg:  # beyond the last breakpoint (a > 0): integrate in v = ln t
        la, lz = math.log(a), math.log(z)
        t = np.exp(la + (lz - la) * _X01)
        values = (lz - la) * _W01 * t * np.exp(mu + sigma * t + _log_pdf(t, tab))
        return values
    t = a + (z - a) * _X01
    values = (z - a) * _W01 * np.exp(mu + sigma * t + _log_pdf(t, tab))
    return values


def tie_moments(
    mu: float, sigma: float, x_max: float, alpha: float = 0.9, nu: float = 3.5
) -> tuple[float, float]:
    """Return ``(E[X~], CVaR_alpha[X~])`` of the log-t length truncated at ``x_max``
    (docs/policies.md#tie).

    ``mu``, ``sigma``: location and scale of ``ln X`` (``sigma > 0``); ``x_max >= 1``: the
    truncation point (the request's ``max_tokens``); ``alpha`` in (0, 1); ``nu > 0`` the
    Student-t degrees of freedom.  Deterministic; relative error well below 1e-3.
    """
    mu, sigma, x_max, alpha, nu = float(mu), float(sigma), float(x_max), float(alpha), float(nu)
    _check_scalar(mu, sigma, x_max, alpha, nu)
    tab = _table(nu)
    z_c = (math.log(x_max) - mu) / sigma
    sf_c = float(special.stdtr(nu, -z_c))  # 1 - u_c, accurate near u_c -> 1
    t_a = _t_alpha(nu, alpha)

    bp = tab.t_bp
    n_seg = len(bp) - 1
    k_c = bisect_right(bp, z_c) - 1  # segment holding z_c; -1: below the first breakpoint
    if k_c < 0:  # u_c < 1e-10: the integral is negligible, E = x_max (1 - u_c)
        return x_max * sf_c, x_max

    # Full segments below z_c, cumulated; then the partial segments [bp_k, z_c] and [bp_k, t_a].
    if k_c > 0:
        seg = (tab.weights[:k_c] * np.exp(mu + sigma * tab.nodes[:k_c])).sum(axis=1)
        cum = np.cumsum(seg)
    else:
        cum = np.zeros(0)  # no full segment below z_c (and none below t_a <= z_c)
    i_c = (float(cum[k_c - 1]) if k_c > 0 else 0.0) + float(
        _partial_scalar(bp[k_c], z_c, mu, sigma, tab, k_c >= n_seg).sum()
    )
    e = i_c + x_max * sf_c
    if z_c <= t_a:  # u_c <= alpha
        return e, x_max
    k_a = bisect_right(bp, t_a) - 1
    if k_a < 0:
        i_a = 0.0
    else:
        i_a = (float(cum[k_a - 1]) if k_a > 0 else 0.0) + float(
            _partial_scalar(bp[k_a], t_a, mu, sigma, tab, k_a >= n_seg).sum()
        )
    cvar = (i_c - i_a + x_max * sf_c) / (1.0 - alpha)
    return e, cvar


# ----------------------------------------------------------------------------- vectorized path


def _g_many(
    z: np.ndarray, k: np.ndarray, cum: np.ndarray, mu: np.ndarray, sigma: np.ndarray, tab: _NuTable
) -> np.ndarray:
    """int_{-inf}^{z} exp(mu + sigma t) f(t) dt (mass below the first breakpoint dropped)."""
    n_seg = len(tab.t_bp) - 1
    out = np.zeros_like(z)
    have = k >= 0
    if not np.any(have):
        return out
    idx = np.nonzero(have)[0]
    kk = k[idx]
    full = np.where(kk > 0, cum[idx, np.maximum(kk - 1, 0)], 0.0)
    a = tab.t_bp_arr[np.minimum(kk, n_seg)]
    zz = z[idx]
    m, s = mu[idx, None], sigma[idx, None]
    open_seg = kk >= n_seg
    part = np.zeros_like(zz)
    lin = ~open_seg
    if np.any(lin):
        al, zl = a[lin, None], zz[lin, None]
        t = al + (zl - al) * _X01[None, :]
        part[lin] = (
            (zl - al) * _W01[None, :] * np.exp(m[lin] + s[lin] * t + _log_pdf(t, tab))
        ).sum(axis=1)
    if np.any(open_seg):
        la, lz = np.log(a[open_seg, None]), np.log(zz[open_seg, None])
        t = np.exp(la + (lz - la) * _X01[None, :])
        part[open_seg] = (
            (lz - la) * _W01[None, :] * t * np.exp(m[open_seg] + s[open_seg] * t + _log_pdf(t, tab))
        ).sum(axis=1)
    out[idx] = full + part
    return out


def _moments_one_nu(
    mu: np.ndarray, sigma: np.ndarray, x_max: np.ndarray, alpha: np.ndarray, nu: float
) -> tuple[np.ndarray, np.ndarray]:
    tab = _table(nu)
    z_c = (np.log(x_max) - mu) / sigma
    sf_c = special.stdtr(nu, -z_c)
    t_a = special.stdtrit(nu, alpha)
    k_c = np.searchsorted(tab.t_bp_arr, z_c, side="right") - 1
    k_a = np.searchsorted(tab.t_bp_arr, t_a, side="right") - 1
    # Full-segment sums, computed in one preallocated (N, n_seg * nodes) buffer (fresh temporaries
    # of this size cost more than the arithmetic); segments at or above k_c overflow harmlessly
    # to inf and are masked out afterwards.
    n_seg, n_nodes = tab.nodes.shape
    buf = np.multiply.outer(sigma, tab.nodes.ravel())
    buf += mu[:, None]
    with np.errstate(over="ignore"):
        np.exp(buf, out=buf)
    buf *= tab.weights.ravel()
    seg = buf.reshape(len(mu), n_seg, n_nodes).sum(axis=2)
    seg[np.arange(n_seg)[None, :] >= k_c[:, None]] = 0.0
    cum = np.cumsum(seg, axis=1)
    i_c = _g_many(z_c, k_c, cum, mu, sigma, tab)
    e = i_c + x_max * sf_c
    cvar = np.array(x_max, dtype=float, copy=True)
    tail = z_c > t_a
    if np.any(tail):
        i_a = _g_many(t_a, k_a, cum, mu, sigma, tab)
        cvar[tail] = ((i_c - i_a + x_max * sf_c) / (1.0 - alpha))[tail]
    return e, cvar


def tie_moments_many(
    mu: ArrayLike,
    sigma: ArrayLike,
    x_max: ArrayLike,
    alpha: ArrayLike = 0.9,
    nu: ArrayLike = 3.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized :func:`tie_moments`: arguments broadcast against each other (numpy rules).

    Returns two float arrays of the broadcast shape; element ``i`` equals
    ``tie_moments(mu[i], sigma[i], x_max[i], alpha[i], nu[i])`` (same quadrature).
    """
    mu, sigma, x_max, alpha, nu = np.broadcast_arrays(
        *(np.asarray(v, dtype=float) for v in (mu, sigma, x_max, alpha, nu))
    )
    shape = mu.shape
    mu, sigma, x_max, alpha, nu = (
        np.ascontiguousarray(v).ravel() for v in (mu, sigma, x_max, alpha, nu)
    )
    _check_array("mu", mu, np.isfinite(mu), "finite")
    _check_array("sigma", sigma, np.isfinite(sigma) & (sigma > 0), "a finite number > 0")
    _check_array("x_max", x_max, np.isfinite(x_max) & (x_max >= 1), "a finite number >= 1")
    _check_array("alpha", alpha, (alpha > 0) & (alpha < 1), "in (0, 1)")
    _check_array("nu", nu, np.isfinite(nu) & (nu > 0), "a finite number > 0")
    e = np.empty(mu.shape)
    cvar = np.empty(mu.shape)
    chunk = 1024  # bounds the (N, n_seg * nodes) work buffer to ~3.4 MiB
    for nu_val in np.unique(nu):
        sel = np.nonzero(nu == nu_val)[0]
        for start in range(0, len(sel), chunk):
            ix = sel[start : start + chunk]
            e[ix], cvar[ix] = _moments_one_nu(
                mu[ix], sigma[ix], x_max[ix], alpha[ix], float(nu_val)
            )
    return e.reshape(shape), cvar.reshape(shape)


# ----------------------------------------------------------------------------- score helpers


def tie_score(E: float, cvar: float, beta: float) -> float:
    """TIE priority score ``E[X~] + beta * CVaR_alpha[X~]`` (lower is served first)."""
    return E + beta * cvar


def adaptive_beta(queue_len: int, max_num_seqs: int, beta_min: float, beta_max: float) -> float:
    """``min(beta_max, max(beta_min, 0.1 * L_q / S))`` (docs/policies.md#tie); ``S`` must be
    >= 1."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs!r}")
    return min(beta_max, max(beta_min, 0.1 * queue_len / max_num_seqs))


def wait_decay(score: float, t_wait: float, decay: float, tau_s: float) -> float:
    """Starvation guard ``score * decay ** (t_wait / tau_s)`` (docs/policies.md#tie); ``tau_s``
    must be > 0."""
    if not (tau_s > 0):
        raise ValueError(f"tau_s must be > 0, got {tau_s!r}")
    decayed: float = score * decay ** (t_wait / tau_s)  # decay > 0: a float
    return decayed


_table(3.5)  # precompute the default-nu nodes/weights at import
