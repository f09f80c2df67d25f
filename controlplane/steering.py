"""Settings changes on live replicas (``tailpilot set``, the TUI): validate, PUT with If-Match,
wait until the replica runs the document, audit.

"applied" means active on the replica (its /state reports the version), "staged" accepted but not
active within ``APPLY_WAIT_S``; "rejected" the replica refused it (4xx, reason kept), "error" no
answer. Every outcome is an audit row when a store is given.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

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
from scheduler.plugin.lease import LEASE_HEADER
from scheduler.settings import Settings, describe_error
from scheduler.settings_change import SettingsChange

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


class Change(Protocol):
    """What ``apply_settings`` carries: a change of a replica's settings that makes the new
    document of the one the replica runs when it is sent
    (``scheduler.settings_change.SettingsChange``, the TUI's recommendation, the governor's mode,
    the autopilot's target). ``apply`` may answer None: nothing to change there ("skipped",
    nothing sent)."""

    def apply(self, current: Settings) -> Settings | None: ...


# A change, or a whole settings document (the engine fields it leaves out keep the replica's).
ChangeOrDocument = Change | Settings | Mapping[str, Any]


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


def _new_document(res: ApplyResult, change: ChangeOrDocument) -> dict[str, Any] | None:
    """The validated document ``change`` makes of ``res.old``; None when there is nothing to send
    (``res`` then says why: "skipped", or "rejected" before sending). A whole document is
    carried as ``SettingsChange.whole``: its missing engine fields are the replica's, as its own
    PUT does."""
    if isinstance(change, (Mapping, Settings)):
        change = SettingsChange.whole(change)
    old = res.old or {}
    try:
        current = Settings.model_validate(old)
    except (ValidationError, ValueError) as err:
        if isinstance(change, SettingsChange) and change.is_whole:
            # A whole document needs only the replica's engine fields: it is how a replica
            # running a newer plugin (a field this version does not know) is set back.
            return _whole_on_engine(res, change, old.get("engine") or {})
        res.result = "rejected"
        res.message = (
            "not sent: the replica's settings document is not one this version reads "
            f"({describe_error(err)})"
        )
        return None
    try:
        if not callable(getattr(change, "apply", None)):
            raise ValueError(
                f"a change needs apply(current) (a SettingsChange) or is a whole settings "
                f"document, got {type(change).__name__}"
            )
        produced = change.apply(current)
        if produced is None:
            res.result, res.message = "skipped", "nothing to change"
            return None
        if not isinstance(produced, Settings):
            raise ValueError(f"the change must give Settings, got {type(produced).__name__}")
    except (ValidationError, ValueError, KeyError, AttributeError) as err:
        res.result, res.message = "rejected", f"not sent: {describe_error(err)}"
        document = getattr(change, "document", None)  # what would have been sent, for the audit
        res.new = dict(document) if isinstance(document, Mapping) else None
        return None
    # Validated where it was made (a change's apply starts from the replica's document, so its
    # engine fields are the replica's); the replica validates it again.
    return produced.to_dict()


def _whole_on_engine(
    res: ApplyResult, change: SettingsChange, engine: Any
) -> dict[str, Any] | None:
    """``change``'s whole document with ``engine``'s fields where it leaves them out (the replica's
    engine block, its document otherwise unread); None, with ``res`` rejected, when invalid."""
    try:
        return change.on_engine(engine if isinstance(engine, Mapping) else {}).to_dict()
    except (ValidationError, ValueError) as err:
        res.result, res.message = "rejected", f"not sent: {describe_error(err)}"
        res.new = dict(change.document or {})
        return None


def _refused(
    res: ApplyResult, put: Answer, answer: Any, spec: ReplicaSpec, token: str | None
) -> None:
    """``res`` for a PUT the replica did not answer 200: rejected (a 4xx) or error, with its
    reason."""
    res.result = "rejected" if put.status_code in (400, 401, 403, 409, 422) else "error"
    res.message = f"HTTP {put.status_code}: {_reason(put, answer)}"
    if put.status_code in (401, 403) and not token:
        res.message += (
            f" (no token: set ${spec.token_env})"
            if spec.token_env
            else " (no token_env in the cluster file)"
        )


def _json_answer(put: Answer) -> Any:
    """A PUT's answer as JSON, None when it is not JSON."""
    try:
        return json.loads(put.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _reason(put: Answer, answer: Any) -> str:
    """Why a replica refused a PUT: its ``error``, else the start of its body, else the status's
    phrase."""
    reason = answer.get("error") if isinstance(answer, dict) else None
    return str(reason or put.text.strip()[:200] or put.reason_phrase)


async def _apply_one(
    client: PollingClient,
    cluster: ClusterSpec,
    spec: ReplicaSpec,
    change: ChangeOrDocument,
    wait_s: float,
    lease: LeaseKeeper | None = None,
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
    if lease is not None:  # a controller's change: refused while another holds its kind's lease
        headers[LEASE_HEADER] = lease.header
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
    answer = _json_answer(put)
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
    change: ChangeOrDocument,
    store: Any | None = None,
    who: str = "cli",
    *,
    client: PollingClient | None = None,
    wait_s: float = APPLY_WAIT_S,
    note: str | None = None,
    lease: LeaseKeeper | None = None,
) -> list[ApplyResult]:
    """Change the settings of the named replicas (all when ``replica_names`` is None), concurrently.

    ``change`` is a :class:`Change` — e.g. ``SettingsChange(params={"gamma": 8})``, applied to
    each replica's current settings as read — or a whole settings document. Per replica: GET the
    current document and version, build and validate the new one, PUT it with ``If-Match`` and
    the bearer token from the replica's ``token_env``, then read ``/state`` until the replica runs
    the new version (at most ``wait_s``). Every attempt — applied (active), staged (accepted, not
    active within ``wait_s``), rejected (400/401/403/409, or invalid before sending) or error
    (down, timeout, 5xx) — is written to the store's audit log when a store is given (its message
    after ``note``, when given). A change may answer None: nothing is sent ("skipped"). A
    controller passes its ``lease``: the document goes under it, and a replica whose lease
    another holds refuses it (409).
    """
    names = [r.name for r in cluster.replicas] if replica_names is None else list(replica_names)
    specs = [cluster.replica(n) for n in names]  # KeyError naming the replicas for a typo
    own = client is None
    client = client or make_client(cluster)
    try:
        results = list(
            await asyncio.gather(
                *(_apply_one(client, cluster, s, change, wait_s, lease) for s in specs)
            )
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


def record_dry_run(
    store: Any,
    cluster: str,
    replica: str,
    change: Change,
    current: Mapping[str, Any] | None,
    *,
    who: str,
    note: str,
    reason: str = "dry-run",
) -> str:
    """What a controller in dry-run would send ``replica``: ``change`` applied to the document
    it runs (``current``, as it last reported it), written to the audit log with result
    ``dry-run`` — or ``skipped`` when there is nothing to change or the document is not one this
    version reads — and nothing sent. Returns the result (blocking: the store's write)."""
    new, why = None, "nothing to change" if current is not None else "no settings read from it"
    if current is not None:
        # What a replica reports is its own: a document this version cannot read (a newer
        # plugin's field, a broken replica) skips that replica, never the controller's step.
        try:
            new = change.apply(Settings.model_validate(current))
        except (ValidationError, ValueError, TypeError) as err:
            why = f"its settings document is not one this version reads ({describe_error(err)})"
    result = "dry-run" if new is not None else "skipped"
    if new is not None:
        message = f"{note}; not sent ({reason})"
    elif reason == "dry-run":
        message = f"{note}; {why}"
    else:  # not sent for its own reason (another's lease, an unreachable replica), and why not
        message = f"{note}; not sent ({reason}): {why}"
    store.settings_log.record_settings_change(
        cluster,
        replica,
        who=who,
        old=None if current is None else dict(current),
        new=None if new is None else new.to_dict(),
        result=result,
        message=message,
    )
    return result


# --- controllers' leases (scheduler.plugin.lease) ---------------------------------------------
LEASE_TTL_S = 120.0  # a controller renews its lease once half of it has passed


@dataclass(slots=True)
class LeaseKeeper:
    """A controller's leases on the replicas it steers: one holder name per controller process,
    taken and renewed through ``PUT /lease`` before any change; a replica whose lease another
    holder has is one this controller only dry-runs on (``others`` says who holds it)."""

    kind: str  # "autopilot" | "governor"
    holder: str = ""
    ttl_s: float = LEASE_TTL_S
    until: dict[str, float] = field(default_factory=dict)  # replica -> held until (our clock)
    others: dict[str, str] = field(default_factory=dict)  # replica -> why it is not ours

    def __post_init__(self) -> None:
        self.holder = self.holder or f"{self.kind}-{uuid.uuid4().hex[:12]}"

    @property
    def header(self) -> str:
        return f"{self.kind} {self.holder}"

    async def hold(
        self, cluster: ClusterSpec, replica: str, now: float, client: PollingClient | None = None
    ) -> str | None:
        """Take or renew this controller's lease on ``replica`` (when half of it has passed):
        None when it is ours, else why not (another holder, named; an unreachable replica). A
        replica without leases (an older plugin: 404) is steered as before."""
        if self.until.get(replica, -math.inf) - now > self.ttl_s / 2:
            return None
        answer = await self._put(cluster, replica, self.ttl_s, client)
        if answer is None:
            self.until[replica] = now + self.ttl_s
            self.others.pop(replica, None)
            return None
        self.until.pop(replica, None)
        self.others[replica] = answer
        return answer

    async def release(self, cluster: ClusterSpec, replica: str) -> None:
        """Give the lease back (disarmed, paused, dry-run): another controller may take over
        at once instead of after its expiry."""
        if self.until.pop(replica, None) is not None:
            await self._put(cluster, replica, 0.0, None)

    async def _put(
        self, cluster: ClusterSpec, replica: str, ttl_s: float, client: PollingClient | None
    ) -> str | None:
        spec = cluster.replica(replica)
        doc = {"controller": self.kind, "holder": self.holder, "ttl_s": ttl_s}
        headers = {"Authorization": f"Bearer {spec.token()}"} if spec.token() else {}
        own = client is None
        client = client or make_client(cluster)
        try:
            async with asyncio.timeout(cluster.timeout_s):
                put = await client.put_json(
                    control_base(spec) + "/lease", doc, headers, cluster.timeout_s
                )
        except TRANSPORT_ERRORS as err:
            return describe_http_error(err, "PUT lease", cluster.timeout_s)
        finally:
            if own:
                await client.aclose()
        if put.status_code in (200, 404):
            return None
        return f"HTTP {put.status_code}: {_reason(put, _json_answer(put))}"
