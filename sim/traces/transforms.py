"""Trace transforms: pure functions that return a new `Trace` (rate and time scaling, windows,
caps, token scaling, tenants, types, mixes); `transform` applies the command line's in their one
order. A transformed trace's name records what was done (`<name>|rate*2`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from sim.traces.model import REQUEST_TYPES, Trace, TraceRequest


def _rebuild(trace: Trace, requests: Iterable[TraceRequest], suffix: str) -> Trace:
    return Trace(f"{trace.name}|{suffix}", tuple(requests), trace.skipped)


def scale_rate(trace: Trace, factor: float) -> Trace:
    """Multiply the arrival rate by `factor` (arrivals divided by it); lengths are unchanged."""
    if not (math.isfinite(factor) and factor > 0.0):
        raise ValueError(f"factor must be finite and > 0, got {factor}")
    return _rebuild(
        trace,
        (dataclasses.replace(r, arrival=r.arrival / factor) for r in trace),
        f"rate*{factor:g}",
    )


def target_rate(trace: Trace, rps: float) -> Trace:
    """Rescale time so the mean rate (`Trace.rate`) becomes `rps` req/s."""
    if not (math.isfinite(rps) and rps > 0.0):
        raise ValueError(f"rps must be finite and > 0, got {rps}")
    current = trace.rate
    if not (math.isfinite(current) and current > 0.0):
        raise ValueError(
            f"trace {trace.name!r} has no finite positive rate ({current}); cannot retarget it"
        )
    return scale_rate(trace, rps / current)


def time_window(trace: Trace, start_s: float, duration_s: float) -> Trace:
    """Requests arriving in [start_s, start_s + duration_s), re-zeroed so the first is at 0.0.

    An empty window gives an empty trace.
    """
    if not (math.isfinite(start_s) and math.isfinite(duration_s) and duration_s > 0.0):
        raise ValueError(f"need finite start_s and duration_s > 0, got {start_s}, {duration_s}")
    end = start_s + duration_s
    kept = [r for r in trace if start_s <= r.arrival < end]
    t0 = kept[0].arrival if kept else 0.0
    return _rebuild(
        trace,
        (dataclasses.replace(r, arrival=r.arrival - t0) for r in kept),
        f"window[{start_s:g}s+{duration_s:g}s]",
    )


def cap_max_tokens(trace: Trace, cap: int) -> Trace:
    """Clamp `max_tokens` and the true `output_tokens` to `cap` (a server-side max_tokens limit).

    A request whose output was longer than `cap` is flagged `truncated` (and counted in
    `Trace.truncated`)."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap must be an integer >= 1, got {cap!r}")
    return _rebuild(
        trace,
        (
            dataclasses.replace(
                r,
                max_tokens=min(r.max_tokens, cap),
                output_tokens=min(r.output_tokens, cap),
                truncated=r.truncated or r.output_tokens > cap,
            )
            for r in trace
        ),
        f"cap{cap}",
    )


def transform(
    trace: Trace,
    *,
    window: tuple[float, float] | None = None,
    rate_scale: float | None = None,
    rate: float | None = None,
    max_tokens_cap: int | None = None,
    tenants: int | None = None,
    seed: int = 0,
) -> Trace:
    """The command line's transforms, in their one order: time window, rate scale, target rate,
    max_tokens cap, Zipf tenants (each skipped when None).

    The cap of requests whose source records none (--max-tokens-default) is not a transform: only
    a loader knows which requests had no cap, so it is the loaders' `max_tokens_default=`."""
    if window is not None:
        trace = time_window(trace, *window)
    if rate_scale is not None:
        trace = scale_rate(trace, rate_scale)
    if rate is not None:
        trace = target_rate(trace, rate)
    if max_tokens_cap is not None:
        trace = cap_max_tokens(trace, max_tokens_cap)
    if tenants:
        trace = assign_tenants_zipf(trace, tenants, seed=seed)
    return trace


def scale_tokens(trace: Trace, prompt_factor: float = 1.0, output_factor: float = 1.0) -> Trace:
    """Scale prompt and output lengths (rounded to nearest, at least 1 token).

    `max_tokens` (the client's cap, the same for every request of a source without caps) scales
    with `output_factor` too, so outputs stay within their caps and a truncated request stays at
    its cap.
    """
    for label, f in (("prompt_factor", prompt_factor), ("output_factor", output_factor)):
        if not (math.isfinite(f) and f > 0.0):
            raise ValueError(f"{label} must be finite and > 0, got {f}")

    def scaled(x: int, f: float) -> int:
        return max(1, round(x * f))

    return _rebuild(
        trace,
        (
            dataclasses.replace(
                r,
                prompt_tokens=scaled(r.prompt_tokens, prompt_factor),
                output_tokens=scaled(r.output_tokens, output_factor),
                max_tokens=scaled(r.max_tokens, output_factor),
            )
            for r in trace
        ),
        f"tokens*({prompt_factor:g},{output_factor:g})",
    )


def assign_tenants_zipf(trace: Trace, n_tenants: int, s: float = 1.1, seed: int = 0) -> Trace:
    """Assign tenants "t0".."t{n-1}" independently per request with Zipf(s) popularity:
    P(t_k) proportional to 1/(k+1)**s, so t0 is the most popular (s = 0 is uniform)."""
    if n_tenants < 1:
        raise ValueError(f"n_tenants must be >= 1, got {n_tenants}")
    if not (math.isfinite(s) and s >= 0.0):
        raise ValueError(f"s must be finite and >= 0, got {s}")
    weights = 1.0 / np.arange(1, n_tenants + 1, dtype=np.float64) ** s
    picks = np.random.default_rng(seed).choice(
        n_tenants, size=len(trace), p=weights / weights.sum()
    )
    return _rebuild(
        trace,
        (dataclasses.replace(r, tenant=f"t{k}") for r, k in zip(trace, picks.tolist())),
        f"zipf{n_tenants}(s={s:g})",
    )


def assign_tenants_from(trace: Trace, mapping_fn: Callable[[TraceRequest], str]) -> Trace:
    """Set each request's tenant to `mapping_fn(request)` (a non-empty string)."""

    def tenant_of(r: TraceRequest) -> str:
        tenant = mapping_fn(r)
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(
                f"mapping_fn returned {tenant!r} for request {r.id!r}; expected a non-empty str"
            )
        return tenant

    return _rebuild(trace, (dataclasses.replace(r, tenant=tenant_of(r)) for r in trace), "tenants")


def with_type(trace: Trace, type: str) -> Trace:
    """Set every request's type (one of REQUEST_TYPES)."""
    if type not in REQUEST_TYPES:
        raise ValueError(f"type must be one of {sorted(REQUEST_TYPES)}, got {type!r}")
    return _rebuild(trace, (dataclasses.replace(r, type=type) for r in trace), type)


def mix(
    parts: Sequence[tuple[Trace, float]],
    *,
    n: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """Mix traces by fraction, on the arrival times of the first part's trace.

    Arrival slots are the first trace's arrivals (the first `n`, and/or those before
    `duration_s`). If more slots are asked for than the first trace has, the arrivals are
    continued past its last one with a Poisson process at its mean rate. Each slot independently
    draws a part with probability `fraction_i` (seeded) and takes that part's lengths, tenant and
    type. The first part supplies its own request at that slot, so real arrival/length pairs are
    kept (continued slots cycle from its start); other parts supply requests in a seeded random
    order without replacement, reshuffled when exhausted. Ids are `<slot>-<source id>`, unique.
    Fractions must be >= 0 and sum to 1 within 1e-9, else ValueError.
    """
    if not parts:
        raise ValueError("mix needs at least one (trace, fraction) part")
    fractions = [float(f) for _, f in parts]
    total = math.fsum(fractions)
    if any(not math.isfinite(f) or f < 0.0 for f in fractions) or abs(total - 1.0) > 1e-9:
        raise ValueError(
            f"mix fractions must be >= 0 and sum to 1 (within 1e-9); got {fractions}, sum {total!r}"
        )
    for trace, f in parts:
        if f > 0.0 and len(trace) == 0:
            raise ValueError(f"mix part {trace.name!r} has fraction {f} but no requests")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if duration_s is not None and not duration_s > 0.0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")

    rng = np.random.default_rng(seed)
    base = parts[0][0]
    slots = _mix_slots(base, n, duration_s, rng)
    choice = rng.choice(len(parts), size=len(slots), p=np.asarray(fractions) / total)

    # Per-part draw order for parts other than the first: shuffled, without replacement.
    orders: dict[int, list[int]] = {}
    cursors: dict[int, int] = {}
    requests: list[TraceRequest] = []
    width = max(6, len(str(max(len(slots) - 1, 0))))
    for j, (arrival, part) in enumerate(zip(slots.tolist(), choice.tolist())):
        source = parts[part][0]
        if part == 0:
            src = source.requests[j % len(source)]
        else:
            k = cursors.get(part, 0)
            if k % len(source) == 0:
                orders[part] = rng.permutation(len(source)).tolist()
            src = source.requests[orders[part][k % len(source)]]
            cursors[part] = k + 1
        requests.append(dataclasses.replace(src, id=f"{j:0{width}d}-{src.id}", arrival=arrival))
    if name is None:
        name = "mix(" + "+".join(f"{f:g}*{t.name}" for t, f in parts) + ")"
    return Trace(name, tuple(requests))


def _mix_slots(
    base: Trace, n: int | None, duration_s: float | None, rng: np.random.Generator
) -> np.ndarray:
    arrivals = base.arrivals()
    if n is None and duration_s is None:
        return arrivals
    need_more = (n is not None and n > len(arrivals)) or (
        duration_s is not None and n is None and (len(arrivals) == 0 or arrivals[-1] < duration_s)
    )
    if need_more:
        rate = base.rate
        if not (math.isfinite(rate) and rate > 0.0):
            raise ValueError(
                f"mix: the first trace {base.name!r} has too few arrivals and no usable rate "
                f"({rate})"
            )
        last = arrivals[-1]
        extra: list[np.ndarray] = []
        while True:  # continue with Poisson arrivals until n / duration_s is covered
            gaps = rng.exponential(1.0 / rate, size=max(1024, (n or 0) - len(arrivals)))
            chunk = last + np.cumsum(gaps)
            extra.append(chunk)
            last = chunk[-1]
            total = len(arrivals) + sum(len(c) for c in extra)
            if (n is None or total >= n) and (
                duration_s is None or n is not None or last >= duration_s
            ):
                break
        arrivals = np.concatenate([arrivals, *extra])
    if duration_s is not None:
        arrivals = arrivals[arrivals < duration_s]
    if n is not None:
        arrivals = arrivals[:n]
    return arrivals
