"""A control-API target over a bare ReplicaCore (no engine): what the API tests serve."""

from __future__ import annotations

from scheduler.plugin.core import ReplicaCore

IDLE_KV = {"used_blocks": 0, "total_blocks": 1, "usage": 0.0}


class CoreTarget:
    def __init__(self, core: ReplicaCore, kv: dict | None = None) -> None:
        self.core = core
        self.kv = kv or IDLE_KV

    def api_state(self, cursor):
        return self.core.state(cursor, self.kv)

    def api_settings(self):
        return self.core.settings_doc()

    def api_put_settings(self, doc, if_match, lease=None):
        answer = self.core.put_settings(doc, if_match, lease)
        self.core.apply_if_idle(self.core.clock())
        return answer

    def api_lease(self, doc):
        return self.core.leases.take(doc)

    def api_steps(self, cursor):
        steps, next_cursor = self.core.steps_since(cursor)
        return {"replica": self.core.replica, "steps": steps, "next_cursor": next_cursor}
