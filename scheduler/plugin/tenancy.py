"""Who may speak for a tenant (README, "Security and limits"): where a request's tenant comes
from is the operator's decision, ``TAILPILOT_TENANT_SOURCE``:

* ``client`` (the default): the client's own label (``vllm_xargs: {"tenant": ...}``) — anyone
  who can send a request can name any tenant. The replica says so in ``/state``
  (``tenant_source``), and the governor does not throttle on such labels unless the cluster file
  says the operator trusts them (``governance.governor.trust_client_labels``).
* ``gateway``: a trusted gateway (which authenticates users and drops what clients put in
  ``vllm_xargs``) sets the label and its signature, ``tenant_sig`` = hex HMAC-SHA256 of the label
  with the key in ``TAILPILOT_TENANT_KEY_FILE``. A label without a valid signature counts as the
  tenant ``unverified``; nobody without the key can speak for a tenant.
* ``none``: labels are ignored; every request is the ``default`` tenant.

Standard library only: this runs in vLLM's step.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from scheduler.names import DEFAULT_TENANT, NAME_MAX_CHARS
from scheduler.settings import clean_name

TenantSource = Literal["client", "gateway", "none"]
UNVERIFIED = "unverified"  # a gateway-mode label without a valid signature
SIG_CHARS = 64  # hex SHA-256


def sign(key: bytes, tenant: str) -> str:
    """The signature a trusted gateway puts beside ``tenant`` (``tenant_sig``)."""
    return hmac.new(key, tenant.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class TenantIdentity:
    """How this replica reads a request's tenant (see the module docstring)."""

    source: TenantSource = "client"
    key: bytes | None = None  # gateway mode's signing key

    def tenant_of(self, extra: Mapping[str, Any]) -> str:
        """The tenant of a request whose ``vllm_xargs`` are ``extra``."""
        if self.source == "none":
            return DEFAULT_TENANT
        label = extra.get("tenant")
        if self.source == "client":
            return clean_name(label)
        sig = extra.get("tenant_sig")
        if (
            self.key is not None
            and isinstance(label, str)
            and len(label) <= NAME_MAX_CHARS  # a longer one is no tenant's: not even hashed
            and isinstance(sig, str)
            and len(sig) == SIG_CHARS
            and hmac.compare_digest(sig.encode("ascii", "replace"), sign(self.key, label).encode())
        ):
            return clean_name(label)
        return UNVERIFIED
