"""Settings changes on live replicas (``tailpilot set``, the TUI): validate, PUT with If-Match,
wait until the replica runs the document, audit.

"applied" means active on the replica (its /state reports the version), "staged" accepted but not
active within ``APPLY_WAIT_S``; "rejected" the replica refused it (4xx, reason kept), "error" no
answer. Every outcome is an audit row when a store is given.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from controlplane.cluster import ClusterSpec, ReplicaSpec
from controlplane.http import TRANSPORT_ERRORS, Answer, describe_http_error
from controlplane.replica_http import (
    HttpFailure,
    PollingClient,
    StateFormatError,
    control_base,
    get_answer,
    make_client,
    opt_int,
    read_json,
)
from controlplane.retry import READ_BACK
from scheduler.settings import Settings, describe_error

APPLY_WAIT_S = 5.0  # how long `set` waits for a replica to run the document it accepted


@dataclass(slots=True)
class ApplyResult:
    replica: str
    # "applied" (active on the replica) | "staged" (accepted, not active yet) | "rejected" | "error"
    # | "skipped" (the change function found nothing to change: nothing sent)
    result: str
    message: str
    status: int | None = None  # the PUT's HTTP status, if one came back
    old: dict[str, Any] | None = None  # settings document before
    new: dict[str, Any] | None = None  # the document sent (applied: as the replica answered it)
    version: int | None = None  # the settings version after (applied) or as found (otherwise)
    restart_required: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The replica accepted the document (active now, or staged for its next step)."""
        return self.result in ("applied", "staged")


SettingsChange = Callable[[Any], Any] | Mapping[str, Any]


async def _current_settings(
    client: PollingClient, url: str, timeout_s: float, spec: ReplicaSpec
) -> dict[str, Any]:
    """The replica's ``{settings, version}`` (GET /settings); HttpFailure or StateFormatError."""
    resp = await get_answer(client, url, "GET settings", timeout_s, token=spec.token())
    current = read_json(resp, "GET settings")
    if (
        not isinstance(current, dict)
        or not isinstance(current.get("settings"), dict)
        or not isinstance(current.get("version"), int)
    ):
        raise StateFormatError("GET settings: expected {settings: {...}, version: N}")
    return current


def _new_document(res: ApplyResult, change: SettingsChange) -> dict[str, Any] | None:
    """The validated document ``change`` makes of ``res.old``; None when there is nothing to send
    (``res`` then says why: "skipped", or "rejected" before sending)."""
    produced: Any = None
    old = res.old or {}
    try:
        produced = change(Settings.model_validate(old)) if callable(change) else change
        if produced is None:
            res.result, res.message = "skipped", "nothing to change"
            return None
        if isinstance(produced, Settings):
            produced = produced.to_dict()
        if not isinstance(produced, Mapping):
            raise ValueError(
                f"the change must give a settings document, got {type(produced).__name__}"
            )
        # Engine fields a document leaves out keep the replica's values, as the replica's own
        # PUT does — not the model's defaults, which would read as a restart-required change.
        engine = produced.get("engine")
        if not isinstance(engine, Mapping):
            engine = {}
        produced = {**produced, "engine": {**old.get("engine", {}), **engine}}
        new_doc: dict[str, Any] = Settings.model_validate(produced).to_dict()  # validated first
    except (ValidationError, ValueError, KeyError, AttributeError) as err:
        res.result, res.message = "rejected", f"not sent: {describe_error(err)}"
        res.new = dict(produced) if isinstance(produced, Mapping) else None
        return None
    return new_doc


def _refused(
    res: ApplyResult, put: Answer, answer: Any, spec: ReplicaSpec, token: str | None
) -> None:
    """``res`` for a PUT the replica did not answer 200: rejected (a 4xx) or error, with its
    reason."""
    reason = answer.get("error") if isinstance(answer, dict) else None
    reason = reason or put.text.strip()[:200] or put.reason_phrase
    res.result = "rejected" if put.status_code in (400, 401, 403, 409, 422) else "error"
    res.message = f"HTTP {put.status_code}: {reason}"
    if put.status_code in (401, 403) and not token:
        res.message += (
            f" (no token: set ${spec.token_env})"
            if spec.token_env
            else " (no token_env in the cluster file)"
        )


async def _apply_one(
    client: PollingClient,
    cluster: ClusterSpec,
    spec: ReplicaSpec,
    change: SettingsChange,
    wait_s: float,
) -> ApplyResult:
    base = control_base(spec) + "/settings"
    timeout = cluster.timeout_s
    res = ApplyResult(spec.name, "error", "")
    try:
        current = await _current_settings(client, base, timeout, spec)
    except (HttpFailure, StateFormatError) as err:
        res.message = str(err)
        return res
    res.old, res.version = current["settings"], current["version"]
    new_doc = _new_document(res, change)
    if new_doc is None:
        return res
    res.new = new_doc
    headers = {"If-Match": str(res.version)}
    token = spec.token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        async with asyncio.timeout(timeout):
            put = await client.put_json(base, new_doc, headers, timeout)
    except TRANSPORT_ERRORS as err:
        res.message = describe_http_error(err, "PUT settings", timeout)
        return res
    res.status = put.status_code
    try:
        answer = json.loads(put.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        answer = None
    if put.status_code != 200:
        _refused(res, put, answer, spec, token)
        return res
    if not isinstance(answer, dict) or not isinstance(answer.get("version"), int):
        res.message = "PUT settings: the answer is not {settings, version}"
        return res
    res.new = answer.get("settings", new_doc)
    res.restart_required = list(answer.get("restart_required") or [])
    res.version = new_version = answer["version"]
    active, why = await _wait_active(client, spec, new_version, timeout, wait_s)
    if active is not None and active >= new_version:
        res.result = "applied"
        res.message = f"applied as version {new_version}, active" + (
            f" (the replica has since moved on to version {active})" if active > new_version else ""
        )
    else:
        res.result = "staged"
        res.message = f"staged as version {new_version}, not active yet: {why}"
    if res.restart_required:
        res.message += f"; restart required for {', '.join(res.restart_required)}"
    return res


async def _wait_active(
    client: PollingClient, spec: ReplicaSpec, version: int, timeout_s: float, wait_s: float
) -> tuple[int | None, str]:
    """Read the replica's /state until it runs ``version`` (or a later one), for at most ``wait_s``
    (:data:`~controlplane.retry.READ_BACK`): (the active version last seen, why it is not
    ``version`` yet)."""
    url = control_base(spec) + "/state"

    async def read_back() -> tuple[int | None, str]:
        try:
            doc = read_json(
                await get_answer(client, url, "state (read back)", timeout_s, token=spec.token()),
                "state (read back)",
            )
            active = opt_int(doc.get("settings_version")) if isinstance(doc, dict) else None
            return (
                active,
                f"the replica runs version {active} (a busy engine applies it at its next step)",
            )
        except (HttpFailure, StateFormatError) as err:
            return None, f"could not read it back ({err})"

    def not_yet(seen: tuple[int | None, str]) -> bool:
        return seen[0] is None or seen[0] < version

    return await READ_BACK.replace(deadline_s=wait_s).call_async(read_back, again=not_yet)


async def apply_settings(
    cluster: ClusterSpec,
    replica_names: Iterable[str] | None,
    change: SettingsChange,
    store: Any | None = None,
    who: str = "cli",
    *,
    client: PollingClient | None = None,
    wait_s: float = APPLY_WAIT_S,
    note: str | None = None,
) -> list[ApplyResult]:
    """Change the settings of the named replicas (all when ``replica_names`` is None), concurrently.

    ``change`` is a settings document, or a function from the replica's current
    :class:`~scheduler.settings.Settings` to a document (or a Settings) — e.g.
    ``lambda s: s.replace(params={"gamma": 8})``. Per replica: GET the current document and version,
    build and validate the new one, PUT it with ``If-Match`` and the bearer token from the replica's
    ``token_env``, then read ``/state`` until the replica runs the new version (at most ``wait_s``).
    Every attempt — applied (active), staged (accepted, not active within ``wait_s``), rejected
    (400/401/403/409, or invalid before sending) or error (down, timeout, 5xx) — is written to the
    store's audit log when a store is given (its message after ``note``, when given). A change
    function may return None: nothing is sent ("skipped").
    """
    names = [r.name for r in cluster.replicas] if replica_names is None else list(replica_names)
    specs = [cluster.replica(n) for n in names]  # KeyError naming the replicas for a typo
    own = client is None
    client = client or make_client(cluster)
    try:
        results = list(
            await asyncio.gather(*(_apply_one(client, cluster, s, change, wait_s) for s in specs))
        )
    finally:
        if own:
            await client.aclose()
    if store is not None:

        def audit() -> None:
            store.recordings.ensure_replicas(
                cluster.name, [(s.name, s.api_url, s.control_url) for s in specs]
            )
            for r in results:
                store.settings_log.record_settings_change(
                    cluster.name,
                    r.replica,
                    who=who,
                    old=r.old,
                    new=r.new,
                    result=r.result,
                    version=r.version,
                    message=f"{note}; {r.message}" if note else r.message,
                )

        await asyncio.to_thread(audit)
    return results
