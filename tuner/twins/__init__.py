"""Twins: simulated replicas behind the same control API as a real one (``tailpilot twin``).

``replica`` (a twin: the engine simulator in real time, its control API and vLLM's endpoints),
``cluster`` (twins started together: ``start_twins``, and the cluster file they make), ``feed``
(the trace dealt to the twins), ``metrics`` (vLLM's ``/metrics`` of a twin).
"""

__all__ = ["cluster", "replica"]
