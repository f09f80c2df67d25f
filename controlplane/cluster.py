"""The cluster file: which replicas make up which cluster, and how to reach them.

    clusters:
      - name: prod
        poll_interval_s: 1.0          # how often the collector polls each replica
        timeout_s: 2.0                # one request's limit; a slower replica is marked unhealthy
        window_s: 60                  # rolling window of the tail percentiles
        slos: {ttft_p99: 2.0, ttlt_p99: 60.0}   # per-tenant SLOs (seconds) for SCR
        governance:                   # optional: tenants, types and alerts (seed 003)
          tenants:
            acme: {commit_tok_s: 5000, ttft: {p50: 0.5, p90: 1.0, p99: 2.0}, ttlt: {p99: 60}}
            beta: {weight: 0.5}
          type_shares: {batch: 0.1}   # minimum shares; default (1/|T|)/(1 + type_eta·p_k)
          alerts: {scr_warning: 0.95, scr_critical: 0.90, jfi: 0.90, type_fairness: 0.5,
                   for_s: 30, keep_firing_for_s: 60}   # held before firing / before resolving
          governor: {scr_below: 0.85, jfi_below: 0.80, dwell_s: 60}   # record --govern
        replicas:
          - name: a100-0
            api_url: http://127.0.0.1:8000        # vLLM's OpenAI server (/metrics lives here)
            control_url: http://127.0.0.1:8001    # tailpilot's control API (/tailpilot/v1/...)
            token_env: TAILPILOT_TOKEN            # bearer token for writes, read from this env var

Several clusters per file. Unknown keys, bad URLs and duplicate names are errors naming the field
(``clusters[0].replicas[1].control_url: ...``); a key written twice in one mapping is an error
naming the key and its line, and a file that is not UTF-8 one naming the byte offset. Tokens never
live in the file, only the name of the environment variable that holds one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from controlplane import strict_yaml
from controlplane.governance import GovernanceSpec
from scheduler.errors import TailpilotError
from scheduler.metrics import METRICS
from scheduler.plugin.wire import read_capped
from scheduler.validation import describe_validation

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
MAX_CLUSTER_FILE_BYTES = 16 * 1024 * 1024  # 10,000 tenants' SLOs are ~2 MiB of YAML


class ClusterFileError(TailpilotError, ValueError):
    """A cluster file that cannot be used; the message names the file and the field."""


def _check_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL with a host")
    try:
        parts.port  # noqa: B018 (raises on a malformed port)
    except ValueError:
        raise ValueError(f"{value!r} has an invalid port") from None
    if parts.query or parts.fragment:
        raise ValueError(f"{value!r}: a base URL takes no query or fragment")
    return value.rstrip("/")


class ReplicaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    api_url: str
    control_url: str
    token_env: Annotated[str | None, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = None
    # Replicas of one pool serve the same traffic (one load balancer in front): the autopilot
    # replays the first one's and carries its decisions out on every member — one set of shadows
    # per pool, not per replica.
    pool: Annotated[str | None, Field(pattern=NAME_PATTERN)] = None

    _url = field_validator("api_url", "control_url")(_check_url)

    @property
    def metrics_url(self) -> str:
        return f"{self.api_url}/metrics"

    def token(self) -> str | None:
        """The bearer token from the environment (None if no variable is named or it is unset)."""
        return os.environ.get(self.token_env) if self.token_env else None


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    poll_interval_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 2.0
    window_s: Annotated[float, Field(gt=0, le=86_400)] = 60.0
    slos: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    # Tenants' commitments and SLO vectors, type shares and alert thresholds: the collector
    # computes SCR, JFI and type fairness per window and raises alerts (None: not governed).
    governance: GovernanceSpec | None = None
    replicas: Annotated[list[ReplicaSpec], Field(min_length=1)]

    @field_validator("slos")
    @classmethod
    def _known_metrics(cls, slos: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(slos) - set(METRICS))
        if unknown:
            raise ValueError(
                f"unknown metric {unknown[0]!r} (known: ttft_p99, ttlt_p99, tbt_p99, ...)"
            )
        return slos

    @model_validator(mode="after")
    def _unique_replicas(self) -> ClusterSpec:
        seen: set[str] = set()
        for r in self.replicas:
            if r.name in seen:
                raise ValueError(f"replica name {r.name!r} appears twice")
            seen.add(r.name)
        return self

    def replica(self, name: str) -> ReplicaSpec:
        for r in self.replicas:
            if r.name == name:
                return r
        raise KeyError(
            f"cluster {self.name!r} has no replica {name!r} "
            f"(it has {', '.join(r.name for r in self.replicas)})"
        )


class ClusterFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    clusters: Annotated[list[ClusterSpec], Field(min_length=1)]

    @model_validator(mode="after")
    def _unique_clusters(self) -> ClusterFile:
        names = [c.name for c in self.clusters]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise ValueError(f"cluster name {dup!r} appears twice")
        return self

    def cluster(self, name: str | None = None) -> ClusterSpec:
        """The named cluster, or the only one when the file has one."""
        if name is None:
            if len(self.clusters) > 1:
                raise KeyError(
                    f"the file has {len(self.clusters)} clusters "
                    f"({', '.join(c.name for c in self.clusters)}); name one"
                )
            return self.clusters[0]
        for c in self.clusters:
            if c.name == name:
                return c
        raise KeyError(
            f"no cluster {name!r} (the file has {', '.join(c.name for c in self.clusters)})"
        )


def parse_cluster_file(text: str | bytes, source: str = "<cluster file>") -> ClusterFile:
    """The cluster file in ``text`` (bytes must be UTF-8); ClusterFileError naming ``source`` and
    where."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ClusterFileError(
                f"{source}: not UTF-8 text (byte 0x{text[err.start]:02x} at offset {err.start})"
            ) from None
    try:
        doc = strict_yaml.load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ClusterFileError(
            f"{source}{where}: not valid YAML: {getattr(err, 'problem', err)}"
        ) from None
    if not isinstance(doc, dict):
        raise ClusterFileError(f"{source}: expected a mapping with a 'clusters' list")
    try:
        return ClusterFile.model_validate(doc)
    except ValidationError as err:
        raise ClusterFileError(f"{source}: " + describe_validation(err, root="file")) from None


def load_cluster_file(path: str | Path) -> ClusterFile:
    path = Path(path)
    try:
        # Decoded as UTF-8 whatever the locale, like every YAML file; capped, a regular file only
        # (a FIFO would hang the reader, /dev/zero never ends).
        data = read_capped(path, MAX_CLUSTER_FILE_BYTES, "cluster file")
    except OSError as err:
        raise ClusterFileError(f"{path}: cannot read: {err.strerror or err}") from None
    except ValueError as err:
        raise ClusterFileError(f"{path}: {err}") from None
    return parse_cluster_file(data, str(path))


def dump_cluster_file(clusters: ClusterFile) -> str:
    text: str = yaml.safe_dump(clusters.model_dump(exclude_defaults=True), sort_keys=False)
    return text
