"""The vLLM plugin: tailpilot's scheduler inside vLLM's engine-core process, and its control API.

- ``vllm`` — the scheduler classes vLLM loads (``--scheduler-cls``), the only module that imports
  vLLM;
- ``core`` — what they share with the simulated twin replica: the policy, the waiting queue, the
  staged settings, the completions and step logs, the circuit breaker (``ReplicaCore``);
- ``api`` — the control API's HTTP server, bounded (``admission``: connections, rates, sizes);
  ``request`` reads a request, ``wire`` writes an answer;
- ``lease`` — the controllers' leases on a replica's knobs;
- ``env`` — the environment the plugin reads once at start-up; ``tenancy`` — who may name a
  request's tenant; ``paged_log`` — the bounded logs the API pages through.

Nothing is imported here: ``import scheduler.plugin.core`` must not load vLLM, and the plugin's
start-up cost is its own modules'.
"""

# The rooms other floors may use (tests/test_layers.py: an import from another floor names one of
# them). ``paged_log`` stays the plugin's own.
__all__ = ["admission", "api", "core", "env", "lease", "request", "tenancy", "vllm", "wire"]
