"""Who may speak for a tenant (scheduler/plugin/tenancy.py): the operator's choice, per replica."""

from __future__ import annotations

import pytest

from scheduler.plugin.env import PluginEnv, PluginEnvError
from scheduler.plugin.tenancy import UNVERIFIED, TenantIdentity, sign

KEY = b"gateway-secret"


def test_client_labels_are_taken_as_given_and_cleaned():
    who = TenantIdentity("client")
    assert who.tenant_of({"tenant": "acme"}) == "acme"
    assert who.tenant_of({}) == "default"


def test_a_gateway_label_counts_only_with_its_signature():
    who = TenantIdentity("gateway", KEY)
    assert who.tenant_of({"tenant": "acme", "tenant_sig": sign(KEY, "acme")}) == "acme"
    # A client naming another tenant without the key: unverified, whatever it claims.
    assert who.tenant_of({"tenant": "acme"}) == UNVERIFIED
    assert who.tenant_of({"tenant": "acme", "tenant_sig": sign(b"guess", "acme")}) == UNVERIFIED
    assert who.tenant_of({"tenant": "acme", "tenant_sig": sign(KEY, "other")}) == UNVERIFIED
    assert who.tenant_of({"tenant": ["acme"], "tenant_sig": 5}) == UNVERIFIED
    assert who.tenant_of({"tenant": "acme", "tenant_sig": "\udcff"}) == UNVERIFIED
    huge = "x" * 10_000_000  # never hashed: longer than any tenant name
    assert who.tenant_of({"tenant": huge, "tenant_sig": sign(KEY, huge)}) == UNVERIFIED


def test_none_ignores_every_label():
    assert TenantIdentity("none").tenant_of({"tenant": "acme"}) == "default"


def test_the_environment_names_what_is_wrong(tmp_path):
    with pytest.raises(PluginEnvError, match="TAILPILOT_TENANT_SOURCE='anyone'"):
        PluginEnv.read({"TAILPILOT_TENANT_SOURCE": "anyone"})
    with pytest.raises(PluginEnvError, match="needs TAILPILOT_TENANT_KEY_FILE"):
        PluginEnv.read({"TAILPILOT_TENANT_SOURCE": "gateway"}).identity()
    empty = tmp_path / "key"
    empty.write_bytes(b"  \n")
    env = {"TAILPILOT_TENANT_SOURCE": "gateway", "TAILPILOT_TENANT_KEY_FILE": str(empty)}
    with pytest.raises(PluginEnvError, match="empty"):
        PluginEnv.read(env).identity()
    with pytest.raises(PluginEnvError, match="cannot read"):
        PluginEnv.read({**env, "TAILPILOT_TENANT_KEY_FILE": str(tmp_path / "missing")}).identity()
    empty.write_bytes(KEY + b"\n")
    who = PluginEnv.read(env).identity()
    assert who.tenant_of({"tenant": "acme", "tenant_sig": sign(KEY, "acme")}) == "acme"
    assert PluginEnv.read({}).identity() == TenantIdentity("client")
