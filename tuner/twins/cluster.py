"""Twin clusters: ``start_twins`` starts n twin replicas on one clock, fed round-robin from one
trace, side by side on their settings; ``TwinCluster`` holds them, stops them together and writes
the cluster file a collector reads (``controlplane.cluster``'s format). One twin is
``tuner.twins.replica``."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from controlplane.export import write_atomically
from scheduler.plugin.core import ReplicaCore
from scheduler.plugin.env import TOKEN_ENV
from scheduler.settings import Settings
from sim import traces
from sim.engine import EngineConfig
from sim.traces import Trace, TraceRequest
from tuner.closed_loop.recorded import load_any
from tuner.twins.feed import split_round_robin, trace_period
from tuner.twins.replica import DEFAULT_TICK_S, TwinClock, TwinReplica


class TwinCluster:
    """Twin replicas started together on one clock; a context manager that stops them."""

    def __init__(self, replicas: list[TwinReplica], clock: TwinClock, name: str = "twins") -> None:
        self.replicas = replicas
        self.clock = clock
        self.name = name

    def __enter__(self) -> TwinCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __iter__(self) -> Iterator[TwinReplica]:
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, i: int) -> TwinReplica:
        return self.replicas[i]

    def stop(self) -> None:
        """Stop every replica (their HTTP servers shut down in parallel)."""
        threads = [threading.Thread(target=r.stop, daemon=True) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def cluster_doc(
        self,
        name: str | None = None,
        token_env: str | None = TOKEN_ENV,
        governance: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The cluster file's document (``controlplane.cluster``'s format), with a
        ``governance`` block when given."""
        replicas = []
        for r in self.replicas:
            entry = {"name": r.name, "api_url": r.url, "control_url": r.control_url}
            if token_env:
                entry["token_env"] = token_env
            replicas.append(entry)
        cluster: dict[str, Any] = {"name": name or self.name, "replicas": replicas}
        if governance is not None:
            cluster["governance"] = dict(governance)
        return {"clusters": [cluster]}

    def write_cluster_yaml(
        self,
        path: str | os.PathLike[str],
        name: str | None = None,
        token_env: str | None = TOKEN_ENV,
        governance: Mapping[str, Any] | None = None,
    ) -> Path:
        # Atomically: a reader (an operator's recorder, a test) waiting for the file to appear
        # never reads half of it.
        doc = self.cluster_doc(name, token_env, governance)
        return write_atomically(Path(path), yaml.safe_dump(doc, sort_keys=False))


def start_twins(
    n: int,
    trace: Trace | Sequence[TraceRequest] | str | os.PathLike[str] | None = None,
    *,
    speed: float = 1.0,
    settings: Settings | Sequence[Settings] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    rate_scale: float = 1.0,
    loop: bool = True,
    seed: int = 0,
    token: str | None = None,
    config: EngineConfig | None = None,
    tick_s: float = DEFAULT_TICK_S,
    name_prefix: str = "twin",
    cluster_name: str = "twins",
    clock: TwinClock | None = None,
) -> TwinCluster:
    """Start ``n`` twins named ``{name_prefix}-0 ...`` on ``host`` (``port=0``: ephemeral ports;
    otherwise ``port``, ``port+1``, ...), fed round-robin from ``trace`` (a Trace, requests, a
    trace file, or None for the bundled Azure conv window) with its arrival rate multiplied by
    ``rate_scale``. ``seed`` goes to trace loaders that generate arrivals. ``token`` (default
    ``$TAILPILOT_TOKEN``) guards writes; without one, writes are refused as on a plugin.
    ``settings``: one document for every twin, or a sequence taken round-robin (side by side)."""
    if n < 1:
        raise ValueError(f"need at least one replica, got {n}")
    if trace is None:
        trace = traces.load_bundled()
    elif isinstance(trace, (str, os.PathLike)):
        trace = load_any(os.fspath(trace), seed=seed)
    if not isinstance(trace, Trace):
        trace = Trace("twin-trace", tuple(trace))
    if len(trace) == 0:
        raise ValueError("the trace is empty")
    if rate_scale != 1.0:
        trace = traces.scale_rate(trace, rate_scale)
    if settings is None:
        settings = Settings.model_validate({"policy": "sarathi"})
    per_twin = [settings] if isinstance(settings, Settings) else list(settings)
    if not per_twin:
        raise ValueError("settings: need at least one document")
    for doc in per_twin:
        ReplicaCore(doc)  # refuse what a live replica refuses (the oracle predictor) up front
    clock = clock or TwinClock(speed)
    period = trace_period(trace)
    shares = split_round_robin(trace, n)
    replicas: list[TwinReplica] = []
    try:
        for i, share in enumerate(shares):
            replicas.append(
                TwinReplica(
                    f"{name_prefix}-{i}",
                    share,
                    period=period,
                    loop=loop,
                    settings=per_twin[i % len(per_twin)],
                    config=config,
                    clock=clock,
                    host=host,
                    port=port + i if port else 0,
                    token=token,
                    tick_s=tick_s,
                ).start()
            )
    except BaseException:
        TwinCluster(replicas, clock).stop()
        raise
    return TwinCluster(replicas, clock, cluster_name)
