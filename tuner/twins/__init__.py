"""Twins: simulated replicas behind the same control API as a real one (``tailpilot twin``).

``replica`` (a twin: the engine simulator in real time, its control API and vLLM's endpoints),
``feed`` (the trace dealt to the twins), ``metrics`` (vLLM's ``/metrics`` of a twin).
"""

__all__ = ["replica"]
